"""The wire format: what crosses a transport.

- :mod:`streamsync.wire.frames`: the versioned, authenticated envelope around the tagged
  msgspec union of control messages (handshake, bucket headers, acks, reports).
- :mod:`streamsync.wire.bucket`: packing named tensors into a slot's bytes and unpacking
  them (the bucket layout a header describes), with the checks that keep a malformed or
  hostile header from writing outside its tensors.
"""
