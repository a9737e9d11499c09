"""SeaweedFS as slipstream.devservers starts it serves as many buckets as the suite makes.

Each bucket is a collection of its own, and the master grew 7 volumes for each one: its volume
slots (free disk / the 64 MB volume size limit) ran out after about a hundred buckets, and every
upload after that failed with a 500 InternalError (a whole test run makes a bucket per test).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from objectstores import SeaweedFS


@pytest.fixture
def fresh(tmp_path: Path) -> Iterator[SeaweedFS]:
    server = SeaweedFS(tmp_path / "weed")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_a_bucket_takes_one_volume_slot_so_hundreds_of_buckets_take_uploads(
    fresh: SeaweedFS,
) -> None:
    status_url = f"http://127.0.0.1:{fresh.ports['master']}/dir/status"
    with urllib.request.urlopen(status_url) as answer:
        slots = json.load(answer)["Topology"]["Max"]
    client = fresh.client()
    # enough buckets that 7 volumes each would have used up every slot
    for i in range(slots // 7 + 5):
        bucket = fresh.create_bucket()
        client.put_object(Bucket=bucket, Key="k", Body=b"%d" % i)
