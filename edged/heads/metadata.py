"""Ultralytics metadata as head detection reads it: the class names, the NMS-inside flag and RT-DETR's head.

Every value comes from an untrusted model file and is a Python literal written by the exporter,
so it is parsed with ``ast.literal_eval`` (never executed) and anything malformed reads as absent.
"""

from __future__ import annotations

import ast
import unicodedata
from collections.abc import Mapping

from edged.messages import first_refused
from edged.settings.numerals import INDEX_DIGITS, whole_number

_MAX_LITERAL_CHARS = 1_000_000
_BIDI_CONTROLS = frozenset(map(chr, (*range(0x202A, 0x202F), *range(0x2066, 0x206A))))
_NOT_IN_A_NAME = {
    "Cc": "a control character",
    "Cs": "a lone surrogate",
    "Zl": "a line separator",
    "Zp": "a paragraph separator",
}


def parse_names(metadata: Mapping[str, str]) -> list[str] | None:
    """Class names indexed by class id from ultralytics' ``names`` metadata; None if unusable.

    The value is ``"{0: 'person', 1: 'car'}"``, or a list from older exports. Ids must be
    exactly 0..n-1 so that a class id can index the list.
    """
    value = _literal(metadata.get("names"))
    if isinstance(value, dict):
        value = _names_from_dict(value)
    if not isinstance(value, (list, tuple)) or not value:
        return None
    names = [name for name in value if isinstance(name, str) and name_problem(name) is None]
    return names if len(names) == len(value) else None


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a class's name (``U+001B at character 3 is a control character``), or None.

    A name is published, logged, printed by ``edged check`` and written as one line of ``classes.txt``:
    an escape rewrites the terminal that shows it and makes journalctl show its whole line as blob
    data, a bidirectional control reorders the text around it, a line break shifts every later class
    id in a labelling tool, and a lone surrogate has no UTF-8. Other format characters stay: emoji and
    Persian names need their joiners.
    """
    return first_refused(name, _not_in_a_name)


def _not_in_a_name(c: str) -> str | None:
    return "a bidirectional control" if c in _BIDI_CONTROLS else _NOT_IN_A_NAME.get(unicodedata.category(c))


def says_nms_inside(metadata: Mapping[str, str]) -> bool:
    """Whether the metadata says the model already ran NMS (``end2end`` or ``nms=True`` in ``args``)."""
    if str(metadata.get("end2end", "")).strip().lower() in ("true", "1"):
        return True
    args = _literal(metadata.get("args"))
    return isinstance(args, dict) and args.get("nms") is True


def says_rtdetr(metadata: Mapping[str, str]) -> bool:
    """Whether the ``head`` metadata names ultralytics' RT-DETR decoder, as ultralytics itself tells it."""
    return "RTDETR" in str(metadata.get("head", ""))


def _names_from_dict(value: dict[object, object]) -> list[object] | None:
    """{0: 'a', 1: 'b'} (int or digit-string keys, as JSON writers emit) -> ['a', 'b']."""
    by_id: dict[int, object] = {}
    for key, name in value.items():
        if isinstance(key, str) and (number := whole_number(key, INDEX_DIGITS)) is not None:
            key = number
        if not isinstance(key, int) or isinstance(key, bool):
            return None
        by_id[key] = name
    if sorted(by_id) != list(range(len(value))):
        return None
    return [by_id[i] for i in range(len(by_id))]


def _literal(text: object) -> object:
    """A Python literal parsed without executing anything; None when absent or malformed."""
    if not isinstance(text, str) or len(text) > _MAX_LITERAL_CHARS:
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
