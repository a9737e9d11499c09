"""Typed errors and their wire codes (slipstream/_errors.py).

The contract under test: every error class has a code of its own; ``error_from_wire`` turns
``(code, message, details)`` back into the same class with the same message and details, also
after a trip through a protocol ``Error`` frame; an unknown code becomes the base class.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import slipstream
from slipstream import SlipstreamError, errors
from slipstream._errors import ERRORS_BY_CODE, error_from_wire
from slipstream.protocol import Error, Frame, FrameDecoder, frame_bytes


def all_error_classes() -> list[type[SlipstreamError]]:
    """Every subclass of SlipstreamError that exists now, wherever it was defined."""
    found: list[type[SlipstreamError]] = []
    pending = [SlipstreamError]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


ERROR_CLASSES = sorted(ERRORS_BY_CODE.values(), key=lambda cls: cls.code)
CODES = [cls.code for cls in ERROR_CLASSES]

DETAILS = st.dictionaries(
    st.text(max_size=10).filter(lambda key: key != "message"),
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=10),
    max_size=3,
)


def test_every_error_class_has_a_code_of_its_own() -> None:
    classes = all_error_classes()
    assert len({cls.code for cls in classes}) == len(classes)
    assert set(ERRORS_BY_CODE.values()) == set(classes)
    assert all(ERRORS_BY_CODE[cls.code] is cls for cls in classes)


def test_every_error_class_is_public() -> None:
    for cls in all_error_classes():
        assert getattr(slipstream, cls.__name__) is cls
        assert cls.__name__ in slipstream.__all__
        assert getattr(errors, cls.__name__) is cls


@pytest.mark.parametrize("code", CODES)
def test_error_from_wire_rebuilds_the_same_class(code: str) -> None:
    cls = ERRORS_BY_CODE[code]
    sent = cls("what went wrong", stream="demo/orders", offset=12)
    rebuilt = error_from_wire(sent.code, sent.message, sent.details)
    assert type(rebuilt) is cls
    assert rebuilt.code == code
    assert rebuilt.message == str(rebuilt) == "what went wrong"
    assert rebuilt.details == {"stream": "demo/orders", "offset": 12}
    assert rebuilt.retriable is cls.retriable


@settings(max_examples=100)
@given(
    cls=st.sampled_from(ERROR_CLASSES),
    message=st.text(max_size=30),
    details=DETAILS,
    correlation_id=st.integers(0, 2**32 - 1),
)
def test_errors_round_trip_through_an_error_frame(
    cls: type[SlipstreamError], message: str, details: dict[str, Any], correlation_id: int
) -> None:
    sent = cls(message, **details)
    wire = frame_bytes(Error(sent.code, sent.message, sent.details), correlation_id)
    decoder = FrameDecoder()
    decoder.feed(b"".join(wire))
    frame = decoder.next_item()
    assert isinstance(frame, Frame)
    assert isinstance(frame.message, Error)
    rebuilt = error_from_wire(frame.message.code, frame.message.message, frame.message.details)
    assert type(rebuilt) is cls
    assert (rebuilt.message, rebuilt.details) == (message, details)


def test_an_unknown_code_becomes_the_base_class() -> None:
    rebuilt = error_from_wire("from_a_newer_broker", "something new", {"hint": "upgrade"})
    assert type(rebuilt) is SlipstreamError
    assert rebuilt.message == "something new"
    assert rebuilt.details == {"hint": "upgrade"}


def test_error_hierarchy_and_retriable_flags() -> None:
    assert issubclass(slipstream.UnsupportedVersion, slipstream.ProtocolError)
    assert all(issubclass(cls, Exception) for cls in ERROR_CLASSES)
    assert {cls for cls in ERROR_CLASSES if cls.retriable} == {
        slipstream.StorageFull,
        slipstream.StorageError,
        slipstream.BrokerUnavailable,
        slipstream.BrokerShuttingDown,
        slipstream.LeaseLost,
        slipstream.TooManyRequests,
        slipstream.UnknownMember,
    }
    assert SlipstreamError.code == "internal"


def test_except_by_class_works_after_the_wire() -> None:
    with pytest.raises(slipstream.ProtocolError):  # a subclass is caught by its parent
        raise error_from_wire("unsupported_version", "speak v1", {})
    with pytest.raises(slipstream.StreamNotFound, match="no such stream"):
        raise error_from_wire("stream_not_found", "no such stream", {"stream": "a/b"})
