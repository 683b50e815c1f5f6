"""Messages that cross a process boundary: msgspec Structs in a versioned, optionally
authenticated envelope. Never pickle.

A frame is the msgpack array ``[version, body, mac]``: ``body`` is the msgpack-encoded message
(a tagged union), ``mac`` an HMAC-SHA256 of ``body`` under the channel's shared secret, or
empty when the channel has none. The version is checked before the body is decoded, so a
peer speaking another protocol version gets :class:`~streamsync.ProtocolVersionError`, not a
confusing decode error.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Final

import msgspec

from streamsync.errors import AuthenticationError, ProtocolVersionError, WireFormatError

__all__ = [
    "PROTOCOL_VERSION",
    "Entry",
    "Hello",
    "Welcome",
    "Joined",
    "BucketHeader",
    "End",
    "Abort",
    "Ack",
    "Done",
    "Failed",
    "Bye",
    "Message",
    "WireCodec",
]

#: Bumped whenever a message changes shape; peers with another version are refused.
#: 2: the receiver confirms its ``Welcome`` with ``Joined``; refusals may say "busy".
#: 3: delta syncs (``Entry.patch``, ``base`` on buckets and ``End``, ``Done.held``).
PROTOCOL_VERSION: Final = 3

# Upper bounds applied to untrusted metadata before anything is allocated from it.
MAX_NAME_LEN: Final = 4096
MAX_NDIM: Final = 16


class Entry(msgspec.Struct, frozen=True, array_like=True):
    """One tensor, or one chunk of a tensor, inside a bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    #: Byte offset of this entry in the bucket buffer (aligned, see ``bucket.ALIGN``).
    offset: int
    #: Bytes of this entry in the bucket buffer.
    nbytes: int
    #: Chunk index and count: a tensor larger than a bucket travels as consecutive chunks.
    chunk: int = 0
    chunks: int = 1
    #: Byte offset of this chunk inside the whole tensor.
    tensor_offset: int = 0
    #: xxh3-64 of this entry's bytes, when the sender computes checksums.
    checksum: int | None = None
    #: A patch of this many changed elements (:mod:`streamsync.wire.patch`; its pieces are
    #: ``chunk`` of ``chunks``), or 0: the entry holds the tensor's bytes.
    patch: int = 0


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    """A receiver's first message on a channel: who it is."""

    receiver: str
    pid: int
    #: Fresh random bytes the sender echoes in its ``Welcome``, so a recorded ``Welcome``
    #: cannot be replayed; with the nonces both sides derive the session's MAC key.
    nonce: bytes = b""


class Welcome(msgspec.Struct, frozen=True, tag="welcome"):
    """The sender's answer to ``Hello``: the receiver's index and the slot layout."""

    index: int
    slots: int
    slot_bytes: int
    segment: str = ""
    #: The sender's fresh random bytes (see ``Hello.nonce``).
    nonce: bytes = b""
    #: The receiver's ``Hello.nonce``, echoed.
    echo: bytes = b""
    #: Transport-specific description of the slots (e.g. CUDA IPC handles), msgpack.
    layout: bytes = b""


class Joined(msgspec.Struct, frozen=True, tag="joined"):
    """The receiver's answer to ``Welcome``, under the session's key: it is there and takes
    part from the next sync on. Until it arrives the sender counts nobody in (a receiver
    that gave up on a slow ``Welcome`` leaves no ghost member behind)."""

    receiver: int


class BucketHeader(msgspec.Struct, frozen=True, tag="bucket"):
    """Metadata of one bucket; its bytes are in ``slot`` (or the following frame)."""

    sync_id: int
    seq: int
    slot: int
    nbytes: int
    entries: tuple[Entry, ...]
    #: A delta sync: the version (sync id) the receiver must hold, which it patches.
    base: int | None = None


class End(msgspec.Struct, frozen=True, tag="end"):
    """The sender finished a sync: the counts let the receiver check nothing was lost."""

    sync_id: int
    buckets: int
    tensors: int
    nbytes: int
    #: A delta sync's base version (see ``BucketHeader.base``).
    base: int | None = None
    #: Tensors of a delta sync that did not change, so were not sent.
    unchanged: int = 0


class Abort(msgspec.Struct, frozen=True, tag="abort"):
    """The sender gave up on a sync (its source raised, its receivers did not all come);
    ``reason`` says why."""

    sync_id: int
    reason: str


class Ack(msgspec.Struct, frozen=True, tag="ack"):
    """A receiver finished with a slot: the sender may reuse it."""

    sync_id: int
    seq: int
    slot: int
    receiver: int


class Done(msgspec.Struct, frozen=True, tag="done"):
    """A receiver applied a whole sync and finalized its sink."""

    sync_id: int
    receiver: int
    tensors: int
    nbytes: int
    loaded: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    #: The version the receiver's sink now holds (this sync's id), or ``None`` when the sink
    #: cannot take a delta: the sender sends it full syncs.
    held: int | None = None


class Failed(msgspec.Struct, frozen=True, tag="failed"):
    """A receiver could not apply a sync; ``applied`` lists what it had applied already."""

    sync_id: int
    receiver: int
    error: str
    message: str
    applied: tuple[str, ...] = ()


class Bye(msgspec.Struct, frozen=True, tag="bye"):
    """The peer closes the channel on purpose (as opposed to dying); ``receiver`` is the
    index of a receiver that leaves, -1 from the sender."""

    reason: str = ""
    receiver: int = -1


Message = Hello | Welcome | Joined | BucketHeader | End | Abort | Ack | Done | Failed | Bye

_envelope_encoder = msgspec.msgpack.Encoder()
_body_decoder = msgspec.msgpack.Decoder(Message)


class _Envelope(msgspec.Struct, array_like=True):
    version: int
    body: msgspec.Raw
    mac: bytes = b""


_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)
# msgspec raises UnicodeDecodeError, not DecodeError, for a union tag that is not UTF-8.
_DECODE_ERRORS = (msgspec.DecodeError, UnicodeDecodeError)


class WireCodec:
    """Encodes and decodes frames for one channel, with its optional shared secret."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret

    def _mac(self, body: bytes) -> bytes:
        assert self._secret is not None
        return hmac.new(self._secret, body, hashlib.sha256).digest()

    def encode(self, msg: Message) -> bytes:
        """One frame holding ``msg``."""
        body = _envelope_encoder.encode(msg)
        mac = self._mac(body) if self._secret else b""
        return _envelope_encoder.encode(_Envelope(PROTOCOL_VERSION, msgspec.Raw(body), mac))

    def decode(self, frame: bytes | memoryview) -> Message:
        """The message of a frame from an untrusted peer.

        Raises ``ProtocolVersionError`` for another version, ``AuthenticationError`` for a
        missing or wrong MAC, ``WireFormatError`` for anything else malformed. Nothing else
        escapes.
        """
        try:
            env = _envelope_decoder.decode(frame)
        except _DECODE_ERRORS as exc:
            raise WireFormatError(f"malformed frame ({len(frame)} bytes): {exc}") from exc
        if env.version != PROTOCOL_VERSION:
            raise ProtocolVersionError(
                f"peer speaks streamsync wire protocol version {env.version}; "
                f"this side speaks version {PROTOCOL_VERSION}"
            )
        body = bytes(env.body)
        if self._secret is not None and not hmac.compare_digest(env.mac, self._mac(body)):
            raise AuthenticationError(
                "peer's message is not authenticated by this channel's shared secret"
            )
        try:
            msg: Message = _body_decoder.decode(body)
        except _DECODE_ERRORS as exc:
            raise WireFormatError(f"malformed message body: {exc}") from exc
        # Cheap checks of untrusted header fields; the Unpacker checks them against the slot.
        for entry in msg.entries if isinstance(msg, BucketHeader) else ():
            if len(entry.name) > MAX_NAME_LEN:
                raise WireFormatError(f"tensor name of {len(entry.name)} characters is too long")
            if len(entry.shape) > MAX_NDIM:
                raise WireFormatError(
                    f"tensor {entry.name!r} claims {len(entry.shape)} dimensions; "
                    f"at most {MAX_NDIM}"
                )
        return msg
