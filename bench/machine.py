"""The machine's own limits: what the disk can do with fdatasync, measured the way a journal
writes (appending to a fresh file), in a directory on the same filesystem as the data dirs."""

from __future__ import annotations

import os
import time
from pathlib import Path

MiB = 1024 * 1024


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def seq_write(
    directory: Path, total: int = 256 * MiB, block: int = MiB, sync_every: int = 4 * MiB
) -> dict:
    """Append ``total`` bytes in ``block``-sized writes, fdatasync every ``sync_every`` bytes
    and once at the end. Returns MB/s (10^6 bytes per second, like every rate in this bench)."""
    path = directory / "seq-write.tmp"
    data = os.urandom(block)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        start = time.perf_counter()
        written = unsynced = 0
        while written < total:
            written += os.write(fd, data)
            unsynced += block
            if unsynced >= sync_every:
                os.fdatasync(fd)
                unsynced = 0
        os.fdatasync(fd)
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return {
        "mb_s": written / seconds / 1e6,
        "bytes": written,
        "seconds": seconds,
        "block": block,
        "sync_every": sync_every,
    }


def seq_read(directory: Path, total: int = 256 * MiB, block: int = 4 * MiB) -> dict:
    """Write ``total`` bytes, then read them back in ``block``-sized reads that bypass the page
    cache (``O_DIRECT``; where the filesystem refuses it, after dropping the file's cached
    pages): the ceiling for replaying data that is not in memory. A journal written with
    direct IO leaves the page cache empty, so a first replay of it reads the device."""
    import mmap

    path = directory / "seq-read.tmp"
    chunk = os.urandom(MiB)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(total // MiB):
            os.write(fd, chunk)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    buffer = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    view = memoryview(buffer)
    try:
        try:
            fd, direct = os.open(path, os.O_RDONLY | os.O_DIRECT), True
        except OSError:
            fd, direct = os.open(path, os.O_RDONLY), False
        try:
            start = time.perf_counter()
            done = 0
            while n := os.preadv(fd, [view], done):
                done += n
            seconds = time.perf_counter() - start
        finally:
            os.close(fd)
    finally:
        view.release()
        buffer.close()
        path.unlink(missing_ok=True)
    return {"mb_s": done / seconds / 1e6, "bytes": done, "block": block, "direct": direct}


def fsync_latency(directory: Path, iterations: int = 500, size: int = 4096) -> dict:
    """Append ``size`` bytes and fdatasync, ``iterations`` times: the floor under any
    acknowledge-after-fsync latency, and (as 1/p50) the most group commits per second."""
    path = directory / "fsync.tmp"
    data = os.urandom(size)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    samples = []
    try:
        for _ in range(iterations):
            start = time.perf_counter_ns()
            os.write(fd, data)
            os.fdatasync(fd)
            samples.append((time.perf_counter_ns() - start) / 1e6)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    samples.sort()
    return {
        "p50_ms": _percentile(samples, 0.50),
        "p99_ms": _percentile(samples, 0.99),
        "max_ms": samples[-1],
        "iterations": iterations,
        "size": size,
    }


def measure(directory: Path, total: int = 256 * MiB, iterations: int = 500, runs: int = 3) -> dict:
    """Sequential bandwidth is noisy on shared or virtual disks: take the median of ``runs``
    runs and keep the range."""
    directory.mkdir(parents=True, exist_ok=True)
    writes = sorted((seq_write(directory, total) for _ in range(runs)), key=lambda w: w["mb_s"])
    median = dict(writes[len(writes) // 2])
    median.update(runs=runs, min_mb_s=writes[0]["mb_s"], max_mb_s=writes[-1]["mb_s"])
    reads = sorted((seq_read(directory, total) for _ in range(runs)), key=lambda r: r["mb_s"])
    read = dict(reads[len(reads) // 2])
    read.update(runs=runs, min_mb_s=reads[0]["mb_s"], max_mb_s=reads[-1]["mb_s"])
    return {
        "seq_write": median,
        "seq_read": read,
        "fsync": fsync_latency(directory, iterations),
        "cpus": os.cpu_count(),
    }


if __name__ == "__main__":
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-machine-") as tmp:
        print(json.dumps(measure(Path(tmp)), indent=2))
