"""Classify: a classifier's output, [1, nc] class probabilities, as the frame's ranked classes.

The classification counterpart of `edged.decode`: ultralytics' ``probs.top5`` for a frame, the
``top_k`` best classes, best first (the first of equal scores first). A value that is no probability
(NaN, infinite, outside 0..1) means a model broken or fed wrongly, or an export without its softmax
(raw logits): it is counted, as decode counts such values, and the frame ranks no class at all, so
``[inspect]`` judges it 'uncertain', never OK. Ranking the classes that happen to lie in 0..1 would
judge a part on a class the model did not pick: logits [0.5, 3.0, -2.0] would read as the first
class, 0.50, although the second is the strongest. Everything a frame needs is allocated with the
classifier, so ranking creates no arrays.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edged.errors import HeadError
from edged.geometry import BoxMap
from edged.heads.base import fmt_shape
from edged.messages import TopClass
from edged.task import output_problems

log = logging.getLogger(__name__)

_ZERO = np.array(0.0, dtype=np.float32)  # 0-d operands: a Python float costs numpy an array per call
_ONE = np.array(1.0, dtype=np.float32)
_NEG_INF = np.array(-np.inf, dtype=np.float32)


@dataclass(frozen=True, slots=True, eq=False)
class Classes:
    """One frame's classes: ``class_ids`` (k,) and ``scores`` (k,) float32 of the best ones, best
    first; views of the classifier's buffers, valid until its next frame. Empty when any output value
    was no probability: ``scores_above_one`` (above 1 or below 0) and ``nonfinite`` count them."""

    class_ids: np.ndarray
    scores: np.ndarray
    scores_above_one: int = 0
    nonfinite: int = 0

    def __len__(self) -> int:
        return int(self.scores.shape[0])

    @property
    def top(self) -> tuple[int, float] | None:
        """The best class and its score; None when the model's output was no probabilities."""
        return (int(self.class_ids[0]), float(self.scores[0])) if len(self) else None

    # ---- as the classification task's result (`edged.task.TaskResult`) --------------------------

    def problems(self) -> list[tuple[str, int]]:
        return output_problems(self.nonfinite, self.scores_above_one)

    def near_misses(self) -> int:
        return 0  # a classifier's doubt is its top score below inspect.min_confidence: the verdict 'uncertain'

    def dataset_label(self, width: int, height: int) -> str:
        return ""  # no label file: the image is filed under its class (`dataset_class`)

    def dataset_class(self) -> int | None:
        """The best class: an ultralytics classification dataset files the image in its folder."""
        top = self.top
        return None if top is None else top[0]

    def heatmap(self) -> None:
        return None

    def message_fields(
        self,
        label: Callable[[int], str],
        zones: Sequence[str | None] | None,
        thresholds: Sequence[float | None] | None,
        *,
        notes: Sequence[str | None] | None = None,
        mm_per_px: float | None = None,
    ) -> dict[str, Any]:
        """``task``, ``top`` and no ``detections``."""
        return {
            "task": "classify",
            "detections": [],
            "top": [
                TopClass(class_id=c, label=label(c), score=round(s, 4))
                for c, s in zip(self.class_ids.tolist(), self.scores.tolist(), strict=True)
            ],
        }


class Classifier:
    """Ranks one classifier's output of a fixed shape; reuse it for every frame."""

    def __init__(self, output_shape: Sequence[int], num_classes: int, top_k: int) -> None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.output_shape = tuple(int(d) for d in output_shape)
        if self.output_shape != (1, num_classes):
            raise HeadError(
                f"a classifier of {num_classes} classes expects output [1, {num_classes}], got {fmt_shape(output_shape)}"
            )
        self._k = min(top_k, num_classes)
        self._ranked = np.empty(num_classes, dtype=np.float32)  # what is left to rank
        self._check = np.empty(num_classes, dtype=np.bool_)
        self._below = np.empty(num_classes, dtype=np.bool_)
        self._finite = np.empty(num_classes, dtype=np.bool_)
        self._best = np.empty((), dtype=np.intp)
        self._ids = np.empty(self._k, dtype=np.int32)
        self._scores = np.empty(self._k, dtype=np.float32)
        self._told_softmax = False  # the hint to export with a softmax, logged once per classifier

    def decode(self, output: np.ndarray, box_map: BoxMap) -> Classes:
        """The ``top_k`` probabilities, best first, or none when any value is no probability; raises
        `HeadError` only for an output that is not a float array of the planned shape."""
        if not isinstance(output, np.ndarray) or output.shape != self.output_shape or output.dtype.kind != "f":
            got = f"{output.dtype} {fmt_shape(output.shape)}" if isinstance(output, np.ndarray) else type(output).__name__
            raise HeadError(f"expected a float output {fmt_shape(self.output_shape)}, got {got}")
        ranked, check, below, finite = self._ranked, self._check, self._below, self._finite
        with np.errstate(invalid="ignore"):
            np.copyto(ranked, output[0], casting="same_kind")
            np.isfinite(ranked, out=finite)
            nonfinite = finite.shape[0] - int(np.count_nonzero(finite))
            np.greater(ranked, _ONE, out=check)
            np.less(ranked, _ZERO, out=below)
            np.logical_or(check, below, out=check)
            np.logical_and(check, finite, out=check)
            above = int(np.count_nonzero(check))
        if nonfinite or above:
            if above and not self._told_softmax:
                self._told_softmax = True
                log.error(
                    "the classifier output %d value(s) outside 0..1: its outputs must be probabilities, so its "
                    "frames rank no class and their verdict is uncertain; export the classifier with its softmax "
                    "(ultralytics' -cls exports include it), and check model.scale, mean and std against how it "
                    "was trained",
                    above,
                )
            return Classes(self._ids[:0], self._scores[:0], above, nonfinite)
        for i in range(self._k):
            best = int(np.argmax(ranked, out=self._best))  # into a buffer: argmax alone makes one
            self._ids[i], self._scores[i] = best, ranked[best]
            ranked[best] = _NEG_INF
        return Classes(self._ids, self._scores)
