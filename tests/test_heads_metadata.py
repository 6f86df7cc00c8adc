"""Tests for edged.heads.metadata: class names and the NMS-inside flag from untrusted ultralytics metadata."""

from __future__ import annotations

import os
from collections.abc import Mapping

import pytest

from edged.heads.metadata import parse_names, says_nms_inside
from edged.heads.registry import detect_head


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        # Ultralytics dict literal.
        ({"names": "{0: 'person', 1: 'car'}"}, ["person", "car"]),
        # Older exports: a list.
        ({"names": "['person', 'car']"}, ["person", "car"]),
        # JSON writers: string keys.
        ({"names": '{"0": "person", "1": "car"}'}, ["person", "car"]),
        # Keys out of order are fine.
        ({"names": "{1: 'car', 0: 'person'}"}, ["person", "car"]),
        # Absent, empty.
        ({}, None),
        ({"names": ""}, None),
        ({"names": "{}"}, None),
        # Gaps or ids not starting at 0 cannot be indexed by class id.
        ({"names": "{0: 'a', 2: 'c'}"}, None),
        ({"names": "{1: 'a'}"}, None),
        # Non-string names, bool keys, duplicate ids, a bare string, broken syntax.
        ({"names": "{0: 1}"}, None),
        ({"names": "{True: 'a'}"}, None),
        ({"names": "{0: 'a', '0': 'b'}"}, None),
        ({"names": "'person'"}, None),
        ({"names": "{0: 'person'"}, None),
        # A name that is not text (a lone surrogate: no UTF-8 message or file can hold it), or of
        # several lines (one line each in classes.txt, where it would shift every later class id).
        ({"names": "{0: 'ok', 1: '\\udc80'}"}, None),
        ({"names": "{0: 'ok', 1: 'two\\nlines'}"}, None),
        ({"names": "['ok', 'cr\\r']"}, None),
        # Pathological nesting and size.
        ({"names": "[" * 100_000}, None),
        ({"names": "['a'," + " 'a'," * 300_000 + "]"}, None),
    ],
)
def test_parse_names(metadata: Mapping[str, str], expected: list[str] | None) -> None:
    assert parse_names(metadata) == expected


@pytest.mark.parametrize(
    "payload",
    [
        "__import__('os').environ.__setitem__('EDGED_PWNED', '1')",
        "{0: __import__('os').environ.__setitem__('EDGED_PWNED', '1')}",
        "[(lambda: __import__('os').environ.__setitem__('EDGED_PWNED', '1'))()]",
    ],
)
def test_parse_names_never_executes(payload: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EDGED_PWNED", raising=False)
    assert parse_names({"names": payload}) is None
    assert detect_head([[1, 84, 8400]], {"names": payload, "args": payload}) == ("yolov8", 80)
    assert "EDGED_PWNED" not in os.environ


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        # YOLOv10-style flag, as ultralytics writes it, and as other writers might.
        ({"end2end": "True"}, True),
        ({"end2end": " true "}, True),
        ({"end2end": "1"}, True),
        # nms=True in the export arguments.
        ({"args": "{'batch': 1, 'nms': True}"}, True),
        # A false flag is no flag.
        ({"end2end": "False"}, False),
        ({"args": "{'batch': 1, 'nms': False}"}, False),
        # Absent, truthy but not True, malformed.
        ({}, False),
        ({"args": "{'nms': 1}"}, False),
        ({"args": "{'nms': True"}, False),
        ({"args": "['nms']"}, False),
    ],
)
def test_says_nms_inside(metadata: Mapping[str, str], expected: bool) -> None:
    assert says_nms_inside(metadata) is expected
