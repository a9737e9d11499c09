"""Frames: the sans-IO codec that broker and client share. Bytes in, frames out.

Byte layout of a frame (little-endian; docs/protocol.md says the same):

    offset size  field           meaning
    0      4     frame_length    u32, bytes after this field (>= 12)
    4      2     kind            u16, message type (see ``KINDS``)
    6      2     flags           u16, 0 (reserved)
    8      4     correlation_id  u32, echoed by the response; 0 for broker pushes
    12     4     meta_length     u32, bytes of msgpack meta that follow
    16     ...   meta            msgpack array of the message's fields
    16+m   ...   payload         raw bytes up to frame_length (record batches); may be empty

No checksum at this level: TCP guards transport, and batches carry their own CRC32C end to end.

A frame longer than ``max_frame_bytes`` is not buffered: its prefix is read to learn its
correlation id, the rest is discarded as it arrives, and an ``Oversized`` item is produced so
the receiver can answer with a typed error and carry on. A frame whose meta does not decode
yields ``Malformed`` for the same reason. Only a frame length below the minimum breaks the
stream; then ``next_item`` raises :class:`ProtocolError` and the connection must close.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Sequence

import msgspec

from .._errors import ProtocolError
from ._messages import KIND_OF, KINDS, Message

_PREFIX = struct.Struct("<IHHII")
_LENGTH = struct.Struct("<I")
PREFIX_LENGTH = _PREFIX.size  # 16
_MIN_FRAME_LENGTH = PREFIX_LENGTH - 4
DEFAULT_MAX_FRAME_BYTES = 8 * 1024 * 1024 + 64 * 1024
_BIG_FRAME_BYTES = 64 * 1024
_READ_BYTES = 256 * 1024

_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in KINDS.items()}


Payload = bytearray | memoryview


class Frame(msgspec.Struct, frozen=True):
    """A decoded frame. ``payload`` is private to the receiver, writable (it may be patched
    in place): a copy for small frames, a view of the frame's own buffer for large ones."""

    correlation_id: int
    message: Message
    payload: Payload


class Oversized(msgspec.Struct, frozen=True):
    """A frame above the limit was skipped; answer ``correlation_id`` with an error."""

    correlation_id: int
    kind: int
    frame_length: int


class Malformed(msgspec.Struct, frozen=True):
    """A well-delimited frame whose kind or meta is invalid; answer with an error."""

    correlation_id: int
    reason: str


def encode_frame(message: Message, correlation_id: int = 0, payload_length: int = 0) -> bytearray:
    """Prefix + meta of a frame; the caller sends ``payload_length`` payload bytes right after
    (as separate buffers, so a batch is never copied into the frame)."""
    meta = _ENCODER.encode(message)
    frame_length = PREFIX_LENGTH - 4 + len(meta) + payload_length
    out = bytearray(
        _PREFIX.pack(frame_length, KIND_OF[type(message)], 0, correlation_id, len(meta))
    )
    out += meta
    return out


def frame_bytes(
    message: Message, correlation_id: int = 0, payload: Sequence[bytes | memoryview] = ()
) -> list[bytes | bytearray | memoryview]:
    """Buffers of one whole frame, ready for ``writelines``."""
    length = sum(len(p) for p in payload)
    return [encode_frame(message, correlation_id, length), *payload]


class FrameDecoder:
    """Incremental decoder: ``feed(bytes)`` then ``next_item()`` until it returns None."""

    def __init__(
        self,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        allocate: Callable[[int], bytearray | memoryview] = bytearray,
        align_payload: tuple[int, int] | None = None,
    ) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._allocate = allocate  # where a large frame's own buffer comes from
        # (modulus, remainder): place a large frame's payload at an address that leaves this
        # remainder, so that it can go from there to a direct write (the broker's journal)
        self._align = align_payload
        # Undecoded bytes are _buf[_pos:_end]. The buffer is never shrunk: a bytearray that is
        # cut down reallocates, and growing it again took fresh pages from the OS for every
        # 4 MiB frame received (84% of a replaying client's page faults, each a zero-fill).
        self._buf = bytearray(2 * _READ_BYTES)
        self._pos = 0
        self._end = 0
        self._skip = 0  # bytes of an oversized frame still to discard
        # A large frame is assembled in a buffer of its own, sized once: its bytes are copied
        # once on arrival and its payload is a view of that buffer, not a second copy.
        self._big: memoryview | None = None
        self._big_filled = 0
        self._scratch = bytearray(_READ_BYTES)

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next bytes from the socket should land (asyncio's BufferedProtocol):
        straight into a large frame's own buffer when one is being assembled, else a scratch
        buffer; report how many arrived with :meth:`buffer_updated`."""
        if self._big is not None and not self._skip and self._big_filled < len(self._big):
            return self._big[self._big_filled :]
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        if self._big is not None and not self._skip and self._big_filled < len(self._big):
            self._big_filled += nbytes
        else:
            self.feed(memoryview(self._scratch)[:nbytes])

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._skip:
            dropped = min(self._skip, len(data))
            self._skip -= dropped
            data = memoryview(data)[dropped:]
        if self._big is not None:
            taken = min(len(self._big) - self._big_filled, len(data))
            self._big[self._big_filled : self._big_filled + taken] = memoryview(data)[:taken]
            self._big_filled += taken
            data = memoryview(data)[taken:]
            if not data:
                return
        size = len(data)
        if self._end + size > len(self._buf):  # move the undecoded bytes to the front
            live = self._end - self._pos
            self._buf[:live] = self._buf[self._pos : self._end]  # same length: no realloc
            self._pos, self._end = 0, live
            if live + size > len(self._buf):
                self._buf += bytes(live + size - len(self._buf))
        with memoryview(self._buf) as view:  # a bytearray slice would copy ``data`` first
            view[self._end : self._end + size] = data
        self._end += size

    @property
    def buffered(self) -> int:
        big = self._big_filled if self._big is not None else 0
        return self._end - self._pos + big

    def next_item(self) -> Frame | Oversized | Malformed | None:
        """The next complete frame, or None if more bytes are needed."""
        if self._big is not None:
            return self._next_big()
        pos = self._pos
        if self._skip or self._end - pos < 4:
            return None
        (frame_length,) = _LENGTH.unpack_from(self._buf, pos)
        if frame_length < _MIN_FRAME_LENGTH:
            raise ProtocolError(
                f"frame length {frame_length} is below the minimum {_MIN_FRAME_LENGTH}"
            )
        if self._end - pos < PREFIX_LENGTH:
            return None
        frame_length, kind, _flags, correlation_id, meta_length = _PREFIX.unpack_from(
            self._buf, pos
        )
        total = frame_length + 4
        if frame_length > self.max_frame_bytes:
            available = min(total, self._end - pos)
            self._pos += available
            self._skip = total - available
            return Oversized(correlation_id, kind, frame_length)
        available = self._end - pos
        if available < total:
            if total >= _BIG_FRAME_BYTES:
                self._big = self._allocate_big(total, PREFIX_LENGTH + meta_length)
                self._big[:available] = memoryview(self._buf)[pos : self._end]
                self._big_filled = available
                self._pos = self._end  # everything buffered belongs to this frame
            return None
        self._pos += total
        with memoryview(self._buf) as view:
            return self._decode(view[pos : pos + total], kind, correlation_id, meta_length, True)

    def _allocate_big(self, total: int, payload_at: int) -> memoryview:
        if self._align is None:
            return memoryview(self._allocate(total))
        modulus, remainder = self._align
        raw = memoryview(self._allocate(total + modulus)).cast("B")
        address = ctypes.addressof(ctypes.c_char.from_buffer(raw))
        skew = (remainder - address - payload_at) % modulus
        return raw[skew : skew + total]

    def _next_big(self) -> Frame | Malformed | None:
        big = self._big
        assert big is not None
        if self._big_filled < len(big):
            return None
        self._big = None
        _, kind, _flags, correlation_id, meta_length = _PREFIX.unpack_from(big)
        return self._decode(big, kind, correlation_id, meta_length, False)

    @staticmethod
    def _decode(
        frame: memoryview, kind: int, correlation_id: int, meta_length: int, copy: bool
    ) -> Frame | Malformed:
        decoder = _DECODERS.get(kind)
        if decoder is None:
            return Malformed(correlation_id, f"unknown message kind {kind}")
        meta_end = PREFIX_LENGTH + meta_length
        if meta_end > len(frame):
            return Malformed(
                correlation_id, f"meta length runs past the frame end ({meta_end} > {len(frame)})"
            )
        try:
            message = decoder.decode(frame[PREFIX_LENGTH:meta_end])
        # msgspec raises a bare UnicodeDecodeError for a str field that is not UTF-8
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
            return Malformed(correlation_id, f"bad {KINDS[kind].__name__} fields: {exc}")
        payload = bytearray(frame[meta_end:]) if copy else frame[meta_end:]
        return Frame(correlation_id, message, payload)
