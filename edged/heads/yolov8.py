"""The yolov8 head: ultralytics v8, v11 and v5u exports, [1, 4+nc, N] with candidates as columns."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edged.errors import HeadError
from edged.heads.base import DenseHead, OutputFacts, cxcywh_to_xyxy, fmt_classes, fmt_shape, rows


class YoloV8Head(DenseHead, candidate_axis=2, box_columns=4):
    """Rows cx cy w h, then one score per class; a candidate's score is its best class score."""

    name = "yolov8"

    @classmethod
    def matches(cls, facts: OutputFacts) -> int | None:
        """The only layout with candidates as columns, so such an output is this head or none (a
        segmentation model's, beside its prototypes, is `edged.heads.segment`'s)."""
        if facts.candidates_in_rows or facts.prototypes:
            return None
        shown, features = fmt_shape(facts.shape), facts.features
        if features < 5:
            raise HeadError(f"output {shown} has {features} rows; a yolov8 head [1, 4+nc, N] needs >= 5")
        if facts.n_names is not None and features - 4 != facts.n_names:
            raise HeadError(
                f"output {shown} is a yolov8 head with {fmt_classes(features - 4)}, "
                f"but metadata names {fmt_classes(facts.n_names)} (expected [1, {4 + facts.n_names}, N])"
            )
        return features - 4

    def __init__(self, output_shape: Sequence[int], num_classes: int, conf: float) -> None:
        super().__init__(output_shape, num_classes, conf)
        _, features, n = self.output_shape
        self._best_scores = np.empty(n, dtype=np.float32)
        self._gathered = np.empty(features * n, dtype=np.float32)
        self._class_scores = np.empty(n * num_classes, dtype=np.float32)
        self._half = np.empty(2 * n, dtype=np.float32)
        self.selected = self._index_of(np.zeros(0, dtype=np.bool_))  # the last frame's candidates' columns

    def select(self, pred: np.ndarray) -> int:
        """(4+nc, N) -> the k candidates whose best class score is above conf, as ultralytics keeps them."""
        nc = self.num_classes
        scores = pred[4 : 4 + nc]
        np.max(scores, axis=0, out=self._best_scores)
        np.greater(self._best_scores, self._conf, out=self._passed)
        index = self.selected = self._index_of(self._passed)
        k: int = index.shape[0]
        boxes = rows(self.boxes, 4, k)
        np.take(pred[:4], index, axis=1, out=boxes, mode="clip")
        cxcywh_to_xyxy(boxes, rows(self._half, 2, k))
        np.take(self._best_scores, index, out=self.scores[:k], mode="clip")
        by_class = rows(self._gathered, nc, k)
        np.take(scores, index, axis=1, out=by_class, mode="clip")
        by_candidate = rows(self._class_scores, k, nc)
        np.copyto(by_candidate, by_class.T)  # argmax along a contiguous axis allocates nothing
        np.argmax(by_candidate, axis=1, out=self.class_ids[:k])
        return k
