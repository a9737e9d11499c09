"""Stream names (slipstream/streams/_names.py): ``scope/name``, each part starting with a
lowercase letter or a digit and going on with ``[a-z0-9._-]``, at most 255 characters in all.
Anything else raises InvalidName."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream import InvalidName
from slipstream.streams import MAX_NAME_LENGTH, validate_scope, validate_stream_name

FIRST_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
PART_ALPHABET = FIRST_ALPHABET + "._-"
parts = st.builds(str.__add__, st.sampled_from(FIRST_ALPHABET), st.text(PART_ALPHABET, max_size=39))


@pytest.mark.parametrize(
    "name",
    [
        "demo/orders",
        "a/b",
        "0/9",
        "my-scope/orders.v2_eu",
        "a..b/c",
        "a-/b_",  # '-', '.' and '_' anywhere but first
        "0-x/9.y",
        "s" * 127 + "/" + "n" * 127,  # 255 characters, the limit
        "s/" + "n" * (MAX_NAME_LENGTH - 2),
    ],
)
def test_valid_stream_names_split_into_scope_and_name(name: str) -> None:
    scope, stream = validate_stream_name(name)
    assert f"{scope}/{stream}" == name


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("s" * 128 + "/" + "n" * 127, "256 characters; the limit is 255"),
        ("s/" + "n" * 300, "limit is 255"),
        ("Demo/orders", "lowercase"),
        ("demo/Orders", "lowercase"),
        ("orders", "must be 'scope/name'"),
        ("", "must be 'scope/name'"),
        ("a/b/c", "must be 'scope/name'"),
        ("/orders", "non-empty"),
        ("demo/", "non-empty"),
        ("/", "non-empty"),
        ("../orders", "start with a lowercase letter or a digit"),
        ("demo/..", "start with a lowercase letter or a digit"),
        ("./orders", "start with a lowercase letter or a digit"),
        ("demo/.", "start with a lowercase letter or a digit"),
        ("-x/y", "start with a lowercase letter or a digit"),
        ("demo/-orders", "start with a lowercase letter or a digit"),
        ("--help/x", "start with a lowercase letter or a digit"),
        (".../x", "start with a lowercase letter or a digit"),
        ("_x/y", "start with a lowercase letter or a digit"),
        ("demo/.hidden", "start with a lowercase letter or a digit"),
        ("demo/my orders", "lowercase"),
        ("demo/orders\n", "lowercase"),
        ("d\u00e9mo/orders", "lowercase"),
        ("demo\\x/orders", "lowercase"),
        ("demo/or:ders", "lowercase"),
    ],
)
def test_invalid_stream_names_raise_invalid_name(name: str, reason: str) -> None:
    with pytest.raises(InvalidName, match=reason):
        validate_stream_name(name)


def test_a_stream_name_must_be_a_string() -> None:
    with pytest.raises(InvalidName, match="must be a string, got bytes"):
        validate_stream_name(b"demo/orders")  # type: ignore[arg-type]


def test_invalid_name_carries_the_name_in_its_details() -> None:
    with pytest.raises(InvalidName) as caught:
        validate_stream_name("Demo/orders")
    assert caught.value.details == {"name": "Demo/orders"}
    with pytest.raises(InvalidName) as caught:
        validate_stream_name("x" * 1000)
    assert caught.value.details == {"name": "x" * 64}  # long names are cut in the details


@settings(max_examples=200)
@given(scope=parts, stream=parts)
def test_names_of_the_allowed_alphabet_are_valid_up_to_the_limit(scope: str, stream: str) -> None:
    name = f"{scope}/{stream}"
    if len(name) > MAX_NAME_LENGTH:
        with pytest.raises(InvalidName):
            validate_stream_name(name)
    else:
        assert validate_stream_name(name) == (scope, stream)


@settings(max_examples=200)
@given(
    scope=parts,
    stream=parts,
    bad=st.characters().filter(lambda c: c not in PART_ALPHABET),
    data=st.data(),
)
def test_any_character_outside_the_alphabet_is_refused(
    scope: str, stream: str, bad: str, data: st.DataObject
) -> None:
    name = f"{scope}/{stream}"
    at = data.draw(st.integers(0, len(name)), label="at")
    with pytest.raises(InvalidName):
        validate_stream_name(name[:at] + bad + name[at:])


@pytest.mark.parametrize("scope", ["demo", "a", "a.b-c_d", "9-x", "s" * (MAX_NAME_LENGTH - 2)])
def test_valid_scopes_are_returned(scope: str) -> None:
    assert validate_scope(scope) == scope


@pytest.mark.parametrize(
    "scope",
    [
        "",
        ".",
        "..",
        "..x",
        "-x",
        "_x",
        "Demo",
        "de/mo",
        "de mo",
        "s" * MAX_NAME_LENGTH,
        "d\u00e9mo",
    ],
)
def test_invalid_scopes_raise_invalid_name(scope: str) -> None:
    with pytest.raises(InvalidName):
        validate_scope(scope)
