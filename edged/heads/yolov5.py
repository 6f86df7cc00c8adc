"""The yolov5 head: the original yolov5 repository's export, [1, N, 5+nc] with objectness."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edged.errors import HeadError
from edged.heads.base import DenseHead, OutputFacts, cxcywh_to_xyxy, fmt_classes, fmt_shape, rows


class YoloV5Head(DenseHead, candidate_axis=1, box_columns=5):
    """Columns cx cy w h objectness, then one probability per class; score = objectness x best probability."""

    name = "yolov5"

    @classmethod
    def matches(cls, facts: OutputFacts) -> int | None:
        """Candidates as rows of 6 or more columns, unless 6 columns cannot be one class here."""
        features = facts.features
        if not facts.candidates_in_rows or features < 6 or (features == 6 and cls.rules_out_one_class(facts)):
            return None
        if facts.n_names is not None and features - 5 != facts.n_names:
            raise HeadError(
                f"output {fmt_shape(facts.shape)} would be a yolov5 head with {fmt_classes(features - 5)}, "
                f"but metadata names {fmt_classes(facts.n_names)} (expected [1, N, {5 + facts.n_names}])"
            )
        return features - 5

    @staticmethod
    def rules_out_one_class(facts: OutputFacts) -> bool:
        """Whether the metadata rules out a 1-class yolov5 head, whose [1, N, 6] is also the end2end layout.

        Names other than one rule it out, and so does a 'task' or RT-DETR 'head' key: the ultralytics
        package writes them and never exports this layout (the yolov5 repository writes names and
        stride only).
        """
        return facts.from_ultralytics or facts.rtdetr or (facts.n_names is not None and facts.n_names != 1)

    def __init__(self, output_shape: Sequence[int], num_classes: int, conf: float) -> None:
        super().__init__(output_shape, num_classes, conf)
        _, n, features = self.output_shape
        self._gathered = np.empty(n * features, dtype=np.float32)
        self._class_scores = np.empty(n * num_classes, dtype=np.float32)
        self._half = np.empty(2 * n, dtype=np.float32)

    def select(self, pred: np.ndarray) -> int:
        """(N, 5+nc) -> the k candidates with objectness above conf.

        As the yolov5 repository does it: objectness above conf is the first filter; each class
        probability is multiplied by the objectness and the best product (the first on a tie) is
        the score and class, which decode holds to conf.
        """
        np.greater(pred[:, 4], self._conf, out=self._passed)
        index = self._index_of(self._passed)
        k: int = index.shape[0]
        candidates = rows(self._gathered, k, pred.shape[1])
        np.take(pred, index, axis=0, out=candidates, mode="clip")
        products = rows(self._class_scores, k, self.num_classes)
        np.multiply(candidates[:, 5:], candidates[:, 4:5], out=products)
        np.max(products, axis=1, out=self.scores[:k])
        np.argmax(products, axis=1, out=self.class_ids[:k])
        boxes = rows(self.boxes, 4, k)
        np.copyto(boxes, candidates[:, :4].T)
        cxcywh_to_xyxy(boxes, rows(self._half, 2, k))
        return k
