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
from collections.abc import Sequence
from typing import Final

import msgspec
import numpy as np

from streamsync.errors import AuthenticationError, ProtocolVersionError, WireFormatError

#: Bumped whenever a message changes shape; peers with another version are refused.
#: 6: ``Done`` tells what the sink loaded as its difference from what the sync carried.
PROTOCOL_VERSION: Final = 6

# Upper bounds applied to untrusted metadata before anything is allocated from it.
MAX_NAME_LEN: Final = 4096
MAX_NDIM: Final = 16


class Entry(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One tensor, or one chunk of a tensor, inside a bucket (what a :class:`Layout`'s
    columns hold, one row of them)."""

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


class Extra(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The fields of one entry of a :class:`Layout` beyond its columns, for the few entries
    that have them: a chunk of a tensor larger than a bucket, a piece of a patch, a
    checksum."""

    #: The entry's position in the bucket.
    index: int
    chunk: int = 0
    chunks: int = 1
    tensor_offset: int = 0
    checksum: int | None = None
    patch: int = 0


_I64: Final = "<i8"
#: The extra fields of a whole tensor's unchecksummed entry.
_PLAIN: Final = (0, 1, 0, None, 0)


class Layout(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A bucket's entries as columns, in bucket order: one name per entry, and its dtype,
    shape, offset and size as packed arrays. A trainer sends the same layouts every step, so
    a receiver checks each layout once and recognises it afterwards by its value; decoding
    builds a few objects per bucket instead of a struct and a tuple per tensor.

    Untrusted when received: :meth:`entries` checks that the columns agree with each other,
    and the :class:`~streamsync.wire.unpack.Unpacker` checks what they say.
    """

    names: tuple[str, ...]
    #: The distinct dtype names; ``dtype_index`` holds each entry's position in this table.
    dtypes: tuple[str, ...]
    #: One byte per entry.
    dtype_index: bytes
    #: One byte per entry: its number of dimensions.
    ndims: bytes
    #: Every entry's dimensions, one after the other (int64, little-endian).
    dims: bytes
    #: Each entry's byte offset in the bucket (int64, little-endian).
    offsets: bytes
    #: Each entry's bytes in the bucket (int64, little-endian).
    nbytes: bytes
    #: The entries that are chunks or patch pieces or carry a checksum, by position.
    extras: tuple[Extra, ...] = ()

    def __len__(self) -> int:
        return len(self.names)

    @classmethod
    def of(cls, entries: Sequence[Entry]) -> Layout:
        """The columns of ``entries``."""
        table: dict[str, int] = {}
        index = bytes(table.setdefault(e.dtype, len(table)) for e in entries)
        dims = [d for e in entries for d in e.shape]
        extras = tuple(
            Extra(i, *rest)
            for i, e in enumerate(entries)
            # Only an entry with more than the columns say: a chunk, a piece, a checksum.
            if (rest := (e.chunk, e.chunks, e.tensor_offset, e.checksum, e.patch)) != _PLAIN
        )
        return cls(
            names=tuple(e.name for e in entries),
            dtypes=tuple(table),
            dtype_index=index,
            ndims=bytes(len(e.shape) for e in entries),
            dims=np.asarray(dims, dtype=_I64).tobytes(),
            offsets=np.asarray([e.offset for e in entries], dtype=_I64).tobytes(),
            nbytes=np.asarray([e.nbytes for e in entries], dtype=_I64).tobytes(),
            extras=extras,
        )

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(dtype_index, ndims, offsets, nbytes)`` as arrays, after checking that every
        column has one value per entry (``WireFormatError`` otherwise)."""
        count = len(self.names)
        for column, width in (
            ("dtype_index", 1),
            ("ndims", 1),
            ("offsets", 8),
            ("nbytes", 8),
        ):
            got = len(getattr(self, column))
            if got != count * width:
                raise WireFormatError(
                    f"bucket layout: column {column} has {got} bytes for {count} entries"
                )
        kinds = np.frombuffer(self.dtype_index, dtype=np.uint8)
        ndims = np.frombuffer(self.ndims, dtype=np.uint8)
        if count and int(kinds.max()) >= len(self.dtypes):
            raise WireFormatError(
                f"bucket layout: a dtype index of {int(kinds.max())} in a table of "
                f"{len(self.dtypes)}"
            )
        if int(ndims.sum(dtype=np.int64)) * 8 != len(self.dims):
            raise WireFormatError(
                f"bucket layout: {len(self.dims)} bytes of dimensions for "
                f"{int(ndims.sum(dtype=np.int64))} dimensions"
            )
        offsets = np.frombuffer(self.offsets, dtype=_I64)
        nbytes = np.frombuffer(self.nbytes, dtype=_I64)
        return kinds, ndims, offsets, nbytes

    def entries(self) -> list[Entry]:
        """The entries as structs, checked for consistency (``WireFormatError``)."""
        kinds, ndims, offsets, nbytes = self.columns()
        dims = np.frombuffer(self.dims, dtype=_I64).tolist()
        extras: dict[int, Extra] = {}
        for given in self.extras:
            if not 0 <= given.index < len(self.names) or given.index in extras:
                raise WireFormatError(f"bucket layout: extra fields for entry {given.index}")
            extras[given.index] = given
        out: list[Entry] = []
        at = 0
        for i, (name, kind, ndim, offset, size) in enumerate(
            zip(
                self.names,
                kinds.tolist(),
                ndims.tolist(),
                offsets.tolist(),
                nbytes.tolist(),
                strict=True,
            )
        ):
            shape = tuple(dims[at : at + ndim])
            at += ndim
            extra = extras.get(i)
            rest = () if extra is None else msgspec.structs.astuple(extra)[1:]  # less its index
            out.append(Entry(name, self.dtypes[kind], shape, offset, size, *rest))
        return out


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    """A receiver's first message on a channel: who it is."""

    receiver: str
    pid: int
    #: Fresh random bytes the sender echoes in its ``Welcome``, so a recorded ``Welcome``
    #: cannot be replayed; with the nonces both sides derive the session's MAC key.
    nonce: bytes = b""
    #: How many receivers join with this one, itself included (0: it does not say); a
    #: sender opened with ``receivers=0`` waits for as many as the first one says.
    group: int = 0
    #: Which group it belongs to (an engine's id: the sender of several engines' workers
    #: waits for the sum of their groups).
    team: str = ""
    #: What the receiver tells the sender of itself (opaque here: an engine worker's
    #: :class:`~streamsync.facts.WorkerFacts`), read with ``Sender.introductions()``.
    facts: bytes = b""


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
    layout: Layout
    #: A delta sync: the version (sync id) the receiver must hold, which it patches.
    base: int | None = None

    @property
    def entries(self) -> list[Entry]:
        """The layout's entries as structs (checked for consistency: ``WireFormatError``)."""
        return self.layout.entries()


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
    """A receiver applied a whole sync and finalized its sink. What the sink loaded travels
    as its difference from the names the sync carried, which the sender knows: a trainer's
    tens of thousands of names would cost milliseconds and megabytes per receiver and sync."""

    sync_id: int
    receiver: int
    tensors: int
    nbytes: int
    #: Names the sync carried that the sink did not load.
    skipped: tuple[str, ...] = ()
    #: Names the sink loaded that the sync did not carry (a sink's own names, sorted).
    added: tuple[str, ...] = ()
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
    #: A refusal's error kind: the class name of the streamsync error behind it.
    error: str | None = None


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
    """Encodes and decodes frames for one channel, with its optional shared secret, in
    protocol ``version`` (another than :data:`PROTOCOL_VERSION` plays a peer of another
    release)."""

    def __init__(self, secret: bytes | None = None, *, version: int = PROTOCOL_VERSION) -> None:
        self._secret = secret
        self.version = version

    def _mac(self, body: bytes) -> bytes:
        assert self._secret is not None
        return hmac.new(self._secret, body, hashlib.sha256).digest()

    def derive(self, salt: bytes) -> WireCodec:
        """A codec of the same version keyed by this one's secret and ``salt`` (none without
        a secret)."""
        key = None if self._secret is None else self._mac(salt)
        return WireCodec(key, version=self.version)

    def encode(self, msg: Message) -> bytes:
        """One frame holding ``msg``."""
        body = _envelope_encoder.encode(msg)
        mac = self._mac(body) if self._secret else b""
        return _envelope_encoder.encode(_Envelope(self.version, msgspec.Raw(body), mac))

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
        if env.version != self.version:
            raise ProtocolVersionError(
                f"peer speaks streamsync wire protocol version {env.version}; "
                f"this side speaks version {self.version}"
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
        if isinstance(msg, BucketHeader):
            layout = msg.layout
            longest = max(layout.names, key=len, default="")
            if len(longest) > MAX_NAME_LEN:
                raise WireFormatError(f"tensor name of {len(longest)} characters is too long")
            if layout.ndims and max(layout.ndims) > MAX_NDIM:
                at = layout.ndims.index(max(layout.ndims))
                name = layout.names[at] if at < len(layout.names) else f"#{at}"
                raise WireFormatError(
                    f"tensor {name!r} claims {max(layout.ndims)} dimensions; at most {MAX_NDIM}"
                )
        return msg
