"""Greedy non-maximum suppression in pure numpy.

This stage owns the choice of which overlapping boxes survive. It works on the few candidates
left after the score threshold, so it loops once per *kept* box and compares that box with all
remaining ones in a single vectorised step; nothing here is quadratic in Python.
"""

from __future__ import annotations

import numpy as np


def nms(
    xyxy: np.ndarray, scores: np.ndarray, iou: float, *, max_det: int | None = None
) -> np.ndarray:
    """Greedy NMS; returns indices into ``xyxy`` of the kept boxes, highest score first.

    ``xyxy`` is (N, 4) x1 y1 x2 y2 and ``scores`` is (N,), both finite. A box is suppressed when
    its IoU with an already kept box is strictly greater than ``iou`` (torchvision's rule).
    Equal scores keep their input order, so results are deterministic. Stopping after
    ``max_det`` kept boxes bounds the work even when thousands of candidates pass the threshold.
    """
    order = np.argsort(-np.asarray(scores), kind="stable")
    boxes = np.asarray(xyxy, dtype=np.float64)[order]
    # Separate contiguous columns: one kept box costs a dozen numpy calls, whatever N is.
    x1, y1, x2, y2 = (np.ascontiguousarray(column) for column in boxes.T)
    # IoU <= t  <=>  inter * (1 + t) <= t * (area_a + area_b): no division, and two empty
    # boxes (union 0) count as not overlapping.
    t_areas = iou * (x2 - x1) * (y2 - y1)
    limit = len(order) if max_det is None else max_det
    keep: list[int] = []
    alive = np.arange(len(order))
    while alive.size and len(keep) < limit:
        best, rest = int(alive[0]), alive[1:]
        keep.append(best)
        inter = _overlap(x1[rest], x2[rest], x1[best], x2[best])
        inter *= _overlap(y1[rest], y2[rest], y1[best], y2[best])
        inter *= 1.0 + iou
        alive = rest[inter <= t_areas[rest] + t_areas[best]]
    return order[np.asarray(keep, dtype=np.intp)]


def batched_nms(
    xyxy: np.ndarray,
    scores: np.ndarray,
    class_ids: np.ndarray,
    iou: float,
    *,
    max_det: int | None = None,
) -> np.ndarray:
    """Class-aware NMS: boxes of different classes never suppress each other.

    Shifts each class into its own disjoint coordinate range (``class_id * span``, where
    ``span`` exceeds the extent of all boxes) and runs one plain NMS, which is cheaper than one
    NMS per class. Coordinates must be finite and of sane magnitude (frame pixels).
    """
    boxes = np.asarray(xyxy, dtype=np.float64)
    if boxes.shape[0] == 0:
        return np.empty(0, dtype=np.intp)
    span = boxes.max() - boxes.min() + 1.0
    shifted = boxes + (np.asarray(class_ids, dtype=np.float64) * span)[:, None]
    return nms(shifted, scores, iou, max_det=max_det)


def _overlap(lo: np.ndarray, hi: np.ndarray, top_lo: float, top_hi: float) -> np.ndarray:
    """(M,) length of the overlap of intervals [lo, hi] with [top_lo, top_hi], >= 0."""
    length = np.minimum(hi, top_hi)
    length -= np.maximum(lo, top_lo)
    return np.maximum(length, 0.0, out=length)
