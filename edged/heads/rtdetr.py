"""The rtdetr head: ultralytics' RT-DETR export, [1, K, 6] of normalised boxes, NMS-free.

Its output has the end2end shape, but the boxes are centre, width and height as fractions of
the input, and ultralytics feeds it a frame stretched to the input rather than letterboxed. Read
as end2end it publishes boxes that match nothing, so it is recognised only from the ``head``
metadata ultralytics writes (``RTDETRDecoder``), never from the shape alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edged.heads.base import OutputFacts, cxcywh_to_xyxy, rows
from edged.heads.end2end import End2EndHead


class RtDetrHead(End2EndHead):
    """Columns cx cy w h (fractions of the input) score class, the model's top K by score.

    As ultralytics' RTDETRPredictor: the candidates scoring above conf, the first ``max_det`` of
    them (the model sorted them by score, so decode's ranking keeps its order), no NMS. Decode
    scales the fractions by the frame size.
    """

    name = "rtdetr"
    layout = "[1, K, 6] with head: RTDETRDecoder"
    normalised = True
    resize = "stretch"

    @classmethod
    def matches(cls, facts: OutputFacts) -> int | None:
        """Six columns as rows, from a model whose metadata names RT-DETR's decoder as its head."""
        if not facts.rtdetr or not facts.candidates_in_rows or facts.features != 6:
            return None
        return cls.named_classes(facts, "an RT-DETR head")

    def __init__(self, output_shape: Sequence[int], num_classes: int, conf: float) -> None:
        super().__init__(output_shape, num_classes, conf)
        self._half = np.empty(2 * self.capacity, dtype=np.float32)

    def select(self, pred: np.ndarray) -> int:
        """(K, 6) -> the k candidates with score above conf, boxes as x1 y1 x2 y2 fractions of the input."""
        k = super().select(pred)
        cxcywh_to_xyxy(rows(self.boxes, 4, k), rows(self._half, 2, k))
        return k
