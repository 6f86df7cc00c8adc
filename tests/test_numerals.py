"""Tests for edged.settings.numerals: whole numbers in text from outside, and the readers that take them."""

from __future__ import annotations

import pytest

from edged.heads.metadata import parse_names
from edged.settings.http import listen_address
from edged.settings.numerals import whole_number


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "digits", "number"),
    [
        ("0", 1, 0),
        ("0042", 4, 42),
        ("12345", 4, None),  # more digits than asked for
        ("", 3, None),
        ("²", 3, None),  # isdigit takes it, int refuses it
        ("١٢", 3, None),  # Arabic-Indic digits: int takes them, no configuration means them
        ("+1", 3, None),
        (" 1", 3, None),
        ("1" * 5000, 5000, None),  # past the 4300 digits int reads: refused, not raised
    ],
)
def test_whole_number_is_ascii_digits_alone_of_at_most_the_digits_asked(text: str, digits: int, number: int | None) -> None:
    assert whole_number(text, min(digits, 4300)) == number


@pytest.mark.unit
def test_text_past_what_int_reads_is_refused_where_it_is_read_not_raised() -> None:
    """A model's names keyed by a 5000-digit id raised ValueError from `int` at load."""
    assert parse_names({"names": f"{{'{'1' * 5000}': 'a'}}"}) is None
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        listen_address("127.0.0.1:" + "9" * 5000)
