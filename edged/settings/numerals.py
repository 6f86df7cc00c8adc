"""Whole numbers written in text from outside: a model's metadata, a configuration's keys, a device's name."""

from __future__ import annotations

INDEX_DIGITS = 9  # a class id, a video device's number: none reaches a billion


def whole_number(text: str, max_digits: int) -> int | None:
    """``text`` as a number when it is ASCII digits alone, at most ``max_digits`` of them; else None.

    ``str.isdigit`` also takes ``²`` and other digits `int` refuses, and `int` refuses more than 4300
    digits: text checked by either alone raised where it was read.
    """
    return int(text) if text.isascii() and text.isdigit() and len(text) <= max_digits else None
