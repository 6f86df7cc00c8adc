"""Greedy non-maximum suppression over preallocated buffers.

This stage owns the choice of which overlapping boxes survive. It runs on the few candidates
left after the score threshold and loops once per *kept* box: each pass picks the best score
left and suppresses, in one vectorised step, every box that overlaps it too much. Picking the
maximum each pass instead of sorting first means the order needs no index array, so with the
scratch allocated here once a frame creates no numpy arrays at all.
"""

from __future__ import annotations

import numpy as np

_NEG_INF = np.array(-np.inf, dtype=np.float32)
_ZERO = np.array(0.0, dtype=np.float32)


class GreedyNms:
    """Greedy NMS for up to ``capacity`` candidates, keeping at most ``max_det`` boxes.

    A box is suppressed when its IoU with an already kept box is strictly greater than ``iou``
    (torchvision's rule); boxes of different classes never suppress each other unless
    ``agnostic``. ``iou=None`` only ranks: the best ``max_det`` by score, for models that ran
    NMS themselves. Equal scores keep their input order, so results are deterministic.
    """

    def __init__(self, capacity: int, iou: float | None, *, max_det: int, agnostic: bool = False) -> None:
        if capacity < 0 or max_det < 1:
            raise ValueError(f"need capacity >= 0 and max_det >= 1, got {capacity} and {max_det}")
        if iou is not None and not 0.0 < iou <= 1.0:
            raise ValueError(f"iou must be in (0, 1], got {iou}")
        self.capacity = capacity
        self.max_det = max_det
        self._agnostic = agnostic
        self._suppresses = iou is not None
        self._iou = np.array(iou or 0.0, dtype=np.float32)
        self._one_plus_iou = np.array(np.float32(1.0) + self._iou, dtype=np.float32)
        # Per-call scratch, sliced to the candidate count. IoU > t  <=>  inter * (1 + t) > t * (area_a + area_b):
        # no division, and two empty boxes (union 0) count as not overlapping.
        self._t_area = np.empty(capacity, dtype=np.float32)
        self._corner = np.empty((2, capacity), dtype=np.float32)  # x and y in one call each step
        self._far = np.empty((2, capacity), dtype=np.float32)
        self._over = np.empty(capacity, dtype=np.bool_)
        self._same = np.empty(capacity, dtype=np.bool_)
        self._best = np.empty((), dtype=np.intp)

    def __call__(self, xyxy: np.ndarray, scores: np.ndarray, class_ids: np.ndarray, keep: np.ndarray) -> int:
        """Write the indices of the kept boxes, best first, to ``keep``; return how many.

        ``xyxy`` is (4, k) float32 rows x1 y1 x2 y2, ``scores`` (k,) float32 and ``class_ids``
        (k,) integers. Scores must be finite or -inf; a -inf candidate is never kept. ``scores``
        is used as the working copy and left at -inf for every kept or suppressed box.
        """
        k = scores.shape[0]
        if k > self.capacity:
            raise ValueError(f"{k} candidates exceed this NMS's capacity of {self.capacity}")
        if self._suppresses:
            self._scaled_areas(xyxy, k)
        for n in range(self.max_det):
            if k == 0 or not self._next_best(scores):
                return n
            best = int(self._best)
            keep[n] = best
            scores[best] = -np.inf
            if self._suppresses:
                self._suppress(xyxy, scores, class_ids, best, k)
        return self.max_det

    def _next_best(self, scores: np.ndarray) -> bool:
        """Put the index of the highest score left in ``self._best``; False when none is left."""
        np.argmax(scores, out=self._best)
        return bool(scores.item(int(self._best)) != -np.inf)

    def _scaled_areas(self, xyxy: np.ndarray, k: int) -> None:
        """``t * area`` of every candidate, the right-hand side's terms."""
        sides = self._far[:, :k]
        np.subtract(xyxy[2:], xyxy[:2], out=sides)
        np.multiply(sides[0], sides[1], out=self._t_area[:k])
        np.multiply(self._t_area[:k], self._iou, out=self._t_area[:k])

    def _suppress(self, xyxy: np.ndarray, scores: np.ndarray, class_ids: np.ndarray, best: int, k: int) -> None:
        """Set to -inf the score of every box (of ``best``'s class) overlapping ``best`` too much."""
        one = slice(best, best + 1)  # a length-1 view broadcasts without making a 0-d array
        near, far, over, t_area = self._corner[:, :k], self._far[:, :k], self._over[:k], self._t_area[:k]
        np.maximum(xyxy[:2], xyxy[:2, one], out=near)
        np.minimum(xyxy[2:], xyxy[2:, one], out=far)
        np.subtract(far, near, out=far)
        np.maximum(far, _ZERO, out=far)
        inter, bound = far[0], near[0]
        np.multiply(inter, far[1], out=inter)
        np.multiply(inter, self._one_plus_iou, out=inter)
        np.add(t_area, t_area[one], out=bound)
        np.greater(inter, bound, out=over)
        if not self._agnostic:
            same = self._same[:k]
            np.equal(class_ids, class_ids[one], out=same)
            np.logical_and(over, same, out=over)
        np.copyto(scores, _NEG_INF, where=over)
