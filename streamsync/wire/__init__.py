"""The wire format: what crosses a transport.

- :mod:`streamsync.wire.frames`: the versioned, authenticated envelope around the tagged
  msgspec union of control messages (handshake, bucket headers, acks, reports).
- :mod:`streamsync.wire.pack`: packing named tensors into a slot's bytes (the bucket
  layout a header describes), on the sender.
- :mod:`streamsync.wire.checks`: the pure checks that keep a malformed or hostile header
  from reading or writing outside its tensors.
- :mod:`streamsync.wire.unpack`: unpacking a slot's bytes into tensors, on the receiver.
- :mod:`streamsync.wire.slot`: what both sides agree on about a slot's bytes: alignment
  and checksums.
"""
