"""Bytes on disk per event: slipstream and NATS JetStream's file store, in the same run.

    python bench/storage.py [--quick] [--json out.json]
    python bench/run.py --only storage          # the same, as a workload of the bench

For each payload (100 B and 1 KiB; JSON-ish records with varying fields, and random bytes as
the worst case) it stores N events and reports what they take on disk, per event:

* slipstream, through the public client with its default settings, three ways: ``send`` (one
  ``send()`` per event in a tight loop: big batches), ``cli`` (``slipstream produce`` reading
  lines from stdin, as a user pipes a file) and ``small`` (``send()`` five events, then
  ``flush()``: the batches a slow producer makes). Each case gets a fresh broker whose mover
  runs every second; the numbers are taken after the mover has turned the journal into chunks.
* JetStream 2.9's file store: the same payloads, one acknowledged publish each.

"allocated" is what ``du`` counts (blocks, each inode once); "apparent" is file sizes
(``du --apparent-size``). slipstream's bytes are broken down by walking its files as
docs/format.md describes them: journal entry framing, alignment padding, batch headers, Arrow
schema messages and end markers, Arrow record batch metadata, Arrow buffers, filesystem block
rounding, and the catalog (SQLite) growth.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nats_peer import AckCounter, NatsPeer, _names
from slipstream_peer import PYTHON, SlipstreamPeer

SIZES = {
    "full": {100: 100_000, 1024: 20_000, "small": 2_000},
    "quick": {100: 20_000, 1024: 4_000, "small": 500},
}
SMALL_BATCH = 5  # events per flush() in the "small" mode

# -- payloads --------------------------------------------------------------------------------

_WORDS = [
    *("click", "view", "purchase", "login", "logout", "search", "add_to_cart", "checkout"),
    *("refund", "signup", "share", "like", "comment", "scroll", "hover", "play", "pause", "seek"),
]
_COUNTRIES = ["DE", "FR", "US", "GB", "NL", "SE", "PL", "ES", "IT", "JP", "BR", "IN", "CA", "AU"]
_AGENTS = [
    "Mozilla/5.0 (X11; Linux x86_64) Firefox/132.0",
    "Mozilla/5.0 (iPhone; CPU iPhone OS 18_1) Safari/604.1",
    "Mozilla/5.0 (Windows NT 10.0; Win64; x64) Chrome/131.0",
    "okhttp/4.12.0",
    "python-requests/2.32.3",
]


def json_values(size: int, count: int, seed: int = 1) -> list[bytes]:
    """``count`` JSON objects of about ``size`` bytes: ids, times, users and amounts that vary
    from event to event, a free-text note; from 512 bytes on also a session id, a user agent,
    an IP address and a list of 1 to 12 order lines. Compact JSON, one object per line."""
    rnd = random.Random(seed)
    out = []
    ts = 1_763_798_400_000
    for i in range(count):
        ts += rnd.randint(0, 40)
        record: dict = {
            "id": 10_000_000 + i * 7 + rnd.randint(0, 6),
            "ts": ts,
            "user": f"u{rnd.randint(1, 50_000)}",
            "event": rnd.choice(_WORDS),
        }
        if size >= 512:
            record |= {
                "session": f"{rnd.getrandbits(128):032x}",
                "country": rnd.choice(_COUNTRIES),
                "agent": rnd.choice(_AGENTS),
                "amount": round(rnd.uniform(0, 500), 2),
                "items": [
                    {
                        "sku": f"SKU-{rnd.randint(1, 99_999):05d}",
                        "qty": rnd.randint(1, 5),
                        "price": round(rnd.uniform(1, 200), 2),
                    }
                    for _ in range(rnd.randint(1, 12))
                ],
                "ip": ".".join(str(rnd.randint(1, 254)) for _ in range(4)),
            }
        else:
            record["amount"] = round(rnd.uniform(0, 500), 2)
        text = json.dumps(record, separators=(",", ":"))
        fill = size - len(text) - 11  # len(',"note":""')
        if fill > 0:
            record["note"] = " ".join(rnd.choice(_WORDS) for _ in range(fill // 5 + 1))[:fill]
            text = json.dumps(record, separators=(",", ":"))
        out.append(text.encode())
    return out


def random_values(size: int, count: int) -> list[bytes]:
    return [os.urandom(size) for _ in range(count)]


def payloads(kind: str, size: int, count: int) -> list[bytes]:
    return json_values(size, count) if kind == "json" else random_values(size, count)


# -- measuring files -------------------------------------------------------------------------


def disk_usage(root: Path, pattern: str = "*") -> dict:
    """``du``-style bytes of the files under ``root``: allocated (blocks, each inode once)
    and apparent (sizes, each inode once)."""
    seen: set[tuple[int, int]] = set()
    allocated = apparent = files = 0
    for path in root.rglob(pattern):
        st = path.lstat()
        if not path.is_file() or (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        allocated += st.st_blocks * 512
        apparent += st.st_size
        files += 1
    return {"allocated": allocated, "apparent": apparent, "files": files}


_ENTRY = struct.Struct("<II")
_SELF_CHECKED = 0x8000_0000
_BLOCK = 4096
_BATCH_HEAD = struct.Struct("<4sBBHqII HhI")
_EVENT_MESSAGE = 0x4  # batch flag: the body is one Arrow record batch message (format.md)
_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def _split_body(body: memoryview, parts: dict) -> None:
    """Add one batch body's bytes to ``parts`` by kind, reading its Arrow IPC messages."""
    import pyarrow as pa

    reader = pa.BufferReader(pa.py_buffer(body))
    while reader.tell() < len(body):
        at = reader.tell()
        if bytes(body[at : at + 8]) == _END_OF_STREAM:
            parts["arrow_schema_and_end"] += 8
            reader.seek(at + 8)
            continue
        message = pa.ipc.read_message(reader)
        size = reader.tell() - at
        if message.type == "schema":
            parts["arrow_schema_and_end"] += size
        else:
            parts["arrow_buffers"] += message.body.size
            parts["arrow_batch_metadata"] += size - message.body.size


def _split_batch(batch: memoryview, parts: dict) -> None:
    magic, _version, _r, header_length, _base, length, _crc, flags, _epoch, count = (
        _BATCH_HEAD.unpack_from(batch)
    )
    if magic != b"SLB1":
        raise ValueError(f"not a batch: {bytes(batch[:8])!r}")
    parts["batches"] += 1
    parts["events"] += count
    parts["batch_header"] += header_length
    _split_body(batch[header_length:length], parts)
    if flags & _EVENT_MESSAGE:
        parts["event_message_batches"] += 1


def _split_journal_file(data: memoryview, parts: dict) -> None:
    """A journal file (or a chunk hard-linked to one): entries, padding, batches."""
    at = 0
    while at + _ENTRY.size <= len(data):
        length, _crc = _ENTRY.unpack_from(data, at)
        if length == 0:  # zeros up to the next block boundary at least 8 bytes on
            boundary = -(-(at + _ENTRY.size) // _BLOCK) * _BLOCK
            parts["journal_padding"] += min(boundary, len(data)) - at
            at = boundary
            continue
        length &= ~_SELF_CHECKED
        parts["journal_entry_framing"] += _ENTRY.size + 8  # entry header + segment id
        _split_batch(data[at + 16 : at + 8 + length], parts)
        at += _ENTRY.size + length
    parts["journal_padding"] += len(data) - min(at, len(data))


def _split_chunk_file(data: memoryview, parts: dict) -> None:
    """A chunk written back to back: batches with nothing between them."""
    at = 0
    while at < len(data):
        length = struct.unpack_from("<I", data, at + 16)[0]
        _split_batch(data[at : at + length], parts)
        at += length


def breakdown(data_dir: Path) -> dict:
    """Where slipstream's bytes go: every journal and chunk file (each inode once), split by
    the layout in docs/format.md."""
    parts = dict.fromkeys(
        (
            "journal_entry_framing",
            "journal_padding",
            "batch_header",
            "arrow_schema_and_end",
            "arrow_batch_metadata",
            "arrow_buffers",
            "batches",
            "events",
            "event_message_batches",
        ),
        0,
    )
    seen: set[tuple[int, int]] = set()
    files = [*data_dir.glob("journal/*/*.journal"), *data_dir.glob("chunks/**/*.chunk")]
    for path in files:
        st = path.stat()
        if (st.st_dev, st.st_ino) in seen or not st.st_size:
            continue
        seen.add((st.st_dev, st.st_ino))
        data = memoryview(path.read_bytes())
        if bytes(data[:4]) == b"SLB1":
            _split_chunk_file(data, parts)
        else:
            _split_journal_file(data, parts)
    return parts


# -- slipstream ------------------------------------------------------------------------------


def _wait_for_mover(data_dir: Path, timeout: float = 60) -> None:
    """Until the journal is empty (the mover sealed it and turned it into chunks)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if disk_usage(data_dir / "journal", "*.journal")["apparent"] == 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"the mover did not empty the journal of {data_dir} in {timeout} s")


def _produce_send(peer: SlipstreamPeer, stream: str, values: list[bytes], per_flush: int) -> None:
    with peer.client.producer(stream) as producer:  # the client's defaults
        for i, value in enumerate(values, 1):
            producer.send(value)
            if per_flush and i % per_flush == 0:
                producer.flush()


def _produce_cli(peer: SlipstreamPeer, stream: str, values: list[bytes], kind: str) -> None:
    if kind == "json":
        lines, mode = b"\n".join(values) + b"\n", ["--raw"]
    else:
        lines = b"".join(b'{"value_base64":"%s"}\n' % base64.b64encode(value) for value in values)
        mode = []
    subprocess.run(
        [
            PYTHON,
            "-m",
            "slipstream",
            "produce",
            stream,
            "--broker",
            f"127.0.0.1:{peer.port}",
            *mode,
        ],
        input=lines,
        check=True,
        capture_output=True,
    )


def slipstream_case(root: Path, kind: str, size: int, mode: str, values: list[bytes]) -> dict:
    """One fresh broker (mover every second), ``values`` stored one way, then its files."""
    data_dir = root / f"slipstream-{kind}-{size}-{mode}"
    peer = SlipstreamPeer(data_dir, compression="default", extra_args=["--roll-seconds", "1"])
    peer.start()  # and stopped: the empty catalog, cleanly closed, is the baseline
    peer.stop()
    catalog_before = disk_usage(data_dir, "meta.db*")["allocated"]
    peer = SlipstreamPeer(data_dir, compression="default", extra_args=["--roll-seconds", "1"])
    peer.start()
    try:
        stream = "bench/storage"
        peer.client.create_stream(stream, segments=1)
        if mode == "cli":
            _produce_cli(peer, stream, values, kind)
        else:
            _produce_send(peer, stream, values, SMALL_BATCH if mode == "small" else 0)
        stored = sum(peer.client.tail(stream).positions.values())
        if stored != len(values):
            raise RuntimeError(f"sent {len(values)} events, the stream holds {stored}")
        _wait_for_mover(data_dir)
    finally:
        peer.stop()  # a clean stop folds SQLite's write-ahead log into the catalog
    os.sync()
    stored_files = disk_usage(data_dir / "chunks")
    journal = disk_usage(data_dir / "journal")
    catalog = disk_usage(data_dir, "meta.db*")
    parts = breakdown(data_dir)
    events = len(values)
    allocated = stored_files["allocated"] + journal["allocated"]
    apparent = stored_files["apparent"] + journal["apparent"]
    return {
        "events": events,
        "payload_per_event": sum(map(len, values)) / events,
        "allocated_per_event": allocated / events,
        "apparent_per_event": apparent / events,
        "catalog_growth_per_event": (catalog["allocated"] - catalog_before) / events,
        "files": stored_files["files"] + journal["files"],
        "batches": parts["batches"],
        "events_per_batch": events / max(1, parts["batches"]),
        "parts_per_event": {
            **{k: v / events for k, v in parts.items() if k not in ("batches", "events")},
            "fs_rounding": (allocated - apparent) / events,
        },
    }


# -- JetStream -------------------------------------------------------------------------------


def jetstream_case(peer: NatsPeer, name: str, values: list[bytes]) -> dict:
    """Publish ``values`` (acknowledged) to a file-store stream of their own, then its files."""

    async def main() -> dict:
        conn = await peer._connect()
        await peer._create_stream(conn, name)
        acks = AckCounter()
        inbox = b"_INBOX.storage.%d" % next(_names)
        conn.subscribe(inbox, acks)
        await conn.ping()
        subject = name.lower().encode()
        step = 1024
        for at in range(0, len(values), step):
            await acks.until(at + step - peer.window)
            conn.transport.write(
                b"".join(
                    b"PUB %s %s %d\r\n%s\r\n" % (subject, inbox, len(v), v)
                    for v in values[at : at + step]
                )
            )
            await conn.drain()
        await acks.until(len(values))
        if acks.errors:
            raise RuntimeError(f"{acks.errors} publishes failed: {acks.first_error[:200]!r}")
        info = await conn.request(f"$JS.API.STREAM.INFO.{name}")
        conn.close()
        return info["state"]

    state = peer.run(main())
    if state["messages"] != len(values):
        raise RuntimeError(f"{name}: published {len(values)}, stream holds {state['messages']}")
    time.sleep(1.0)  # the file store's write buffer goes to its files on a short timer
    os.sync()
    [directory] = list(peer.data_dir.glob(f"jetstream/*/streams/{name}"))
    usage = disk_usage(directory)
    events = len(values)
    return {
        "events": events,
        "allocated_per_event": usage["allocated"] / events,
        "apparent_per_event": usage["apparent"] / events,
        "state_bytes_per_event": state["bytes"] / events,
        "files": usage["files"],
    }


# -- the run ---------------------------------------------------------------------------------

KINDS = ("json", "random")
EVENT_SIZES = (100, 1024)
MODES = ("send", "cli", "small")
PEERS = ("jetstream", "slipstream")


def measure(
    root: Path, quick: bool = False, peers: tuple[str, ...] = ("jetstream", "slipstream")
) -> dict:
    """Every case for both peers; one dict of results (see the module docstring)."""
    sizes = SIZES["quick" if quick else "full"]
    data: dict[tuple[str, int, str], list[bytes]] = {}
    for kind in KINDS:
        for size in EVENT_SIZES:
            data[kind, size, "many"] = payloads(kind, size, sizes[size])
            data[kind, size, "small"] = data[kind, size, "many"][: sizes["small"]]
    out: dict = {"jetstream": {}, "slipstream": {}}
    if "jetstream" in peers:
        peer = NatsPeer(root / "jetstream")
        peer.start()
        out["jetstream_version"] = peer.version
        try:
            for kind in KINDS:
                for size in EVENT_SIZES:
                    key = f"{kind}_{size}"
                    out["jetstream"][key] = jetstream_case(
                        peer, f"S{kind.upper()}{size}", data[kind, size, "many"]
                    )
        finally:
            peer.stop()
    if "slipstream" in peers:
        for kind in KINDS:
            for size in EVENT_SIZES:
                for mode in MODES:
                    values = data[kind, size, "small" if mode == "small" else "many"]
                    out["slipstream"][f"{kind}_{size}_{mode}"] = slipstream_case(
                        root, kind, size, mode, values
                    )
    return out


def rows(results: dict) -> list[list[str]]:
    """Table rows: case, payload, slipstream allocated / apparent per event, JetStream's, ratio."""
    table = []
    for key, ss in results["slipstream"].items():
        kind, size, mode = key.split("_")
        js = results["jetstream"].get(f"{kind}_{size}", {})
        js_alloc = js.get("allocated_per_event")
        table.append(
            [
                f"{kind} {size} B, {mode}",
                f"{ss['payload_per_event']:.0f}",
                f"{ss['events_per_batch']:.0f}",
                f"{ss['allocated_per_event']:.1f}",
                f"{ss['apparent_per_event']:.1f}",
                f"{js_alloc:.1f}" if js_alloc else "—",
                f"{js.get('apparent_per_event', 0):.1f}" if js else "—",
                f"{ss['allocated_per_event'] / js_alloc:.2f}x" if js_alloc else "—",
            ]
        )
    return table


HEAD = [
    "case",
    "payload B",
    "events/batch",
    "slipstream du B/ev",
    "apparent",
    "JetStream du B/ev",
    "apparent",
    "ratio",
]
PARTS = [
    "journal_entry_framing",
    "journal_padding",
    "batch_header",
    "arrow_schema_and_end",
    "arrow_batch_metadata",
    "arrow_buffers",
    "fs_rounding",
]


def print_results(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    table = Table(title="bytes on disk per event (after the mover; du = allocated blocks)")
    for i, column in enumerate(HEAD):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows(results):
        table.add_row(*row)
    console.print(table)
    parts = Table(title="slipstream: where the bytes go, per event")
    for i, column in enumerate(["case", *PARTS, "catalog"]):
        parts.add_column(column.replace("_", " "), justify="left" if i == 0 else "right")
    for key, ss in results["slipstream"].items():
        per = ss["parts_per_event"]
        parts.add_row(
            key.replace("_", " "),
            *[f"{per[p]:.1f}" for p in PARTS],
            f"{ss['catalog_growth_per_event']:.1f}",
        )
    console.print(parts)
    console.print(
        "ratio = slipstream du / JetStream du (lower is better). slipstream: the client's "
        "default settings; send = one send() per event, cli = slipstream produce, small = "
        f"flush() every {SMALL_BATCH} events. JetStream 2.9 file store, one publish per event.",
        style="dim",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer events: a smoke test")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--peers", default="jetstream,slipstream")
    parser.add_argument("--dir", default=None, help="where the data directories go")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="slipstream-storage-", dir=args.dir))
    try:
        results = measure(root, args.quick, tuple(p.strip() for p in args.peers.split(",")))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_results(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
