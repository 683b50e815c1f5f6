"""Transport options, declared and checked one way.

Each transport declares the options its sender and its receiver take (:class:`Option`:
name, type, default, whether the URL's query may carry it). :func:`resolve` merges a URL's
query with keyword arguments, converts and checks each value, and turns anything
undeclared into a :class:`~streamsync.errors.ConfigError` that names it and lists the valid
ones. A keyword overrides the URL's value, except for an option marked ``must_agree``
(``connect_timeout``): there a keyword and the URL that disagree are a ``ConfigError``
naming it.

Timeouts, on every transport (the in-memory fake included), follow one rule:

- ``connect_timeout`` bounds each wait for the peer to be there: a receiver reaching its
  sender when it opens, a sender waiting for its receivers to join. It is a channel
  option: a keyword of ``open_sender``/``open_receiver`` (default 60 s) or of
  ``send``/``receive`` given a URL, or the URL's ``?connect_timeout=``.
- ``timeout`` (``send``/``receive``) bounds each wait of a sync once the sides are
  connected: a free slot, the next message, the receivers' reports. A sync that starts on
  an open sender whose receivers are not all there waits for them within both bounds.
- ``send``/``receive`` given a URL, with ``connect_timeout`` neither a keyword nor in the
  URL, wait ``timeout`` for the peer: ``receive(url, sink, timeout=3)`` with no sender
  gives up after 3 s.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from streamsync.errors import ConfigError
from streamsync.wire.pack import DEFAULT_BUCKET_BYTES, MIN_BUCKET_BYTES

_BOOLS = {
    **dict.fromkeys(("1", "true", "yes", "on"), True),
    **dict.fromkeys(("0", "false", "no", "off"), False),
}


@dataclass(frozen=True)
class Option:
    """One option a transport takes."""

    name: str
    #: ``int``, ``float``, ``bool`` or ``str`` (converted from a URL's text), or ``object``
    #: (keyword only, passed as given).
    kind: type
    default: Any
    #: What it is for (shown in error messages' lists and in ``streamsync.transports``).
    help: str
    #: Whether the URL's query may carry it (secrets never: they would end up in logs).
    in_url: bool = True
    #: Smallest valid value of an ``int`` or ``float`` option.
    minimum: float | None = None
    #: A further check: a complaint, or ``None`` when the value is valid.
    check: Callable[[Any], str | None] | None = None
    #: Given both in the URL and as a keyword, the two must agree (else a ``ConfigError``
    #: naming it) rather than the keyword winning: a bound on waiting that a keyword
    #: silently replaced would leave a user waiting for a limit they did not set.
    must_agree: bool = False

    def convert(self, where: str, raw: Any, *, from_url: bool) -> Any:
        """``raw`` (text from the URL, or a keyword's value) checked and converted."""
        value = _from_text(self, raw) if from_url else raw
        if self.kind in (int, float):
            numeric = isinstance(value, int) if self.kind is int else isinstance(value, int | float)
            if isinstance(value, bool) or not numeric:
                raise ConfigError(
                    f"{where}: option {self.name}={value!r} is not {_a(self.kind)} ({self.help})"
                )
            if self.minimum is not None and value < self.minimum:
                raise ConfigError(
                    f"{where}: option {self.name}={value!r}; need at least {self.minimum:g} "
                    f"({self.help})"
                )
        elif self.kind is bool and not isinstance(value, bool):
            raise ConfigError(f"{where}: option {self.name}={value!r} is not true or false")
        elif self.kind is str and not isinstance(value, str):
            raise ConfigError(f"{where}: option {self.name}={value!r} is not a string")
        if self.check is not None:
            complaint = self.check(value)
            if complaint is not None:
                raise ConfigError(f"{where}: option {self.name}={value!r}: {complaint}")
        return value


def _a(kind: type) -> str:
    return {int: "an integer", float: "a number", bool: "true or false"}.get(kind, kind.__name__)


def _from_text(option: Option, raw: str) -> Any:
    """``raw`` as ``option.kind``; text that is not one stays text, for ``convert`` to
    refuse."""
    try:
        if option.kind in (int, float):
            return option.kind(raw)
    except ValueError:
        return raw
    return _BOOLS.get(raw.lower(), raw) if option.kind is bool else raw


def _unknown(where: str, name: str, valid: Sequence[str], what: str) -> ConfigError:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.7)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(
        f"{where}: unknown {what} {name!r}{hint}; valid: {', '.join(valid) or 'none'}"
    )


def resolve(
    where: str,
    declared: Sequence[Option],
    query: Mapping[str, str],
    kwargs: Mapping[str, Any],
    *,
    caller: tuple[str, Sequence[str]] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Every declared option's value: keyword arguments over the URL's query over
    ``defaults`` (values in place of declared defaults) over the declared defaults. An
    undeclared name, an option the URL may not carry, a value of the wrong type or below
    its minimum, a ``must_agree`` option whose keyword and URL values differ is a
    :class:`ConfigError` naming it. ``caller`` (its name and its own keywords) makes an
    unknown keyword's message list those too."""
    by_name = {o.name: o for o in declared}
    in_url = [o.name for o in declared if o.in_url]
    values = {o.name: o.default for o in declared}
    values.update((k, v) for k, v in (defaults or {}).items() if k in by_name)
    for name, raw in query.items():
        option = by_name.get(name)
        if option is None or not option.in_url:
            if option is not None:
                raise ConfigError(
                    f"{where}: option {name!r} cannot be given in the URL; pass {name}= "
                    "as a keyword argument"
                )
            raise _unknown(where, name, in_url, "URL option")
        values[name] = option.convert(where, raw, from_url=True)
    for name, value in kwargs.items():
        option = by_name.get(name)
        if option is None:
            if caller is not None:
                what = f"keyword of {caller[0]}()"
                raise _unknown(where, name, [*caller[1], *by_name], what)
            raise _unknown(where, name, list(by_name), "option")
        converted = option.convert(where, value, from_url=False)
        if option.must_agree and name in query and converted != values[name]:
            raise ConfigError(
                f"{where}: option {name}={converted!r} disagrees with the URL's "
                f"{name}={query[name]}; give it once"
            )
        values[name] = converted
    return values


def _secret(value: Any) -> str | None:
    if value is None or isinstance(value, str | bytes):
        return None
    return "use a str or bytes (or None for $STREAMSYNC_SECRET)"


#: The channel's shared secret (never in a URL: URLs end up in logs).
SECRET = Option(
    "secret",
    object,
    None,
    "shared secret (default $STREAMSYNC_SECRET)",
    in_url=False,
    check=_secret,
)
#: The ZeroMQ link's keepalive over tcp (zmq and torch transports): seconds of silence
#: before a probe and between probes, rounded to whole seconds of at least 1; 3 unanswered
#: probes drop the connection.
HEARTBEAT = Option(
    "heartbeat",
    float,
    1.0,
    "seconds between TCP keepalive probes (whole, at least 1)",
    minimum=0.01,
)
#: The GPU of a CUDA transport (default: the current device).
DEVICE = Option("device", object, None, "the GPU (default: the current device)", in_url=False)

#: Seconds each wait for the peer to be there may take (see the rule above).
CONNECT_TIMEOUT = Option(
    "connect_timeout",
    float,
    60.0,
    "seconds to wait for the peer to be there (send/receive: default their timeout)",
    minimum=0,
    must_agree=True,
)

#: What every sender takes.
SENDER_OPTIONS: tuple[Option, ...] = (
    Option(
        "receivers",
        int,
        1,
        "how many receivers each sync waits for (0: as many as the first to join says)",
        minimum=0,
    ),
    Option("slots", int, 2, "buckets in flight (2 or more to pipeline)", minimum=1),
    Option("slot_bytes", int, DEFAULT_BUCKET_BYTES, "bytes per slot", minimum=MIN_BUCKET_BYTES),
    Option("require_all", bool, True, "a sync needs every receiver (False: those there)"),
    SECRET,
    CONNECT_TIMEOUT,
)


def _bytes(value: Any) -> str | None:
    return None if isinstance(value, bytes) else "use bytes"


#: What a receiver of a transport between processes tells its sender as it joins: how
#: many receivers join with it (a sender opened with ``receivers=0`` learns its count from
#: the first), and opaque bytes of what it is (``Sender.introductions()``).
INTRODUCTION: tuple[Option, ...] = (
    Option("group", int, 0, "how many receivers join with this one (0: not said)", minimum=0),
    Option("team", str, "", "which group it belongs to (an engine's id)"),
    Option(
        "facts",
        object,
        b"",
        "what this receiver tells the sender of itself",
        in_url=False,
        check=_bytes,
    ),
)

#: What every receiver takes.
RECEIVER_OPTIONS: tuple[Option, ...] = (
    SECRET,
    CONNECT_TIMEOUT,
    *INTRODUCTION,
)
