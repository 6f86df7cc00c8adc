"""Greedy non-maximum suppression over preallocated buffers, decided as ultralytics decides it.

This stage owns the choice of which overlapping boxes survive. It runs on the candidates left
after the score threshold, in the model's input space, and loops once per *kept* box: each pass
picks the best score left and suppresses, in one vectorised step, every box that overlaps it too
much. Picking the maximum each pass instead of sorting first means the order needs no index
array, so with the scratch allocated here once a frame creates no numpy arrays at all.

Every decision is the one ultralytics' predict makes on the same float32 candidates: classes are
kept apart by shifting each class's boxes ``MAX_WH`` pixels apart (its batched-NMS trick, whose
rounding shows in the IoUs), the IoU is torchvision's float32 arithmetic compared with the
threshold as a double, and at most ``MAX_NMS`` best candidates enter. Near a threshold a textbook
IoU would decide some pairs differently, and the boxes would no longer be the ones users validated.
"""

from __future__ import annotations

import numpy as np

MAX_WH = 7680  # ultralytics' class offset in pixels (max_wh)
MAX_NMS = 30000  # ultralytics' cap on the candidates entering NMS (max_nms)

_NEG_INF = np.array(-np.inf, dtype=np.float32)
_ZERO = np.array(0.0, dtype=np.float32)
_CLASS_SHIFT = np.array(MAX_WH, dtype=np.float32)
PAIRWISE_MAX = 128  # up to this many candidates, every pair's overlap is computed at once (`GreedyNms`)


def float32_threshold(iou: float) -> np.ndarray:
    """The largest float32 not above ``iou``: ``ovr > it`` in float32 is ``ovr > iou`` in double."""
    t = np.float32(iou)
    if float(t) > iou:
        t = np.nextafter(t, np.float32(-np.inf))
    return np.array(t, dtype=np.float32)


class GreedyNms:
    """Greedy NMS for up to ``capacity`` candidates, keeping at most ``max_det`` boxes.

    A box is suppressed when its IoU with an already kept box is strictly greater than ``iou``
    (torchvision's rule). Unless ``agnostic``, each class's boxes are shifted ``MAX_WH`` pixels
    apart first, so boxes of different classes do not suppress each other. Only the ``max_nms``
    best candidates take part. ``iou=None`` only ranks: the best ``max_det`` by score, for models
    that ran NMS themselves. Equal scores keep their input order, so results are deterministic.

    Up to ``PAIRWISE_MAX`` candidates (a frame's usual few dozen), the IoU of every pair is
    computed in one vectorised pass and the greedy walk runs over its rows in Python: a dozen
    numpy calls a frame instead of a dozen per kept box, whose fixed cost is most of NMS at that
    size. Each pair's IoU is the same float32 arithmetic either way, so the boxes kept are too.
    """

    def __init__(
        self, capacity: int, iou: float | None, *, max_det: int, agnostic: bool = False, max_nms: int = MAX_NMS
    ) -> None:
        if capacity < 0 or max_det < 1 or max_nms < 1:
            raise ValueError(f"need capacity >= 0, max_det >= 1 and max_nms >= 1, got {capacity}, {max_det}, {max_nms}")
        if iou is not None and not 0.0 < iou <= 1.0:
            raise ValueError(f"iou must be in (0, 1], got {iou}")
        self.capacity = capacity
        self.max_det = max_det
        self._agnostic = agnostic
        self._suppresses = iou is not None
        self._iou = float32_threshold(iou or 0.0)
        self._max_nms = max_nms
        # Per-call scratch, sliced to the candidate count.
        self._shift = np.empty((1, capacity), dtype=np.float32)  # class id x MAX_WH
        self._shifted = np.empty((4, capacity), dtype=np.float32)  # the boxes NMS compares
        self._areas = np.empty(capacity, dtype=np.float32)
        self._corner = np.empty((2, capacity), dtype=np.float32)  # x and y in one call each step
        self._far = np.empty((2, capacity), dtype=np.float32)
        self._union = np.empty(capacity, dtype=np.float32)
        self._over = np.empty(capacity, dtype=np.bool_)
        self._best = np.empty((), dtype=np.intp)
        # The scores as they came, for ranking picks; only an output with more candidates than max_nms needs them.
        self._ranked = np.empty(capacity if capacity > max_nms else 0, dtype=np.float32)
        # Every pair's overlap at once, for up to `PAIRWISE_MAX` candidates: flat, reshaped to (k, k) per call.
        pairs = min(capacity, PAIRWISE_MAX) ** 2 if self._suppresses else 0
        self._pair_near = np.empty(2 * pairs, dtype=np.float32)
        self._pair_far = np.empty(2 * pairs, dtype=np.float32)
        self._pair_union = np.empty(pairs, dtype=np.float32)
        self._pair_over = np.empty(pairs, dtype=np.bool_)

    def __call__(self, xyxy: np.ndarray, scores: np.ndarray, class_ids: np.ndarray, keep: np.ndarray) -> int:
        """Write the indices of the kept boxes, best first, to ``keep``; return how many.

        ``xyxy`` is (4, k) float32 rows x1 y1 x2 y2, ``scores`` (k,) float32 and ``class_ids``
        (k,) integers. Scores must be finite or -inf; a -inf candidate is never kept. ``scores``
        is the working copy: what it holds afterwards is unspecified.
        """
        k = scores.shape[0]
        if k > self.capacity:
            raise ValueError(f"{k} candidates exceed this NMS's capacity of {self.capacity}")
        boxes, cut = xyxy, False
        if self._suppresses:
            boxes = self._separated(xyxy, class_ids, k)
            cut = self._cut_needed(scores, k)
            sides = self._far[:, :k]
            np.subtract(boxes[2:], boxes[:2], out=sides)
            np.multiply(sides[0], sides[1], out=self._areas[:k])
            if not cut and k <= PAIRWISE_MAX:
                return self._pairwise(boxes, scores, k, keep)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # 0/0: two empty boxes, not an overlap
            for n in range(self.max_det):
                if k == 0 or not self._next_best(scores):
                    return n
                best = int(self._best)
                if cut and self._rank(best, k) >= self._max_nms:
                    return n
                keep[n] = best
                scores[best] = -np.inf
                if self._suppresses:
                    self._suppress(boxes, scores, best, k)
        return self.max_det

    def _pairwise(self, boxes: np.ndarray, scores: np.ndarray, k: int, keep: np.ndarray) -> int:
        """Greedy NMS of k candidates from the matrix of their overlaps: the candidates best first
        (equal scores in input order, as `_next_best` picks them), each kept unless a kept one
        overlaps it, each kept one then marking those it overlaps."""
        over = self._overlaps(boxes, k)
        listed = scores.tolist()
        alive = [True] * k
        n = 0
        for i in sorted(range(k), key=listed.__getitem__, reverse=True):  # stable: ties keep their order
            if listed[i] == -np.inf or n == self.max_det:
                break
            if alive[i]:
                keep[n] = i
                n += 1
                alive = [a and not o for a, o in zip(alive, over[i].tolist(), strict=True)]
        return n

    def _overlaps(self, boxes: np.ndarray, k: int) -> np.ndarray:
        """(k, k) bool: row i says which boxes box i overlaps by more than the threshold, as
        `_suppress` finds them for one box (``_areas`` filled first)."""
        scratch = (
            self._pair_near[: 2 * k * k].reshape(2, k, k),
            self._pair_far[: 2 * k * k].reshape(2, k, k),
            self._pair_union[: k * k].reshape(k, k),
        )
        over = self._pair_over[: k * k].reshape(k, k)
        areas = self._areas[:k]
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # 0/0: two empty boxes, not an overlap
            self._exceeds(boxes[:, :, None], areas[:, None], boxes[:, None, :], areas[None, :], scratch, over)
        return over

    def _separated(self, xyxy: np.ndarray, class_ids: np.ndarray, k: int) -> np.ndarray:
        """The boxes NMS compares: ``xyxy`` itself when agnostic, else each class shifted by MAX_WH."""
        if self._agnostic:
            return xyxy
        shift, shifted = self._shift[:, :k], self._shifted[:, :k]
        np.copyto(shift[0], class_ids, casting="unsafe")  # the class as a float, as ultralytics holds it
        np.multiply(shift, _CLASS_SHIFT, out=shift)
        np.add(xyxy, shift, out=shifted)
        return shifted

    def _cut_needed(self, scores: np.ndarray, k: int) -> bool:
        """Whether more than ``max_nms`` candidates are live; if so, keep their scores for `_rank`.

        Picking best-first, the first pick outside the ``max_nms`` best ends the loop: every
        candidate left ranks lower still, and none of them would have entered ultralytics' NMS.
        """
        if k <= self._max_nms:
            return False
        live = self._over[:k]
        np.not_equal(scores, _NEG_INF, out=live)
        if np.count_nonzero(live) <= self._max_nms:
            return False
        np.copyto(self._ranked[:k], scores)
        return True

    def _rank(self, best: int, k: int) -> int:
        """How many candidates scored above ``best`` (ties at the cut stay in)."""
        above = self._over[:k]
        np.greater(self._ranked[:k], self._ranked[best : best + 1], out=above)
        return int(np.count_nonzero(above))

    def _next_best(self, scores: np.ndarray) -> bool:
        """Put the index of the highest score left in ``self._best``; False when none is left."""
        np.argmax(scores, out=self._best)
        return bool(scores.item(int(self._best)) != -np.inf)

    def _suppress(self, boxes: np.ndarray, scores: np.ndarray, best: int, k: int) -> None:
        """Set to -inf the score of every box overlapping ``best`` by more than the threshold (`_exceeds`)."""
        one = slice(best, best + 1)  # a length-1 view broadcasts without making a 0-d array
        areas, over = self._areas[:k], self._over[:k]
        self._exceeds(
            boxes[:, one], areas[one], boxes, areas, (self._corner[:, :k], self._far[:, :k], self._union[:k]), over
        )
        np.copyto(scores, _NEG_INF, where=over)

    def _exceeds(
        self,
        pivots: np.ndarray,
        pivot_areas: np.ndarray,
        others: np.ndarray,
        other_areas: np.ndarray,
        scratch: tuple[np.ndarray, np.ndarray, np.ndarray],
        over: np.ndarray,
    ) -> None:
        """``over`` = the IoU of each pivot box with each other box (x1 y1 x2 y2 rows, broadcast
        against each other) is above the threshold. torchvision's arithmetic, step for step:
        ``inter / (area_pivot + area - inter)`` in float32, where two empty boxes give NaN and so
        no overlap. ``scratch`` is (near corners, far corners, union) of the broadcast shape."""
        near, far, union = scratch
        np.maximum(others[:2], pivots[:2], out=near)
        np.minimum(others[2:], pivots[2:], out=far)
        np.subtract(far, near, out=far)
        np.maximum(far, _ZERO, out=far)
        inter = far[0]
        np.multiply(inter, far[1], out=inter)
        np.add(pivot_areas, other_areas, out=union)
        np.subtract(union, inter, out=union)
        np.divide(inter, union, out=inter)
        np.greater(inter, self._iou, out=over)
