"""Fuzz the batch decoders over mutated real batches, alone and back to back.

Invariants: ``decode_header``, ``verify``, ``iter_batches`` and a reader's whole path (Arrow
body, schema, events) raise only ``CorruptBatch``; a batch that passes its CRC32C is one that
was sent (only the base offset, which the CRC leaves out for the broker to patch, may differ);
batches wholly before the first damaged byte still split off intact. A hostile producer can
also send a damaged body under a CRC computed over it: the body decoder is then the only guard,
and must refuse it or return events that decode. tests/format/test_batch.py covers single
batches with random overwrites and every single-bit flip of one small body.
"""

from __future__ import annotations

import contextlib
import struct

import crc32c
from fuzz_inputs import Mutated, mutated, read_like_a_client, real_batches
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream import CorruptBatch
from slipstream.format import HEADER_LENGTH, decode_header, iter_batches, verify

_BASE_OFFSET = slice(8, 16)  # outside the CRC: the broker patches it in place


def without_base_offset(batch: bytes | memoryview) -> bytes:
    data = bytes(batch)
    return data[: _BASE_OFFSET.start] + data[_BASE_OFFSET.stop :]


@st.composite
def payloads(draw: st.DrawFn) -> list[bytes]:
    """One to four real batches, as a Data payload or a journal file holds them."""
    return draw(st.lists(st.sampled_from(real_batches()), min_size=1, max_size=4))


@settings(max_examples=300, deadline=None)
@given(batches=payloads(), data=st.data())
def test_mutated_batches_split_or_raise_corrupt_batch_and_never_pass_damaged(
    batches: list[bytes], data: st.DataObject
) -> None:
    original = b"".join(batches)
    damaged: Mutated = data.draw(mutated(original), label="damaged")
    sent = {without_base_offset(b) for b in batches}

    split: list[bytes] = []
    with contextlib.suppress(CorruptBatch):
        for header, view in iter_batches(damaged.data):
            assert header.batch_length == len(view)
            assert without_base_offset(view) in sent, "a damaged batch passed its CRC32C"
            split.append(bytes(view))
    ends = [sum(map(len, batches[: i + 1])) for i in range(len(batches))]
    intact = sum(end <= damaged.intact for end in ends)
    assert split[:intact] == batches[:intact], "a batch before the damage was lost"

    with contextlib.suppress(CorruptBatch):
        for _ in iter_batches(damaged.data, check_crc=False):
            pass
    for at in {0, *ends[:-1], damaged.intact}:
        with contextlib.suppress(CorruptBatch):
            decode_header(damaged.data, at)
        with contextlib.suppress(CorruptBatch):
            header = verify(damaged.data, at)
            piece = damaged.data[at : at + header.batch_length]
            assert without_base_offset(piece) in sent, "a damaged batch passed its CRC32C"
    with contextlib.suppress(CorruptBatch):
        read_like_a_client(damaged.data)


def restamped(head: bytes, body: bytes) -> bytes:
    """``head`` over ``body`` with batch length and CRC32C made to match, as a buggy or
    hostile producer would send a body it damaged itself."""
    batch = bytearray(head[:HEADER_LENGTH] + body)
    struct.pack_into("<I", batch, 16, len(batch))
    struct.pack_into("<I", batch, 20, crc32c.crc32c(memoryview(batch)[24:]))
    return bytes(batch)


@settings(max_examples=300, deadline=None)
@given(batch=st.sampled_from(real_batches()), data=st.data())
def test_a_damaged_body_under_a_valid_crc_is_refused_or_decodes_to_events(
    batch: bytes, data: st.DataObject
) -> None:
    body = data.draw(mutated(batch[HEADER_LENGTH:]), label="body")
    hostile = restamped(batch, body.data)
    verify(hostile)  # it passes the CRC: only the body decoder stands between it and readers
    with contextlib.suppress(CorruptBatch):
        read_like_a_client(hostile)


def test_the_real_batches_read_back_whole() -> None:
    for batch in real_batches():
        assert read_like_a_client(batch) == decode_header(batch).event_count > 0
        assert read_like_a_client(restamped(batch, batch[HEADER_LENGTH:])) > 0
