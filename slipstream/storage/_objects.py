"""ObjectChunkStore: the LongTermStore on an S3-compatible object store, through obstore.

A chunk is one object, ``<prefix>/<chunk name>``, written whole with one PUT (a multipart
upload above ``MULTIPART_BYTES``, which S3 makes visible only when complete: a failed upload
leaves no object, and an overwrite is atomic). Reads are ranged GETs. Deleting a missing object
is not an error (S3's DELETE is idempotent).

The read cache, on local disk, holds aligned **blocks** of chunks (``block_bytes``, 4 MiB by
default), not whole chunks nor the exact ranges asked. Why: a replay reads a chunk front to
back in pieces of a few hundred KiB to a few MiB (the reader's ``max_bytes``); one GET per
block is a read-ahead that turns many small round trips into few large ones, while any range
read twice, whatever its bounds, is served from disk; a whole chunk (up to the journal file
size, 64 MiB by default) per miss would make one small read of a cold chunk fetch all of it and
would make the cache's bound coarse. With ``cache_bytes=0`` there is no cache and every read is
a GET of exactly the range asked.

Each cached block is a file: a header of one CRC32C per 64 KiB page, then the block's bytes.
A hit reads and checks only the pages it needs; a page whose CRC does not match (bit rot, a
torn file, someone's editor) is dropped and the block fetched again, so a damaged cache never
serves wrong bytes. Files are written to a temporary name and renamed, so a crash or a failed
fetch never leaves a partial block under a block's name. The cache is emptied when the store
opens: it is an accelerator, not state, and the index of what it holds lives in memory. The
total of cached bytes stays within ``cache_bytes`` (least recently used blocks go first); while
several reader threads write blocks at once, each may hold one more block on disk until its
file is complete.

``adopt_ranges`` cannot link a journal file into an object store: it copies the ranges (read
into memory, up to one sealed journal file, then uploaded; see ``LongTermStore.copy_ranges``).

Errors. A missing object is ``CorruptData`` naming the chunk (as LocalChunkStore says of a
missing file); a range past an object's end is ``CorruptData`` "shorter than its catalog
entry". Everything else is ``StorageError`` whose message says the fix: endpoint unreachable,
bucket missing, credentials refused. Transient failures (connection errors, 5xx, timeouts) are
retried by obstore with exponential backoff, ``max_retries`` times, before they surface.

Orphans (objects that no catalog record names: a failed delete, an upload whose record never
committed) are found by ``list_chunk_times`` and deleted by ``ChunkSweep`` (storage/_chunks.py)
once older than its grace period; the mover names every upload uniquely, so two brokers that
both believe they own a container never write the same object.

Chunks are immutable by contract; the cache trusts that. ``write_chunk`` and ``delete_chunk``
through this store drop the name's cached blocks, but another process overwriting an object
behind this store's back would not be seen until the blocks leave the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import crc32c

from .._errors import CorruptData, InvalidArgument, StorageError
from ._chunks import LongTermStore
from ._journal import Buffer

if TYPE_CHECKING:
    from obstore.store import S3Store

#: a chunk at least this large is uploaded in parts of this size
MULTIPART_BYTES = 8 * 1024 * 1024
#: the unit a cached block's pages are checked in
CACHE_PAGE = 64 * 1024
#: a key under the prefix that ``check_writable`` writes and deletes; never listed as a chunk
PROBE_NAME = ".slipstream-write-check"
_CRC = struct.Struct("<I")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:400]


class ObjectChunkStore(LongTermStore):
    """Chunks as objects in ``s3://bucket/prefix`` (see the module docstring).

    Credentials come from ``access_key_id``/``secret_access_key``/``session_token`` or, where
    not given, from ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``; the
    endpoint from ``endpoint`` or ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT`` (AWS itself when none);
    the region from ``region``, ``AWS_REGION`` or ``AWS_DEFAULT_REGION`` (``us-east-1``).
    Missing credentials are an ``InvalidArgument`` at construction (no anonymous access and no
    instance-metadata lookup). Construction does not contact the store; ``check_writable`` does.
    """

    def __init__(
        self,
        url: str,
        *,
        endpoint: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        cache_dir: Path | None = None,
        cache_bytes: int = 1024 * 1024 * 1024,
        block_bytes: int = 4 * 1024 * 1024,
        max_retries: int = 3,
        timeout: float = 30.0,
        connect_timeout: float = 5.0,
    ) -> None:
        try:
            from obstore.store import S3Store
        except ImportError as exc:  # pragma: no cover - the s3 extra is not installed
            raise InvalidArgument(
                "chunks in object storage need obstore: pip install 'slipstream[s3]'"
            ) from exc
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise InvalidArgument(f"objects URL must look like s3://bucket/prefix, not {url!r}")
        if block_bytes <= 0 or block_bytes % CACHE_PAGE:
            raise InvalidArgument(f"block_bytes must be a positive multiple of {CACHE_PAGE}")
        if cache_bytes > 0 and cache_dir is None:
            raise InvalidArgument("a read cache (cache_bytes > 0) needs a cache_dir")
        self.url = url
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.endpoint = (
            endpoint
            or os.environ.get("AWS_ENDPOINT_URL")
            or os.environ.get("AWS_ENDPOINT")
            or "https://s3.amazonaws.com"
        )
        key = access_key_id or os.environ.get("AWS_ACCESS_KEY_ID")
        secret = secret_access_key or os.environ.get("AWS_SECRET_ACCESS_KEY")
        if not key or not secret:
            raise InvalidArgument(
                f"no credentials for {url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(and AWS_SESSION_TOKEN for temporary credentials)"
            )
        config: dict[str, Any] = {
            "access_key_id": key,
            "secret_access_key": secret,
            "region": region
            or os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION")
            or "us-east-1",
            "endpoint": self.endpoint,
            # path-style URLs: what SeaweedFS, MinIO and moto answer on a bare host:port
            "virtual_hosted_style_request": False,
        }
        token = session_token or os.environ.get("AWS_SESSION_TOKEN")
        if token:
            config["token"] = token
        self._store: S3Store = S3Store(
            self.bucket,
            prefix=self.prefix or None,
            config=config,  # type: ignore[arg-type]
            client_options={
                "allow_http": self.endpoint.startswith("http://"),
                "timeout": timedelta(seconds=timeout),
                "connect_timeout": timedelta(seconds=connect_timeout),
            },
            retry_config={
                "max_retries": max_retries,
                "backoff": {
                    "init_backoff": timedelta(milliseconds=100),
                    "max_backoff": timedelta(seconds=2),
                    "base": 2,
                },
                "retry_timeout": timedelta(seconds=max(timeout, 1.0) * (max_retries + 1)),
            },
        )
        self.block_bytes = block_bytes
        self.cache_bytes = max(0, cache_bytes)
        self.cache_dir = cache_dir
        self._lock = threading.Lock()
        # (name, block index) -> cached bytes of that block; LRU order, oldest first
        self._blocks: OrderedDict[tuple[str, int], int] = OrderedDict()
        self._cached_bytes = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()  # object sizes seen, bounded
        #: counters for tests and the bench: blocks served from disk, fetched, found damaged
        self.stats = {"hits": 0, "fetches": 0, "damaged": 0}
        if self.cache_bytes and cache_dir is not None:
            self._empty_cache(cache_dir)

    def __repr__(self) -> str:
        return f"ObjectChunkStore({self.url!r}, endpoint={self.endpoint!r})"

    # --- errors -----------------------------------------------------------------------------

    def _error(self, exc: Exception, action: str) -> StorageError:
        """The typed error, with the fix, for an obstore failure other than a missing object."""
        from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

        where = f"{self.url} at {self.endpoint}"
        text = str(exc)
        if "NoSuchBucket" in text:
            return StorageError(
                f"bucket {self.bucket!r} does not exist at {self.endpoint} ({action}): create "
                "it, or fix the bucket in --objects / the endpoint in --s3-endpoint",
                bucket=self.bucket,
            )
        if isinstance(exc, PermissionDeniedError | UnauthenticatedError) or any(
            code in text for code in ("SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied")
        ):
            return StorageError(
                f"the object store refused the credentials for {where} ({action}): check "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and that the key may read, write "
                f"and delete under the prefix ({_first_line(exc)})",
                bucket=self.bucket,
            )
        if "error sending request" in text or "onnect" in text or "timed out" in text:
            return StorageError(
                f"cannot reach the object store at {self.endpoint} ({action}, after "
                "retries): check --s3-endpoint / AWS_ENDPOINT_URL and that the store is up "
                f"({_first_line(exc)})",
                endpoint=self.endpoint,
            )
        return StorageError(f"object store error while {action} in {where}: {_first_line(exc)}")

    @staticmethod
    def _is_missing(exc: Exception) -> bool:
        from obstore.exceptions import NotFoundError

        return isinstance(exc, FileNotFoundError | NotFoundError) and "NoSuchBucket" not in str(exc)

    def _missing(self, name: str) -> CorruptData:
        return CorruptData(f"chunk {name} is missing from long-term storage", chunk=name)

    # --- the interface ----------------------------------------------------------------------

    def check_writable(self) -> None:
        """Write, read back and delete a small object under the prefix; raises StorageError
        (with the fix) if the store is unreachable, the bucket missing or the credentials
        refused. For a broker's start, before it touches its data directory."""
        import obstore

        payload = uuid.uuid4().bytes
        try:
            obstore.put(self._store, PROBE_NAME, payload)
            back = bytes(obstore.get(self._store, PROBE_NAME).bytes())
            obstore.delete(self._store, PROBE_NAME)
        except Exception as exc:
            raise self._error(exc, "checking that the bucket is writable") from exc
        if back != payload:
            raise StorageError(f"{self.url} at {self.endpoint} did not return what was written")

    def write_chunk(self, name: str, buffers: Sequence[Buffer]) -> None:
        import obstore

        total = sum(len(b) for b in buffers)
        try:
            if total < MULTIPART_BYTES:
                obstore.put(self._store, name, b"".join(buffers), use_multipart=False)
            else:
                obstore.put(
                    self._store,
                    name,
                    iter([memoryview(b) for b in buffers if len(b)]),
                    use_multipart=True,
                    chunk_size=MULTIPART_BYTES,
                    max_concurrency=4,
                )
        except Exception as exc:
            raise self._error(exc, f"writing chunk {name}") from exc
        self._forget(name)
        with self._lock:
            self._remember_size(name, total)

    def read_chunk(self, name: str, start: int = 0, length: int | None = None) -> Buffer:
        with self._lock:
            size = self._sizes.get(name)
        if size is None and not length:  # to the end, or nothing: the size says what is there
            size = self._head(name)
        end = size if length is None else start + length
        assert end is not None
        if size is not None and end > size:
            raise CorruptData(
                f"chunk {name} is shorter than its catalog entry", chunk=name, position=start
            )
        if end <= start:
            return b""
        if not self.cache_bytes:
            data: Buffer = self._get(name, start, end)
        else:
            first, last = start // self.block_bytes, (end - 1) // self.block_bytes
            parts = []
            for block in range(first, last + 1):
                at = block * self.block_bytes
                parts.append(
                    self._read_block(
                        name, block, max(start, at) - at, min(end, at + self.block_bytes) - at
                    )
                )
            data = parts[0] if len(parts) == 1 else b"".join(parts)
        if len(data) != end - start:
            raise CorruptData(
                f"chunk {name} is shorter than its catalog entry", chunk=name, position=start
            )
        return data

    def delete_chunk(self, name: str) -> None:
        import obstore

        try:
            obstore.delete(self._store, name)
        except Exception as exc:
            if not self._is_missing(exc):
                raise self._error(exc, f"deleting chunk {name}") from exc
        self._forget(name)  # after: a failed delete leaves the chunk, and its cache, as they were

    def list_chunks(self, prefix: str = "") -> list[str]:
        return [name for name, _ in self.list_chunk_times(prefix)]

    def list_chunk_times(self, prefix: str = "") -> list[tuple[str, float]]:
        """Names and last-modified times (the store's clock; for a multipart upload, when it
        began) of the objects under ``prefix``, paged through obstore's list."""
        import obstore

        # obstore lists by path segments: ask for the directory part, filter the rest here
        directory = prefix[: prefix.rfind("/") + 1].rstrip("/") or None
        found: list[tuple[str, float]] = []
        try:
            for page in obstore.list(self._store, prefix=directory):
                found.extend(
                    (meta["path"], meta["last_modified"].timestamp())
                    for meta in page
                    if meta["path"].startswith(prefix) and meta["path"] != PROBE_NAME
                )
        except Exception as exc:
            if self._is_missing(exc):
                return []
            raise self._error(exc, "listing chunks") from exc
        return sorted(found)

    # --- object store requests --------------------------------------------------------------

    def _head(self, name: str) -> int:
        import obstore

        try:
            size = int(obstore.head(self._store, name)["size"])
        except Exception as exc:
            if self._is_missing(exc):
                # a HEAD's 404 has no body to tell a missing bucket from a missing object
                self._check_bucket(f"reading chunk {name}")
                raise self._missing(name) from exc
            raise self._error(exc, f"reading chunk {name}") from exc
        with self._lock:
            self._remember_size(name, size)
        return size

    def _check_bucket(self, action: str) -> None:
        """Raise the bucket's StorageError if it is missing (a listing says so in its body)."""
        import obstore

        try:
            next(iter(obstore.list(self._store, prefix=None, chunk_size=1)), None)
        except Exception as exc:
            if not self._is_missing(exc):
                raise self._error(exc, action) from exc

    def _get(self, name: str, start: int, end: int) -> Buffer:
        """Bytes ``[start, end)`` of an object, fewer if it ends before ``end``."""
        import obstore

        try:
            result = obstore.get(self._store, name, options={"range": (start, end)})
            data = memoryview(result.bytes())
        except Exception as exc:
            if self._is_missing(exc):
                raise self._missing(name) from exc
            # a range that starts at or past the end is refused (416): the caller says
            # "shorter" when the size confirms it
            refused = "416" in str(exc) or "InvalidRange" in str(exc)
            if refused and start >= self._head(name):
                return b""
            raise self._error(exc, f"reading chunk {name}") from exc
        with self._lock:
            self._remember_size(name, int(result.meta["size"]))
        return data

    def _remember_size(self, name: str, size: int) -> None:
        self._sizes[name] = size
        self._sizes.move_to_end(name)
        while len(self._sizes) > 65536:
            self._sizes.popitem(last=False)

    # --- the block cache --------------------------------------------------------------------

    def _block_path(self, name: str, block: int) -> Path:
        assert self.cache_dir is not None
        digest = hashlib.blake2b(name.encode(), digest_size=16).hexdigest()
        return self.cache_dir / f"{digest}-{block}.block"

    def _empty_cache(self, cache_dir: Path) -> None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        for path in cache_dir.iterdir():
            if path.suffix in (".block", ".tmp"):
                path.unlink(missing_ok=True)

    def _read_block(self, name: str, block: int, low: int, high: int) -> Buffer:
        """Bytes ``[low, high)`` of one block, from the cache or fetched (and then cached)."""
        key = (name, block)
        with self._lock:
            cached = key in self._blocks
            if cached:
                self._blocks.move_to_end(key)
        if cached:
            data = self._read_cached(key, low, high)
            if data is not None:
                with self._lock:
                    self.stats["hits"] += 1
                return data
        at = block * self.block_bytes
        whole = self._get(name, at, at + self.block_bytes)
        with self._lock:
            self.stats["fetches"] += 1
        self._store_block(key, whole)
        return whole[low:high]

    def _read_cached(self, key: tuple[str, int], low: int, high: int) -> bytes | None:
        """The bytes from the block's file, each page checked; None (and the block dropped)
        if the file is gone (evicted meanwhile) or a page fails its CRC."""
        path = self._block_path(*key)
        pages = self.block_bytes // CACHE_PAGE
        first, last = low // CACHE_PAGE, (high - 1) // CACHE_PAGE
        try:
            with open(path, "rb") as f:
                header = os.pread(f.fileno(), 4 * pages, 0)
                body_at = 4 * pages
                raw = os.pread(
                    f.fileno(), (last + 1 - first) * CACHE_PAGE, body_at + first * CACHE_PAGE
                )
        except OSError:
            self._drop(key)
            return None
        if len(header) != 4 * pages:
            self._drop(key, damaged=True)
            return None
        view = memoryview(raw)
        for i, page in enumerate(range(first, last + 1)):
            piece = view[i * CACHE_PAGE : (i + 1) * CACHE_PAGE]
            (expected,) = _CRC.unpack_from(header, 4 * page)
            if crc32c.crc32c(piece) != expected:
                self._drop(key, damaged=True)
                return None
        out = raw[low - first * CACHE_PAGE : high - first * CACHE_PAGE]
        if len(out) != high - low:  # a block shorter than asked: let the fetch decide
            self._drop(key)
            return None
        return out

    def _store_block(self, key: tuple[str, int], data: Buffer) -> None:
        size = len(data)
        if size == 0 or size > self.cache_bytes:
            return
        pages = self.block_bytes // CACHE_PAGE
        view = memoryview(data)
        crcs = [
            crc32c.crc32c(view[i * CACHE_PAGE : (i + 1) * CACHE_PAGE])
            if i * CACHE_PAGE < size
            else 0
            for i in range(pages)
        ]
        path = self._block_path(*key)
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
        # room first, reserved, so the bound holds while the file is written; the block joins
        # the index only once its file is complete (a reader never opens a half-written one)
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self._cached_bytes -= old
            evicted = self._make_room(size)
            self._cached_bytes += size
        for victim in evicted:
            self._block_path(*victim).unlink(missing_ok=True)
        try:
            with open(tmp, "wb") as f:
                f.write(struct.pack(f"<{pages}I", *crcs))
                f.write(view)
            os.replace(tmp, path)
        except OSError:
            # a full or broken cache disk costs speed, not reads: the block is not cached
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            with self._lock:
                self._cached_bytes -= size
            return
        with self._lock:
            raced = self._blocks.pop(key, None)  # the same block, fetched by another thread
            if raced is not None:
                self._cached_bytes -= raced
            self._blocks[key] = size
            # blocks reserved by other threads at once may have pushed the total over
            evicted = self._make_room(0)
        for victim in evicted:
            self._block_path(*victim).unlink(missing_ok=True)

    def _make_room(self, size: int) -> list[tuple[str, int]]:
        """Blocks to evict (least recently used first) so that ``size`` more bytes fit; the
        caller holds the lock and deletes their files."""
        evicted = []
        while self._blocks and self._cached_bytes + size > self.cache_bytes:
            key, victim = self._blocks.popitem(last=False)
            self._cached_bytes -= victim
            evicted.append(key)
        return evicted

    def _drop(self, key: tuple[str, int], *, damaged: bool = False) -> None:
        with self._lock:
            size = self._blocks.pop(key, None)
            if size is not None:
                self._cached_bytes -= size
            if damaged:
                self.stats["damaged"] += 1
        if self.cache_dir is not None:
            self._block_path(*key).unlink(missing_ok=True)

    def _forget(self, name: str) -> None:
        """Drop a chunk's cached blocks and size (it is being replaced or deleted)."""
        with self._lock:
            self._sizes.pop(name, None)
            keys = [key for key in self._blocks if key[0] == name]
        for key in keys:
            self._drop(key)

    @property
    def cached_bytes(self) -> int:
        """Bytes of chunk data in the read cache now (never above ``cache_bytes``)."""
        with self._lock:
            return self._cached_bytes
