"""What every head format shares: the `Head` interface, the facts detection reads, and shape helpers.

A head format is one layout of a detector's output: where the candidates, their boxes and their
scores sit. Each format is one `Head` subclass in its own module, listed in `edged.heads.HEADS`.
A head instance selects a frame's candidates into the buffers defined here; `edged.decode` then
maps, checks and suppresses them the same way for every format.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from edged.errors import HeadError

Dim = int | str | None

_HALF = np.array(0.5, dtype=np.float32)  # 0-d operands: a Python float costs numpy an array per call
_ONE_SLOT = np.array(1, dtype=np.intp)


@dataclass(frozen=True, slots=True)
class OutputFacts:
    """What head detection knows of a model: its one rank-3, batch-1 output and its metadata."""

    shape: tuple[Dim, ...]
    features: int  # the concrete dimension that does not count candidates
    candidates_in_rows: bool  # [1, N, C] rather than [1, C, N]
    n_names: int | None  # classes named by the 'names' metadata
    from_ultralytics: bool  # a 'task' key: only the ultralytics package writes one
    nms_inside: bool  # the metadata says the model already ran NMS
    rtdetr: bool  # the metadata names ultralytics' RT-DETR decoder as the model's head
    prototypes: bool = False  # a second output of mask prototypes [1, 32, H/4, W/4]: a segmentation model


class Head(ABC):
    """One head format, built for one concrete output shape and class count.

    The class recognises its format (`matches`); an instance selects a frame's candidates
    (`select`) into buffers sized here and in the subclass for the worst case of all N passing,
    so selection creates no arrays. The first k of `boxes` (flat (4, k) rows x1 y1 x2 y2 in input
    pixels), `scores` and `class_ids` are what decode maps, checks and suppresses.
    """

    name: ClassVar[str]
    layout: ClassVar[str]  # the output shape in error messages, e.g. "[1, 4+nc, N]"
    candidate_axis: ClassVar[int]  # the output axis that counts candidates
    needs_nms: ClassVar[bool] = True  # False for models that ran NMS themselves
    normalised: ClassVar[bool] = False  # boxes in fractions of the input size rather than input pixels
    resize: ClassVar[Literal["letterbox", "stretch"] | None] = None  # the preprocessing the format requires, if any

    @classmethod
    @abstractmethod
    def expected_shape(cls, num_classes: int) -> list[Dim]:
        """The output shape of this format with ``num_classes``; the candidate count by name."""

    @classmethod
    @abstractmethod
    def matches(cls, facts: OutputFacts) -> int | None:
        """The class count when ``facts`` are this format, None when they are not.

        Raises `HeadError` when the output can only be this format but does not add up (a class
        count the names contradict). Formats must not overlap: at most one matches any facts.
        """

    @staticmethod
    def named_classes(facts: OutputFacts, head: str) -> int:
        """The class count of a head whose rows carry a class id, not a score per class: the
        metadata's names say it (``head`` names the head in the error when they are missing)."""
        if facts.n_names is None:
            raise HeadError(f"output {fmt_shape(facts.shape)} is {head}, but 'names' metadata is missing")
        return facts.n_names

    @staticmethod
    def class_scores(output: np.ndarray) -> np.ndarray | None:
        """A writable (classes, candidates) view of the raw output's class scores; None where a box has
        one class already (formats that ran NMS themselves)."""
        return None

    def __init__(self, output_shape: Sequence[int], num_classes: int, conf: float) -> None:
        if num_classes < 1:
            raise HeadError(f"num_classes must be >= 1, got {num_classes}")
        shape = tuple(output_shape)
        if not all(concrete(d) is not None for d in shape):
            raise HeadError(f"decoder needs a concrete output shape, got {fmt_shape(shape)}")
        pattern = self.expected_shape(num_classes)
        if len(shape) != 3 or any(isinstance(e, int) and e != d for e, d in zip(pattern, shape, strict=True)):
            raise HeadError(
                f"{self.name} head with {fmt_classes(num_classes)} expects output {fmt_shape(pattern)}, "
                f"got {fmt_shape(shape)}"
            )
        self.output_shape = tuple(int(d) for d in shape)
        self.num_classes = num_classes
        n = self.output_shape[self.candidate_axis]
        self.capacity = n
        self.boxes = np.empty(4 * n, dtype=np.float32)  # flat, so that a [:4k] slice reshapes contiguously
        self.scores = np.empty(n, dtype=np.float32)
        self.class_ids = np.empty(n, dtype=np.intp)
        self._conf = np.array(conf, dtype=np.float32)
        self._passed = np.empty(n, dtype=np.bool_)
        self._index_of = TrueIndex(n)  # the passing candidates' positions

    @abstractmethod
    def select(self, pred: np.ndarray) -> int:
        """Fill the first k boxes, scores and class ids from ``pred`` (the float32 output without
        its batch axis) with the candidates worth checking; return k."""


class TrueIndex:
    """``np.flatnonzero`` for masks of up to ``capacity`` entries, into buffers made once.

    A running count gives each true entry its slot; every false one gets slot -1, the spare
    slot at the end. The result is a view of this object's buffer, valid until the next call.
    """

    def __init__(self, capacity: int) -> None:
        self._mask = np.empty(capacity, dtype=np.intp)  # one dtype: mixing bool in would allocate
        self._slot = np.empty(capacity, dtype=np.intp)
        self._arange = np.arange(capacity, dtype=np.intp)
        self._index = np.empty(capacity + 1, dtype=np.intp)

    def __call__(self, mask: np.ndarray) -> np.ndarray:
        """Ascending indices of the true entries of the boolean ``mask``."""
        n = mask.shape[0]
        if n == 0:
            return self._index[:0]
        passed, slot = self._mask[:n], self._slot[:n]
        np.copyto(passed, mask)
        np.add.accumulate(passed, out=slot)
        k = int(slot[-1])
        np.multiply(slot, passed, out=slot)
        np.subtract(slot, _ONE_SLOT, out=slot)
        self._index[slot] = self._arange[:n]
        return self._index[:k]


def cxcywh_to_xyxy(boxes: np.ndarray, half: np.ndarray) -> None:
    """(4, k) rows cx cy w h -> x1 y1 x2 y2 in place, as ultralytics computes them; ``half`` is (2, k) scratch."""
    np.multiply(boxes[2:], _HALF, out=half)
    np.add(boxes[:2], half, out=boxes[2:])
    np.subtract(boxes[:2], half, out=boxes[:2])


def rows(flat: np.ndarray, count: int, columns: int) -> np.ndarray:
    """A contiguous (count, columns) view of the start of a flat scratch buffer."""
    return flat[: count * columns].reshape(count, columns)


def concrete(d: Dim) -> int | None:
    """A concrete positive dimension, or None for a symbolic or nonsensical one."""
    if isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0:
        return int(d)
    return None


def fmt_classes(n: int) -> str:
    """``1 class`` or ``3 classes``: a count of classes as an error message says it."""
    return f"{n} class" if n == 1 else f"{n} classes"


def fmt_shape(shape: Sequence[Dim]) -> str:
    """[1, 84, 8400]-style text for error messages; symbolic dims by name, None as '?'."""
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


class DenseHead(Head):
    """A head with one candidate per row (or column): ``box_columns`` values (the box, and any
    objectness) then one score per class. A subclass names those two in its class line
    (``class H(DenseHead, candidate_axis=2, box_columns=4)``); its layout and expected shape follow."""

    box_columns: ClassVar[int]

    def __init_subclass__(cls, *, candidate_axis: int, box_columns: int, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.candidate_axis, cls.box_columns = candidate_axis, box_columns
        columns = f"{box_columns}+nc"
        cls.layout = f"[1, {columns}, N]" if candidate_axis == 2 else f"[1, N, {columns}]"

    @classmethod
    def expected_shape(cls, num_classes: int) -> list[Dim]:
        shape: list[Dim] = [1, "N", "N"]
        shape[3 - cls.candidate_axis] = cls.box_columns + num_classes
        return shape

    @classmethod
    def class_scores(cls, output: np.ndarray) -> np.ndarray:
        """The values after the box columns, as a writable (classes, candidates) view."""
        scores: np.ndarray = output[0, cls.box_columns :] if cls.candidate_axis == 2 else output[0, :, cls.box_columns :].T
        return scores
