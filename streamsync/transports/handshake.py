"""The handshake every linked transport runs when a receiver joins.

The receiver sends ``Hello`` with a fresh nonce; the sender checks it, reserves an index and
answers ``Welcome`` with the slot layout, its own nonce and the receiver's echoed (no replayed
``Welcome``); the receiver confirms with ``Joined`` under the session's key, and only then
does the sender count it in (from the next sync on). Both sides authenticate every later
frame with a key derived from the secret and both nonces (:meth:`WireCodec.derive
<streamsync.wire.frames.WireCodec.derive>` salted with :data:`SESSION`).

A refused receiver gets a ``Bye`` saying why. A *busy* refusal (the sender is closing, or
every index is taken until a receiver that left is noticed) makes the receiver try again
within its connect timeout: this is what makes a one-shot sync per step safe, where a
receiver may reach the previous step's sender as it closes. Any other refusal (a wrong
secret, another protocol version) is final and raised as the sender's exception class.
"""

from __future__ import annotations

import os

from streamsync.errors import (
    AuthenticationError,
    ConfigError,
    PeerBrokenError,
    StreamsyncError,
    WireFormatError,
    error_class,
)
from streamsync.transports.slots import Shared
from streamsync.wire.frames import Bye, Hello, Welcome, WireCodec

#: Environment variable holding the channel's shared secret when none is passed.
SECRET_ENV = "STREAMSYNC_SECRET"

_NONCE_BYTES = 16
_REFUSED = "refused: "
_BUSY = "busy: "


class Busy(Exception):
    """The sender could not take this receiver now; try again (internal to the handshake)."""

    def __init__(self, error: StreamsyncError) -> None:
        super().__init__(str(error))
        self.error = error


def resolve_secret(secret: bytes | str | None) -> bytes | None:
    """The channel's shared secret: ``secret`` if given, else ``$STREAMSYNC_SECRET``, else
    none (no authentication)."""
    if secret is None:
        env = os.environ.get(SECRET_ENV)
        return env.encode() if env else None
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not raw:
        raise ConfigError("secret is empty; pass some random bytes (32 is plenty) or None")
    return raw


#: Salts a session's key, followed by the receiver's nonce and the sender's.
SESSION = b"streamsync-session\0"


def hello(
    codec: WireCodec, *, group: int = 0, team: str = "", facts: bytes = b""
) -> tuple[bytes, bytes]:
    """Receiver: a fresh nonce and the ``Hello`` frame carrying it, with how many receivers
    join with this one (``group``, of ``team``) and what it says of itself (``facts``)."""
    nonce = os.urandom(_NONCE_BYTES)
    who = f"{os.uname().nodename}/{os.getpid()}"
    hello = Hello(who, os.getpid(), nonce=nonce, group=group, team=team, facts=facts)
    return nonce, codec.encode(hello)


def check_hello(codec: WireCodec, frame: bytes, *, url: str, who: str) -> Hello:
    """Sender: the newcomer's ``Hello``; raises why it must be refused.

    A frame that fails authentication is a refused receiver (``AuthenticationError``) only
    if it is a ``Hello``: anything else is a late frame of another session on this address
    (say, the goodbye of the previous one-shot step's receiver), a ``WireFormatError``.
    """
    try:
        msg = codec.decode(frame)
    except AuthenticationError:
        try:
            peek = WireCodec(None).decode(frame)  # unverified: only to tell what it is
        except StreamsyncError:
            peek = None
        if isinstance(peek, Hello):
            raise
        raise WireFormatError(
            f"{url}: {who} sent a frame of another session, not a Hello"
        ) from None
    if not isinstance(msg, Hello):
        raise WireFormatError(f"{url}: {who} sent {type(msg).__name__} before Hello")
    return msg


def welcome(
    codec: WireCodec,
    msg: Hello,
    *,
    index: int,
    slots: int,
    slot_bytes: int,
    shared: Shared,
) -> tuple[WireCodec, bytes]:
    """Sender: the session codec of receiver ``index`` and the ``Welcome`` frame for it."""
    nonce = os.urandom(_NONCE_BYTES)
    frame = codec.encode(
        Welcome(
            index,
            slots,
            slot_bytes,
            shared.segment,
            nonce=nonce,
            echo=msg.nonce,
            layout=shared.layout,
        )
    )
    return codec.derive(SESSION + msg.nonce + nonce), frame


def accept(codec: WireCodec, frame: bytes, nonce: bytes, *, url: str) -> tuple[Welcome, WireCodec]:
    """Receiver: check the sender's answer to our ``Hello``; the ``Welcome`` and the
    session's codec. A refusal raises the sender's reason."""
    msg = codec.decode(frame)
    if isinstance(msg, Bye):
        if msg.reason.startswith(_BUSY):
            reason = _REFUSED + msg.reason.removeprefix(_BUSY)
            raise Busy(refused(reason, msg.error, url=url))
        raise refused(msg.reason, msg.error, url=url)
    if not isinstance(msg, Welcome):
        raise WireFormatError(f"{url}: sender answered Hello with {type(msg).__name__}")
    if msg.echo != nonce:
        raise AuthenticationError(f"{url}: the sender's Welcome answers another Hello (replayed?)")
    return msg, codec.derive(SESSION + nonce + msg.nonce)


def refusal(codec: WireCodec, exc: StreamsyncError, *, busy: bool = False) -> bytes:
    """Sender: the ``Bye`` frame that tells a refused newcomer why (``busy``: to try
    again, see the module doc)."""
    return codec.encode(Bye((_BUSY if busy else _REFUSED) + str(exc), error=type(exc).__name__))


def refused(reason: str, error: str | None, *, url: str) -> StreamsyncError:
    """Receiver: the sender's refusal as the exception it raised, by its kind ``error``
    (``PeerBrokenError`` for a refusal of no streamsync kind)."""
    if not reason.startswith(_REFUSED) or error is None:
        return PeerBrokenError(f"{url}: the sender refused this receiver: {reason}")
    cls = error_class(error, PeerBrokenError)
    detail = reason.removeprefix(_REFUSED)
    return cls(f"{url}: the sender refused this receiver: {detail or reason}")
