"""``slipstream produce`` when events cannot be delivered: it says how many were acknowledged,
exits non-zero, and ``--skip`` resumes from the first line not acknowledged."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

from conftest import BrokerProcess

import slipstream


def produce_process(broker: BrokerProcess, stream: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slipstream",
            "produce",
            stream,
            "--broker",
            broker.address,
            *args,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def feed(proc: subprocess.Popen[bytes], values: range) -> None:
    assert proc.stdin is not None
    try:
        for value in values:
            proc.stdin.write(f'{{"value": {value}}}\n'.encode())
            proc.stdin.flush()
            time.sleep(0.02)
    except BrokenPipeError:
        pass  # it stopped reading: the failure was seen


def wait_for_events(client: slipstream.Client, stream: str, count: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        info = client.describe_stream(stream)
        if sum(s.end_offset - s.start_offset for s in info.segments) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{stream} never held {count} events")


def finish(proc: subprocess.Popen[bytes]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=90)  # closes stdin: the end of the input
    return proc.returncode, out.decode(), " ".join(err.decode().split())


def test_a_stream_deleted_midway_exits_non_zero_with_the_acknowledged_count(
    broker: BrokerProcess,
) -> None:
    with broker.client() as client:
        client.create_stream("cli/gone")
        proc = produce_process(broker, "cli/gone", "--json")
        feed(proc, range(10))
        wait_for_events(client, "cli/gone", 10)
        time.sleep(0.3)  # the acknowledgements reach the producer
        client.delete_stream("cli/gone")
        feed(proc, range(10, 20))
        code, out, err = finish(proc)
    assert code == 1, err
    assert "does not exist" in err
    assert "acknowledged 10 of" in err
    assert "--skip 10" in err
    summary = json.loads(out)
    assert summary["acknowledged"] == 10 and summary["resume_line"] == 11


def test_a_broker_that_stays_down_exits_with_a_resume_hint_and_skip_resumes(
    broker: BrokerProcess,
) -> None:
    with broker.client() as client:
        client.create_stream("cli/down", segments=2)
        proc = produce_process(broker, "cli/down", "--delivery-timeout", "2")
        feed(proc, range(20))
        wait_for_events(client, "cli/down", 20)
        time.sleep(0.3)
    broker.kill()
    feed(proc, range(20, 25))
    code, _, err = finish(proc)
    assert code == 1, err
    match = re.search(r"--skip (\d+)", err)
    assert match, err
    skip = int(match.group(1))
    assert skip <= 20
    assert f"acknowledged {skip} of" in err

    broker.start()
    lines = "".join(f'{{"value": {i}}}\n' for i in range(25))
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "slipstream",
            "produce",
            "cli/down",
            "--skip",
            str(skip),
            "--json",
            "--broker",
            broker.address,
        ],
        input=lines,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["acknowledged"] == 25 - skip
    with broker.client() as client:
        end = client.tail("cli/down")
        with client.reader("cli/down", "earliest", end) as reader:
            values = sorted(int(event.value) for event in reader)
    # every line once, and the ones between the resume line and the kill twice (at least once)
    assert values == sorted([*range(25), *range(skip, 20)])


def test_a_large_event_sent_just_before_close_is_acknowledged(broker: BrokerProcess) -> None:
    """What ``produce`` does with one big line: send, then leave the block at once. The flush
    there must wait for the batch even while the network thread is still encoding it (it
    returned at once, and closing the client failed the batch, about 1 run in 3)."""
    with broker.client() as client:
        client.create_stream("cli/large")
    for attempt in range(16):
        with (
            broker.client() as client,
            client.producer("cli/large", batch_bytes=4 * 1024 * 1024) as producer,
        ):
            receipt = producer.send(b"x" * (3 * 1024 * 1024))
            time.sleep(attempt * 0.0005)  # close while the batch is being encoded, at some try
        assert receipt.done()
        receipt.result(0)  # acknowledged, not failed by the client's close
