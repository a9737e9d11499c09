"""What security costs produce and replay throughput (issue 19: TLS under 15%).

    python bench/security.py [--quick] [--rounds N] [--only tls] [--dir DIR] [--json out.json]

Each scenario is an A/B comparison in one run on the same machine: a round starts a broker of
each kind, one after the other and in alternating order, warms it up (a fresh broker's first
run pays for untouched memory, see bench/README.md), then measures every workload on it. The
table shows each workload's median per kind and the ratio ``with / without``; ``cost`` is how
much slower the secured broker is (for latency rows: how much longer).

Scenarios (``--only``; see ``SCENARIOS``):

* ``tls``: the broker with ``--tls-cert/--tls-key`` and clients with ``tls=True, ca=...``
  (TLS 1.3, the certificate made here with ``openssl``) against plaintext.
* authorization (``auth`` on vs off) and the noisy-tenant quota bench are added as their own
  functions in ``SCENARIOS`` (see the comments there); they reuse ``Side``, ``measure_round``
  and ``print_table``.

Workloads (``WORKLOADS``): 1 KiB events through ``send()`` (events/s, MB/s); 100 B events
through ``send_many()``; the round trip of one ``send()`` + ``result()`` (p50/p99, fsync
included); a bounded replay of the 1 KiB stream through ``reader.batches()`` (MB/s), and once
more (``again``); the 100 B stream event by event (events/s). Every produce checks the stream
holds what was sent, every replay that it read all of it. ``cpu`` rows give the client's and
the broker's CPU seconds per replay (``getrusage`` and ``/proc/PID/stat``): the side that is
busy the whole wall time is the bottleneck.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from slipstream_peer import SlipstreamPeer

# -- certificates and peers --------------------------------------------------------------------


def make_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a broker certificate for 127.0.0.1 (P-256, made with the openssl CLI):
    (ca, cert, key)."""
    if shutil.which("openssl") is None:
        raise RuntimeError("the tls scenario needs the openssl command (apt-get install openssl)")
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_key = folder / "ca.pem", folder / "ca-key.pem"
    cert, key, csr = folder / "broker.pem", folder / "broker-key.pem", folder / "broker.csr"
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    run = lambda *args: subprocess.run(["openssl", *args], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=bench CA")
    run("req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1")
    extensions = folder / "san.ext"
    extensions.write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    run(
        "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
        "-out", cert, "-days", "2", "-extfile", extensions,
    )  # fmt: skip
    return ca, cert, key


class _ConnectWith:
    """Stands in for the ``slipstream`` module in a peer: ``connect`` with extra options
    (``tls=True, ca=...``), everything else the module's."""

    def __init__(self, module: Any, **options: Any) -> None:
        self._module = module
        self._options = options

    def connect(self, address: str, **kwargs: Any) -> Any:
        return self._module.connect(address, **{**self._options, **kwargs})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


@dataclass
class Side:
    """One side of an A/B comparison: how to start its broker and connect its clients."""

    name: str
    #: more ``slipstream up`` options
    up_args: list[str] = field(default_factory=list)
    #: more ``slipstream.connect`` options
    connect: dict[str, Any] = field(default_factory=dict)

    def peer(self, data_dir: Path) -> SlipstreamPeer:
        # no HTTP port: the default one may be taken by another broker on this machine
        peer = SlipstreamPeer(data_dir, extra_args=["--http-port", "-1", *self.up_args])
        if self.connect:
            peer.slipstream = _ConnectWith(peer.slipstream, **self.connect)
        return peer


# -- workloads ---------------------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    """A process's CPU time: its threads' run time in ns from schedstat (``/proc/PID/stat``
    counts 10 ms ticks, too coarse for a 0.1 s replay); threads that ended are not counted."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
    return total / 1e9


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _with_cpu(peer: SlipstreamPeer, run: Callable[[], dict]) -> dict:
    """``run()``'s result with the client's and the broker's CPU seconds while it ran."""
    assert peer.proc is not None
    client, broker = _own_cpu_seconds(), _cpu_seconds(peer.proc.pid)
    result = run()
    result["client_cpu_s"] = _own_cpu_seconds() - client
    result["broker_cpu_s"] = _cpu_seconds(peer.proc.pid) - broker
    return result


def append_round_trips(peer: SlipstreamPeer, stream: str, count: int, size: int = 1024) -> dict:
    """``count`` times one ``send()`` and its ``result()``, no linger: the latency of one
    durable append (fsync included), p50 and p99."""
    peer.client.create_stream(stream, segments=1)
    payload = os.urandom(size)
    samples: list[float] = []
    with peer._producer(stream, linger_ms=0) as producer:
        for _ in range(count):
            start = time.perf_counter()
            producer.send(payload).result()
            samples.append(time.perf_counter() - start)
    samples.sort()
    pick = lambda q: samples[min(len(samples) - 1, int(q * len(samples)))] * 1e3  # noqa: E731
    return {"events": count, "p50_ms": pick(0.50), "p99_ms": pick(0.99)}


@dataclass(frozen=True)
class Row:
    """One line of the table: a number taken from a workload's result."""

    label: str
    workload: str
    key: str
    unit: str
    #: latency: lower is better, and the cost is how much longer
    lower_is_better: bool = False


def _workloads(sizes: dict[str, int]) -> dict[str, Callable[[SlipstreamPeer, str], dict]]:
    """name -> run(peer, stream prefix). The replays read what the produce workloads of the
    same prefix wrote, so they run after them."""
    return {
        "produce_1k": lambda peer, p: _with_cpu(
            peer, lambda: peer.produce(f"{p}-1k", 1024, sizes["p1k"])
        ),
        "produce_100b_bulk": lambda peer, p: _with_cpu(
            peer, lambda: peer.produce_bulk(f"{p}-100b", 100, sizes["p100"])
        ),
        "append_latency": lambda peer, p: append_round_trips(peer, f"{p}-lat", sizes["lat"]),
        "replay_1k": lambda peer, p: _with_cpu(
            peer, lambda: peer.replay_batches(f"{p}-1k", 1024, sizes["p1k"])
        ),
        "replay_1k_again": lambda peer, p: _with_cpu(
            peer, lambda: peer.replay_batches(f"{p}-1k", 1024, sizes["p1k"])
        ),
        "replay_100b_events": lambda peer, p: _with_cpu(
            peer, lambda: peer.replay_events(f"{p}-100b", 100, sizes["p100"])
        ),
    }


ROWS = (
    Row("produce 1 KiB, send()", "produce_1k", "events_s", "events/s"),
    Row("produce 1 KiB, send()", "produce_1k", "mb_s", "MB/s"),
    Row("  client CPU", "produce_1k", "client_cpu_s", "s", lower_is_better=True),
    Row("  broker CPU", "produce_1k", "broker_cpu_s", "s", lower_is_better=True),
    Row("produce 100 B, send_many()", "produce_100b_bulk", "events_s", "events/s"),
    Row("produce 100 B, send_many()", "produce_100b_bulk", "mb_s", "MB/s"),
    Row("append round trip p50", "append_latency", "p50_ms", "ms", lower_is_better=True),
    Row("append round trip p99", "append_latency", "p99_ms", "ms", lower_is_better=True),
    Row("replay 1 KiB, batches()", "replay_1k", "mb_s", "MB/s"),
    Row("replay 1 KiB, batches()", "replay_1k", "events_s", "events/s"),
    Row("  client CPU", "replay_1k", "client_cpu_s", "s", lower_is_better=True),
    Row("  broker CPU", "replay_1k", "broker_cpu_s", "s", lower_is_better=True),
    Row("replay 1 KiB again", "replay_1k_again", "mb_s", "MB/s"),
    Row("  client CPU", "replay_1k_again", "client_cpu_s", "s", lower_is_better=True),
    Row("  broker CPU", "replay_1k_again", "broker_cpu_s", "s", lower_is_better=True),
    Row("replay 100 B, event by event", "replay_100b_events", "events_s", "events/s"),
    Row("replay 100 B, event by event", "replay_100b_events", "mb_s", "MB/s"),
)


# -- one A/B comparison ------------------------------------------------------------------------


def measure_round(
    side: Side,
    data_dir: Path,
    workloads: dict[str, Callable[[SlipstreamPeer, str], dict]],
    round_number: int,
) -> dict[str, dict]:
    """Start ``side``'s broker, warm it up with one run of every workload, measure each once."""
    peer = side.peer(data_dir)
    peer.start()
    out: dict[str, dict] = {}
    try:
        for run in workloads.values():
            run(peer, "bench/warm")
        for name, run in workloads.items():
            os.sync()
            time.sleep(0.5)
            out[name] = result = run(peer, "bench/run")
            shown = ", ".join(
                f"{k} {v:,.3f}" if isinstance(v, float) and v < 100 else f"{k} {v:,.0f}"
                for k, v in result.items()
                if k in ("events_s", "mb_s", "p50_ms", "p99_ms", "client_cpu_s", "broker_cpu_s")
            )
            print(f"  round {round_number + 1} {side.name:<10} {name:<20} {shown}", flush=True)
    finally:
        peer.stop()
    return out


def compare(
    without: Side,
    with_: Side,
    sizes: dict[str, int],
    rounds: int,
    root: Path,
) -> dict[str, dict[str, list[dict]]]:
    """``rounds`` rounds, each one broker per side, the order alternating: every result."""
    workloads = _workloads(sizes)
    runs: dict[str, dict[str, list[dict]]] = {without.name: {}, with_.name: {}}
    for round_number in range(rounds):
        sides = [without, with_] if round_number % 2 == 0 else [with_, without]
        for side in sides:
            data_dir = root / f"{side.name}-{round_number}"
            results = measure_round(side, data_dir, workloads, round_number)
            shutil.rmtree(data_dir, ignore_errors=True)
            for name, result in results.items():
                runs[side.name].setdefault(name, []).append(result)
    return runs


def print_table(
    title: str, without: str, with_: str, runs: dict[str, dict[str, list[dict]]]
) -> list[dict]:
    """The median of each row per side, the ratio ``with / without`` and the cost."""
    print(f"\n{title}")
    print(f"{'':<30} {without:>14} {with_:>14} {'ratio':>7} {'cost':>7}  (medians; unit)")
    table = []
    for row in ROWS:
        values = {
            side: [r[row.key] for r in runs[side].get(row.workload, []) if row.key in r]
            for side in (without, with_)
        }
        if not values[without] or not values[with_]:
            continue
        base, secured = (statistics.median(values[s]) for s in (without, with_))
        ratio = secured / base if base else float("nan")
        cost = ratio - 1 if row.lower_is_better else 1 - ratio
        fmt = "{:>14,.3f}" if base < 100 else "{:>14,.0f}"
        print(
            f"{row.label:<30} {fmt.format(base)} {fmt.format(secured)} {ratio:>7.3f} "
            f"{100 * cost:>6.1f}%  {row.unit}"
        )
        table.append(
            {
                "row": row.label,
                "workload": row.workload,
                "key": row.key,
                "unit": row.unit,
                without: base,
                with_: secured,
                "ratio": ratio,
                "cost": cost,
                "runs": values,
            }
        )
    return table


# -- scenarios ---------------------------------------------------------------------------------


def openssl_speed() -> dict[str, float]:
    """One core's AEAD throughput in MB/s at 16 KiB (a full TLS record), per cipher: the
    machine's ceiling for what one TLS connection can carry in one direction."""
    out = {}
    for cipher in ("aes-128-gcm", "aes-256-gcm", "chacha20-poly1305"):
        done = subprocess.run(
            ["openssl", "speed", "-seconds", "1", "-bytes", "16384", "-evp", cipher],
            capture_output=True,
            text=True,
        )
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        if done.returncode == 0 and lines:
            out[cipher] = float(lines[-1].split()[-1].rstrip("k")) / 1e3  # 1000s of bytes/s
    return out


def tls_cost(sizes: dict[str, int], rounds: int, root: Path) -> dict:
    """TLS 1.3 on the binary port (``--tls-cert/--tls-key``, clients ``tls=True, ca=``)
    against plaintext."""
    ca, cert, key = make_certificates(root / "pki")
    speed = openssl_speed()
    print(
        "openssl speed, one core, 16 KiB: "
        + ", ".join(f"{c} {v:,.0f} MB/s" for c, v in speed.items())
    )
    plain = Side("plaintext")
    tls = Side("tls", ["--tls-cert", str(cert), "--tls-key", str(key)], {"tls": True, "ca": ca})
    runs = compare(plain, tls, sizes, rounds, root)
    table = print_table("TLS (ratio = tls / plaintext)", plain.name, tls.name, runs)
    limits = _crypto_limits(table, speed, sizes["p1k"] * 1024 / 1e6)
    for line in limits["lines"]:
        print(line)
    return {"openssl_speed_mb_s": speed, "table": table, "limits": limits}


def _crypto_limits(table: list[dict], speed: dict[str, float], megabytes: float) -> dict:
    """TLS's floor on this machine, in CPU (robust to other load, unlike wall time): the AEAD
    TLS 1.3 negotiates here (AES-256-GCM) at ``openssl speed``'s rate costs each side
    ``megabytes / rate`` seconds of a core on top of its plaintext work. When the busier side
    is the limit, the best TLS can do is ``plain / (plain + aead)`` of the plaintext rate,
    against ``plain / tls`` measured (the busier side's CPU seconds with and without TLS)."""
    medians = {(r["workload"], r["key"]): r for r in table}
    out: dict[str, Any] = {"lines": []}
    aead = speed.get("aes-256-gcm")
    if not aead:
        return out
    crypto_s = megabytes / aead
    out["aead_s_per_side"] = crypto_s
    out["lines"].append(
        f"AES-256-GCM over the {megabytes:,.0f} MB of the 1 KiB stream at {aead:,.0f} MB/s "
        f"(openssl speed): {crypto_s:.3f} s of a core on each side"
    )
    for workload in ("produce_1k", "replay_1k", "replay_1k_again"):
        client = medians.get((workload, "client_cpu_s"))
        broker = medians.get((workload, "broker_cpu_s"))
        if client is None or broker is None:
            continue
        plain = max(client["plaintext"], broker["plaintext"])
        tls = max(client["tls"], broker["tls"])
        out[workload] = {
            "extra_client_cpu_s": client["tls"] - client["plaintext"],
            "extra_broker_cpu_s": broker["tls"] - broker["plaintext"],
            "floor_ratio": plain / (plain + crypto_s),
            "cpu_ratio": plain / tls,
        }
        out["lines"].append(
            f"{workload}: TLS added {client['tls'] - client['plaintext']:.3f} s client CPU, "
            f"{broker['tls'] - broker['plaintext']:.3f} s broker CPU (the AEAD alone "
            f"{crypto_s:.3f}); busier side {plain:.3f} -> {tls:.3f} s: CPU ratio "
            f"{plain / tls:.2f}, the AEAD alone would allow {plain / (plain + crypto_s):.2f}"
        )
    return out


def authz_cost(sizes: dict[str, int], rounds: int, root: Path) -> dict:
    """Authorization (issue 19: under 3%): a broker with ``--auth`` whose clients carry a user
    token that access rules allow (``bench`` may produce, consume and manage ``bench/*``, among
    200 rules of other subjects), against one without authentication."""
    from slipstream.security import TokenKeys

    class AuthSide(Side):
        def peer(self, data_dir: Path) -> SlipstreamPeer:
            data_dir.mkdir(parents=True, exist_ok=True)
            keys = TokenKeys.load(data_dir)  # the broker uses the keys it finds there
            self.connect = {"token": keys.issue("bench", "user").token}
            admin_token = keys.issue("ops", "admin").token
            peer = super().peer(data_dir)
            start = peer.start

            def start_and_grant() -> None:
                start()
                with peer.slipstream.connect(f"127.0.0.1:{peer.port}", token=admin_token) as ops:
                    for n in range(200):
                        ops.grant(f"user{n}", "consume", f"scope{n}/*")
                    for action in ("produce", "consume", "manage"):
                        ops.grant("bench", action, "bench/*")

            peer.start = start_and_grant  # type: ignore[method-assign]
            return peer

    def check_ns() -> dict[str, float]:
        """One check's own cost in a broker in this process (no noise of other load):
        authentication off, a cached allow, and a miss that walks the 201 rules."""
        import asyncio

        from slipstream.broker import Broker, BrokerConfig
        from slipstream.security import Action, Principal, Role

        async def measure() -> dict[str, float]:
            broker = Broker(BrokerConfig(data_dir=root / "in-process", port=0))
            ready = asyncio.Event()
            serving = asyncio.create_task(broker.serve(lambda _: ready.set()))
            await ready.wait()
            service, out = broker.service, {}
            try:
                admin = service.connect("bench", Principal("ops", Role.ADMIN))
                for n in range(200):
                    await service.grant(admin, f"user{n}", "consume", f"scope{n}/*")
                await service.grant(admin, "bench", "produce", "bench/*")
                for label, principal, misses in (
                    ("off", None, False),
                    ("cached", Principal("bench"), False),
                    ("miss", Principal("bench"), True),
                ):
                    caller, count, best = service.connect("bench", principal), 20_000, 1e9
                    for _ in range(5):
                        started = time.perf_counter()
                        for _ in range(count):
                            if misses:
                                caller.access_version = -1  # as after a rule change
                            service.authorize(caller, Action.PRODUCE, "bench/x")
                        best = min(best, (time.perf_counter() - started) / count)
                    out[label] = best * 1e9
            finally:
                broker.stop()
                await serving
            return out

        return asyncio.run(measure())

    checks = check_ns()
    print(
        "one check, in process: authentication off {off:,.0f} ns, a cached allow {cached:,.0f} "
        "ns, a miss over 201 rules {miss:,.0f} ns (once per request: an append carries a whole "
        "batch)".format(**checks)
    )
    off, on = Side("auth-off"), AuthSide("auth-on", ["--auth"])
    runs = compare(off, on, sizes, rounds, root)
    table = print_table("authorization (ratio = auth-on / auth-off)", off.name, on.name, runs)
    return {"check_ns": checks, "table": table}


# A scenario: (sizes, rounds, scratch directory) -> what goes into the JSON. The authorization
# cost (a broker with --auth, clients with a token, against one without) goes here as "auth",
# built on Side/compare/print_table like tls_cost; the noisy-tenant quota bench as "noisy", a
# function of its own in this file.
SCENARIOS: dict[str, Callable[[dict[str, int], int, Path], dict]] = {
    "tls": tls_cost,
    "auth": authz_cost,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs")
    parser.add_argument("--rounds", type=int, default=3, help="brokers of each kind (median)")
    parser.add_argument(
        "--only", default=",".join(SCENARIOS), help=f"comma-separated: {', '.join(SCENARIOS)}"
    )
    parser.add_argument("--dir", type=Path, default=None, help="where data directories go")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args(argv)
    sizes = (
        {"p1k": 50_000, "p100": 1_000_000, "lat": 300}
        if args.quick
        else {"p1k": 200_000, "p100": 4_000_000, "lat": 1_000}
    )
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    results: dict[str, Any] = {"sizes": sizes, "rounds": args.rounds}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="security-bench-") as root:
        for name in chosen:
            results[name] = SCENARIOS[name](sizes, args.rounds, Path(root) / name)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
