"""Detection metrics for edged's evaluation: precision, recall, AP@0.5 and AP@0.5:0.95 (pure numpy).

Owns the scoring rules so every evaluation path (the demo model's card, ``edged eval``) reports
the same numbers for the same detections. The conventions are COCO's:

* Matching is per image and per class at each IoU threshold: predictions in descending score
  order (ties keep insertion order) each take the still-unmatched ground-truth box of the same
  class with the highest IoU, if that IoU is >= the threshold; otherwise they are false positives.
* AP is the area under the precision envelope (precision made monotonically non-increasing
  from the right), sampled at 101 recall points 0.00, 0.01, ..., 1.00; a recall level that is
  never reached contributes 0. AP@0.5:0.95 is the mean over IoU 0.50, 0.55, ..., 0.95.
* AP uses every prediction given (no per-image cap); precision and recall are reported at a
  confidence threshold, with matches at IoU 0.5.
* A class without ground truth has no AP or recall: it keeps ``n_gt == 0`` (its recall and APs
  read 0, its precision is 0 when it has predictions) and is left out of every overall mean.
  Overall precision, recall, mAP@0.5 and mAP@0.5:0.95 are plain means over the classes that do
  have ground truth; with none at all they are 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

IOU_THRESHOLDS: np.ndarray = np.linspace(0.5, 0.95, 10)
_RECALL_POINTS = np.linspace(0.0, 1.0, 101)


@dataclass(frozen=True, slots=True)
class ClassMetrics:
    """One class; `n_pred` counts predictions at or above the report's confidence."""

    name: str
    n_gt: int
    n_pred: int
    precision: float
    recall: float
    ap50: float
    ap50_95: float


@dataclass(frozen=True, slots=True)
class EvalReport:
    """Per-class metrics and their means over classes with ground truth."""

    per_class: list[ClassMetrics]
    precision: float
    recall: float
    map50: float
    map50_95: float
    n_images: int
    conf: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every xyxy box in `a` (N, 4) with every box in `b` (M, 4): (N, M), 0 for empty."""
    a = np.asarray(a, np.float64).reshape(-1, 4)
    b = np.asarray(b, np.float64).reshape(-1, 4)
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), axis=2)
    area_a = np.prod(np.clip(a[:, 2:] - a[:, :2], 0, None), axis=1)
    area_b = np.prod(np.clip(b[:, 2:] - b[:, :2], 0, None), axis=1)
    union = area_a[:, None] + area_b[None, :] - inter
    iou: np.ndarray = np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)
    return iou


def match(ious: np.ndarray, thresholds: np.ndarray = IOU_THRESHOLDS) -> np.ndarray:
    """Greedy matching of score-ordered predictions (rows of `ious`) to ground truth (columns).

    Returns (N, T) booleans: prediction i is a true positive at threshold t.
    """
    n, m = ious.shape
    tp = np.zeros((n, len(thresholds)), bool)
    if n == 0 or m == 0:
        return tp
    for t, thr in enumerate(thresholds):
        taken = np.zeros(m, bool)
        for i in np.flatnonzero(ious.max(axis=1) >= thr):
            cand = np.where(taken, -1.0, ious[i])
            j = int(np.argmax(cand))
            if cand[j] >= thr:
                taken[j] = True
                tp[i, t] = True
    return tp


def average_precision(tp: np.ndarray, scores: np.ndarray, n_gt: int) -> float:
    """101-point interpolated AP of predictions with true-positive flags `tp` and `scores`."""
    if n_gt == 0 or len(tp) == 0:
        return 0.0
    order = np.argsort(-np.asarray(scores), kind="stable")
    hits = np.asarray(tp, bool)[order]
    tp_cum = np.cumsum(hits)
    recall = tp_cum / n_gt
    precision = tp_cum / np.arange(1, len(hits) + 1)
    envelope = np.maximum.accumulate(precision[::-1])[::-1]
    idx = np.searchsorted(recall, _RECALL_POINTS, side="left")
    sampled = np.where(idx < len(envelope), envelope[np.minimum(idx, len(envelope) - 1)], 0.0)
    return float(sampled.mean())


class MetricAccumulator:
    """Collects per-image predictions and ground truth; `report` turns them into metrics."""

    def __init__(self, class_names: Sequence[str]) -> None:
        self.class_names = tuple(class_names)
        self._scores: list[list[np.ndarray]] = [[] for _ in self.class_names]
        self._tp: list[list[np.ndarray]] = [[] for _ in self.class_names]
        self._n_gt = np.zeros(len(self.class_names), np.int64)
        self.n_images = 0

    def add(
        self, pred_xyxy: np.ndarray, pred_scores: np.ndarray, pred_cls: np.ndarray, gt_xyxy: np.ndarray, gt_cls: np.ndarray
    ) -> None:
        """One image: predictions (N, 4) / (N,) / (N,) and ground truth (M, 4) / (M,)."""
        pred_xyxy = np.asarray(pred_xyxy, np.float64).reshape(-1, 4)
        pred_scores = np.asarray(pred_scores, np.float64).reshape(-1)
        pred_cls = np.asarray(pred_cls, np.int64).reshape(-1)
        gt_xyxy = np.asarray(gt_xyxy, np.float64).reshape(-1, 4)
        gt_cls = np.asarray(gt_cls, np.int64).reshape(-1)
        if not len(pred_xyxy) == len(pred_scores) == len(pred_cls):
            raise ValueError("prediction boxes, scores and classes differ in length")
        if len(gt_xyxy) != len(gt_cls):
            raise ValueError("ground-truth boxes and classes differ in length")
        nc = len(self.class_names)
        if np.any((pred_cls < 0) | (pred_cls >= nc)) or np.any((gt_cls < 0) | (gt_cls >= nc)):
            raise ValueError(f"class ids must lie in [0, {nc})")
        self.n_images += 1
        for c in range(nc):
            gts = gt_xyxy[gt_cls == c]
            self._n_gt[c] += len(gts)
            mine = np.flatnonzero(pred_cls == c)
            if not len(mine):
                continue
            mine = mine[np.argsort(-pred_scores[mine], kind="stable")]
            self._scores[c].append(pred_scores[mine])
            self._tp[c].append(match(box_iou(pred_xyxy[mine], gts)))

    def report(self, conf: float = 0.25) -> EvalReport:
        """Metrics over everything added; precision/recall count predictions scoring >= conf."""
        per_class = [self._class_metrics(c, conf) for c in range(len(self.class_names))]
        scored = [m for m in per_class if m.n_gt > 0]

        def mean(field: str) -> float:
            return float(np.mean([getattr(m, field) for m in scored])) if scored else 0.0

        return EvalReport(per_class, mean("precision"), mean("recall"), mean("ap50"), mean("ap50_95"), self.n_images, conf)

    def _class_metrics(self, c: int, conf: float) -> ClassMetrics:
        n_gt = int(self._n_gt[c])
        scores = np.concatenate(self._scores[c]) if self._scores[c] else np.zeros(0)
        tp = np.concatenate(self._tp[c]) if self._tp[c] else np.zeros((0, len(IOU_THRESHOLDS)))
        aps = [average_precision(tp[:, t], scores, n_gt) for t in range(len(IOU_THRESHOLDS))]
        kept = scores >= conf
        n_pred, hits = int(kept.sum()), int(tp[kept, 0].sum())
        precision = hits / n_pred if n_pred else 0.0
        recall = hits / n_gt if n_gt else 0.0
        return ClassMetrics(self.class_names[c], n_gt, n_pred, precision, recall, aps[0], float(np.mean(aps)))
