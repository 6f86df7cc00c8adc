"""The segment head: ultralytics' YOLOv8/YOLO11 ``-seg`` export, [1, 4+nc+32, N] and prototypes [1, 32, H/4, W/4].

Its candidates are the yolov8 head's, with 32 mask coefficients after the class scores; decode
selects and suppresses them as for detection, and `edged.segment` makes the masks of the kept ones.
"""

from __future__ import annotations

import numpy as np

from edged.errors import HeadError
from edged.heads.base import Dim, OutputFacts, fmt_classes, fmt_shape
from edged.heads.yolov8 import YoloV8Head

MASK_COEFFICIENTS = 32  # ultralytics' Segment head: one coefficient per prototype


class SegmentHead(YoloV8Head, candidate_axis=2, box_columns=4):
    """Rows cx cy w h, one score per class, then the mask coefficients; beside them the prototypes."""

    name = "segment"

    @classmethod
    def expected_shape(cls, num_classes: int) -> list[Dim]:
        return [1, 4 + num_classes + MASK_COEFFICIENTS, "N"]

    @classmethod
    def class_scores(cls, output: np.ndarray) -> np.ndarray:
        """The class scores alone, as a writable (classes, candidates) view: not the mask coefficients."""
        scores: np.ndarray = output[0, 4:-MASK_COEFFICIENTS]
        return scores

    @classmethod
    def matches(cls, facts: OutputFacts) -> int | None:
        """Candidates as columns beside a prototypes output."""
        if not facts.prototypes or facts.candidates_in_rows:
            return None
        shown, nc = fmt_shape(facts.shape), facts.features - 4 - MASK_COEFFICIENTS
        if nc < 1:
            raise HeadError(f"output {shown} has {facts.features} rows; a segment head [1, 4+nc+32, N] needs >= 37")
        if facts.n_names is not None and nc != facts.n_names:
            raise HeadError(
                f"output {shown} is a segment head with {fmt_classes(nc)}, but metadata names "
                f"{fmt_classes(facts.n_names)} (expected [1, {4 + facts.n_names + MASK_COEFFICIENTS}, N])"
            )
        return nc


SegmentHead.layout = "[1, 4+nc+32, N] and [1, 32, H/4, W/4]"  # after DenseHead named its own
