"""The happy path of the public API against a real broker process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from conftest import BrokerProcess, chunk_files

import slipstream


def test_produce_then_read_back_in_order(client: slipstream.Client) -> None:
    client.create_stream("demo/orders", segments=4)
    with client.producer("demo/orders") as producer:
        receipts = [producer.send(f"v{i}".encode(), key=f"user-{i % 7}") for i in range(500)]
    positions = [r.result() for r in receipts]
    end = client.tail("demo/orders")
    events = list(client.reader("demo/orders", start="earliest", end=end))
    assert len(events) == 500
    by_position = {(e.segment, e.offset): e for e in events}
    for i, position in enumerate(positions):
        event = by_position[(position.segment, position.offset)]
        assert event.value == f"v{i}".encode()
        assert event.key == f"user-{i % 7}".encode()


def test_the_client_never_imports_pandas(broker: BrokerProcess) -> None:
    # pyarrow imports pandas (0.2 s and tens of MB) the first time some numpy paths run; a
    # client that touched them paid it in the middle of its first bulk send or read
    script = textwrap.dedent(
        f"""
        import sys
        import numpy as np
        import slipstream
        with slipstream.connect("{broker.address}") as client:
            client.create_stream("smoke/np", segments=2)
            with client.producer("smoke/np") as producer:
                producer.send(b"one", key="k")
                producer.send_many([b"x"] * 100)
                producer.send_many([b"y"] * 100, keys=[str(i) for i in range(100)])
                producer.send_many([b"z"] * 10, timestamps=np.arange(10, dtype=np.int64))
                producer.send_many([b"w" * 1024] * 200)  # sent by reference (>= 64 KiB)
            end = client.tail("smoke/np")
            events = list(client.reader("smoke/np", end=end))
            rows = sum(b.num_rows for b in client.reader("smoke/np", end=end).batches())
            client.cut("smoke/np", "2020-01-01T00:00:00Z")
        assert len(events) == rows == 411, (len(events), rows)
        assert "pandas" not in sys.modules, "the client imported pandas"
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()


def test_large_batches_read_back_from_chunk_files_whole_and_bounded(
    broker_factory: type[BrokerProcess],
) -> None:
    # several large batches per read from chunk files, a consumer that falls behind (a full
    # socket), and cuts in the middle of a batch
    broker = broker_factory("--roll", "1MiB", "--roll-seconds", "0.2").start()
    expected = [f"{i:06d}".encode().ljust(1024, b"~") for i in range(8000)]
    with broker.client() as client:
        client.create_stream("smoke/big", segments=1)
        with client.producer("smoke/big") as producer:
            for start in range(0, len(expected), 100):  # 80 batches of 100 KiB
                producer.send_many(expected[start : start + 100])
                producer.flush()
        for _ in range(100):
            if len(chunk_files(broker.data_dir, "smoke/big")) >= 6:
                break
            time.sleep(0.1)
        end = client.tail("smoke/big")
        got: list[bytes] = []
        for batch in client.reader("smoke/big", start="earliest", end=end).batches():
            if not got:
                time.sleep(0.5)  # let the broker run into a full socket
            got += batch.column("value").to_pylist()
        assert got == expected
        middle = slipstream.StreamCut("smoke/big", {0: 4321})
        bounded = [e.value for e in client.reader("smoke/big", start="earliest", end=middle)]
        assert bounded == expected[:4321]
        rest = [e.value for e in client.reader("smoke/big", start=middle, end=end)]
        assert rest == expected[4321:]
