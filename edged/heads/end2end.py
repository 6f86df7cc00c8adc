"""The end2end head: NMS inside the model (ultralytics nms=True exports, YOLOv10), [1, K, 6]."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edged.heads.base import Dim, Head, OutputFacts, rows
from edged.heads.yolov5 import YoloV5Head

_ZERO = np.array(0.0, dtype=np.float32)  # 0-d operands: a Python float costs numpy an array per call
_NEG_INF = np.array(-np.inf, dtype=np.float32)


class End2EndHead(Head):
    """Columns x1 y1 x2 y2 score class, already suppressed; the class count comes from the names."""

    name = "end2end"
    layout = "[1, K, 6]"
    candidate_axis = 1
    needs_nms = False

    @classmethod
    def expected_shape(cls, num_classes: int) -> list[Dim]:
        return [1, "K", 6]

    @classmethod
    def matches(cls, facts: OutputFacts) -> int | None:
        """Six columns as rows, when the metadata says NMS is inside or rules out a 1-class yolov5,
        and does not name RT-DETR's head (its boxes are other columns: `edged.heads.rtdetr`)."""
        if not facts.candidates_in_rows or facts.features != 6 or facts.rtdetr:
            return None
        if not (facts.nms_inside or YoloV5Head.rules_out_one_class(facts)):
            return None
        return cls.named_classes(facts, "an end2end head")

    def __init__(self, output_shape: Sequence[int], num_classes: int, conf: float) -> None:
        super().__init__(output_shape, num_classes, conf)
        k = self.capacity
        self._num_classes = np.array(num_classes, dtype=np.float32)
        self._gathered = np.empty(k * 6, dtype=np.float32)
        self._whole = np.empty(k, dtype=np.float32)
        self._valid = np.empty(k, dtype=np.bool_)
        self._check = np.empty(k, dtype=np.bool_)

    def select(self, pred: np.ndarray) -> int:
        """(K, 6) -> the k candidates with score above conf; a class that is not an integer in
        [0, nc) gets score -inf, which decode drops."""
        np.greater(pred[:, 4], self._conf, out=self._passed)
        index = self._index_of(self._passed)
        k: int = index.shape[0]
        candidates = rows(self._gathered, k, 6)
        np.take(pred, index, axis=0, out=candidates, mode="clip")
        np.copyto(rows(self.boxes, 4, k), candidates[:, :4].T)
        scores, cls, whole = self.scores[:k], candidates[:, 5], self._whole[:k]
        np.copyto(scores, candidates[:, 4])
        np.copyto(self.class_ids[:k], cls, casting="unsafe")  # garbage for a NaN class, dropped below
        valid, check = self._valid[:k], self._check[:k]
        np.greater_equal(cls, _ZERO, out=valid)
        np.less(cls, self._num_classes, out=check)
        np.logical_and(valid, check, out=valid)
        np.floor(cls, out=whole)
        np.equal(whole, cls, out=check)
        np.logical_and(valid, check, out=valid)
        np.logical_not(valid, out=check)
        np.copyto(scores, _NEG_INF, where=check)
        return k
