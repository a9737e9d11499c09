"""LongTermStore: durable tier 2, immutable named chunks of back-to-back record batches.

A chunk is written once, whole, and is durable when ``write_chunk`` returns; it is read by byte
ranges and deleted whole (that is how retention frees space). A chunk holds one segment's
batches at the positions its catalog index records: back to back when copied, or in place
inside a hard-linked sealed journal file (``LocalChunkStore.adopt_ranges``). Names look like
object keys (``<stream id>/<segment>/<base offset>``) so an S3-compatible store can implement
the same interface later.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

from .._errors import CorruptData
from ._journal import Buffer, _writev_all, fsync_dir, storage_error


def chunk_name(stream_id: int, segment: int, base_offset: int) -> str:
    return f"{stream_id}/{segment}/{base_offset:020d}"


class LongTermStore(ABC):
    """Immutable chunks by name. Errors: ``StorageFull``/``StorageError`` on write,
    ``CorruptData`` when a chunk is missing or shorter than asked."""

    @abstractmethod
    def write_chunk(self, name: str, buffers: Sequence[Buffer]) -> None:
        """Store the concatenated buffers under ``name``, durably and atomically."""

    @abstractmethod
    def read_chunk(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        """Bytes ``[start, start + length)`` of a chunk (to its end when ``length`` is None)."""

    @abstractmethod
    def delete_chunk(self, name: str) -> None:
        """Remove a chunk; deleting a missing chunk is not an error."""

    @abstractmethod
    def list_chunks(self, prefix: str = "") -> list[str]:
        """Names of stored chunks that start with ``prefix``, sorted."""

    def adopt_ranges(self, name: str, source: Path, ranges: Sequence[tuple[int, int]]) -> list[int]:
        """Store byte ranges ``(position, length)`` of a durable local file as chunk ``name``;
        returns where each range starts inside the stored chunk.

        The default copies the ranges back to back. A store on the same filesystem may keep
        the file as it is instead (see LocalChunkStore), so journal data is written once.
        """
        with open(source, "rb") as f:
            parts = [os.pread(f.fileno(), length, position) for position, length in ranges]
        self.write_chunk(name, parts)
        starts, at = [], 0
        for part in parts:
            starts.append(at)
            at += len(part)
        return starts


class LocalChunkStore(LongTermStore):
    """Chunks as files under a directory: written to a temporary name, fsynced, renamed."""

    def __init__(self, directory: Path, *, fsync: bool = True) -> None:
        self.directory = directory
        self._fsync = fsync
        directory.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}.chunk"

    def write_chunk(self, name: str, buffers: Sequence[Buffer]) -> None:
        path = self._path(name)
        tmp = path.with_suffix(".tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _writev_all(fd, list(buffers))
                if self._fsync:
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            if self._fsync:
                fsync_dir(path.parent)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise storage_error(exc, f"writing chunk {name}") from exc

    def adopt_ranges(self, name: str, source: Path, ranges: Sequence[tuple[int, int]]) -> list[int]:
        # A hard link: the sealed journal file becomes the chunk without a second write. The
        # ranges stay where they are; bytes of other segments in the file are never read
        # through this chunk, and the inode is freed when the last chunk linking it goes.
        path = self._path(name)
        tmp = path.with_suffix(".tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.unlink(missing_ok=True)
            if path.exists() and os.path.samefile(path, source):
                return [position for position, _ in ranges]  # adopted before a retry or crash
            os.link(source, tmp)
            os.replace(tmp, path)
            if self._fsync:
                fsync_dir(path.parent)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            if exc.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                return super().adopt_ranges(name, source, ranges)  # another filesystem: copy
            raise storage_error(exc, f"linking chunk {name}") from exc
        return [position for position, _ in ranges]

    def read_chunk(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        try:
            with open(self._path(name), "rb") as f:
                f.seek(start)
                data = f.read() if length is None else f.read(length)
        except FileNotFoundError as exc:
            raise CorruptData(
                f"chunk {name} is missing from long-term storage", chunk=name
            ) from exc
        if length is not None and len(data) != length:
            raise CorruptData(
                f"chunk {name} is shorter than its catalog entry", chunk=name, position=start
            )
        return data

    def delete_chunk(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def list_chunks(self, prefix: str = "") -> list[str]:
        names = (
            str(p.relative_to(self.directory).with_suffix(""))
            for p in self.directory.rglob("*.chunk")
        )
        return sorted(n for n in names if n.startswith(prefix))


class MemoryChunkStore(LongTermStore):
    """Chunks in a dict: the in-memory implementation for tests and embedded use."""

    def __init__(self) -> None:
        self._chunks: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def write_chunk(self, name: str, buffers: Sequence[Buffer]) -> None:
        data = b"".join(bytes(b) for b in buffers)
        with self._lock:
            self._chunks[name] = data

    def read_chunk(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        with self._lock:
            data = self._chunks.get(name)
        if data is None:
            raise CorruptData(f"chunk {name} is missing from long-term storage", chunk=name)
        end = len(data) if length is None else start + length
        if end > len(data):
            raise CorruptData(f"chunk {name} is shorter than its catalog entry", chunk=name)
        return data[start:end]

    def delete_chunk(self, name: str) -> None:
        with self._lock:
            self._chunks.pop(name, None)

    def list_chunks(self, prefix: str = "") -> list[str]:
        with self._lock:
            return sorted(n for n in self._chunks if n.startswith(prefix))
