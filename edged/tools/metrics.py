"""Detection metrics for edged's evaluation: precision, recall, AP@0.5 and AP@0.5:0.95 in two conventions.

Users hold edged's figures against the ones their own tools gave them, and the two common tools
integrate AP differently; so the same detections can be scored either way, and every report names
the convention it used:

* ``ultralytics`` (the default) is ``yolo val``'s, as ultralytics 8.4 computes it
  (`DetectionValidator.match_predictions`, `ap_per_class`, `compute_ap`): a class's predictions
  over the whole data set, in descending score order, trace a precision-recall curve; its envelope
  (precision made non-increasing from the right, and 0 past the last recall reached) is
  interpolated at the 101 recall points 0.00, 0.01, ..., 1.00 and integrated with the trapezoid
  rule. The drop to 0 at recall 1.00 costs half a step, so a perfect class scores 0.995. Equal
  scores keep image order.
* ``coco`` is pycocotools' COCOeval on the same boxes (``bbox``, area ``all``, at most 100
  detections per class and image, COCOeval's defaults): the mean of the envelope sampled at the
  same 101 recall points, where a level never reached counts 0 and a perfect class scores 1.0.
  pycocotools is imported only for this convention.

Common to both:

* Matching is per image at each IoU threshold 0.50, 0.55, ..., 0.95: predictions in descending
  score order (ties keep their order) each take the still-unmatched ground-truth box of the same
  class with the highest IoU, if that IoU is >= the threshold; otherwise they are false positives.
  AP@0.5:0.95 is the mean over the ten thresholds. (COCOeval matches on its own, the same way.)
* Precision and recall are counted at one confidence threshold, matched at IoU 0.5, in both
  conventions (``yolo val`` reports its own at the confidence of the best mean F1 instead), and
  over the predictions a deployment publishes where those differ from the ones AP ranks.
* A class without ground truth has no AP or recall: it keeps ``n_gt == 0`` (its recall and APs
  read 0, its precision is 0 when it has predictions) and is left out of every overall mean.
  Overall precision, recall, mAP@0.5 and mAP@0.5:0.95 are plain means over the classes that do
  have ground truth; with none at all they are 0.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np

from edged.errors import MissingDependency

Convention = Literal["ultralytics", "coco"]

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
    """Per-class metrics and their means over classes with ground truth, under `convention`."""

    per_class: list[ClassMetrics]
    precision: float
    recall: float
    map50: float
    map50_95: float
    n_images: int
    report_conf: float  # the confidence of precision, recall and n_pred
    convention: Convention
    mask: EvalReport | None = None  # a segmentation model's: the same predictions matched by their masks

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


MASK_BLOCK = 256  # ground-truth masks `mask_iou` turns into numbers at once


def mask_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every mask in `a` (N, pixels) with every mask in `b` (M, pixels), both bool: (N, M), 0 for empty.

    Counted in float32, exact below 2^24 pixels, `MASK_BLOCK` masks of `b` at a time: float64 copies
    of a densely labelled image's 5000 masks at once took a gigabyte."""
    fa, masks = np.asarray(a, np.float32), np.asarray(b, np.bool_)
    inter = np.zeros((len(fa), len(masks)), np.float64)
    for start in range(0, len(masks), MASK_BLOCK):
        inter[:, start : start + MASK_BLOCK] = fa @ masks[start : start + MASK_BLOCK].T.astype(np.float32)
    union = fa.sum(axis=1, dtype=np.float64)[:, None] + masks.sum(axis=1, dtype=np.float64)[None, :] - inter
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


def _ultralytics_ap(hits: np.ndarray, n_gt: int) -> float:
    """``yolo val``'s AP of one class at one IoU threshold; `hits` flags its predictions in descending score order."""
    if n_gt == 0 or len(hits) == 0:
        return 0.0
    tp_cum = np.cumsum(np.asarray(hits, bool))
    recall = tp_cum / n_gt
    precision = tp_cum / np.arange(1, len(hits) + 1)
    mrec = np.concatenate(([0.0], recall, [recall[-1]], [1.0]))
    mpre = np.concatenate(([1.0], precision, [0.0], [0.0]))
    envelope = np.flip(np.maximum.accumulate(np.flip(mpre)))
    curve = np.interp(_RECALL_POINTS, mrec, envelope)
    return float((np.diff(_RECALL_POINTS) * (curve[1:] + curve[:-1]) / 2.0).sum())


Predictions = tuple[np.ndarray, np.ndarray, np.ndarray]
"""One image's predicted boxes (N, 4) x1 y1 x2 y2, scores (N,) and class ids (N,)."""

Masks = tuple[np.ndarray, np.ndarray]
"""One image's predicted masks (N, pixels) in the predictions' order and ground-truth masks (M, pixels), bool."""


@dataclass(frozen=True, slots=True)
class _Ranked:
    """Predictions in descending score order (ties keep their order) and their matches (N, thresholds)."""

    xyxy: np.ndarray
    scores: np.ndarray
    classes: np.ndarray
    tp: np.ndarray


@dataclass(frozen=True, slots=True)
class _Image:
    """One image: the predictions AP ranks, those precision and recall count, and the ground truth."""

    ranked: _Ranked
    published: _Ranked
    gt_xyxy: np.ndarray
    gt_cls: np.ndarray


class MetricAccumulator:
    """Collects per-image predictions and ground truth; `report` turns them into metrics."""

    def __init__(self, class_names: Sequence[str]) -> None:
        self.class_names = tuple(class_names)
        self._images: list[_Image] = []

    def add(
        self,
        pred_xyxy: np.ndarray,
        pred_scores: np.ndarray,
        pred_cls: np.ndarray,
        gt_xyxy: np.ndarray,
        gt_cls: np.ndarray,
        published: Predictions | None = None,
        masks: Masks | None = None,
        published_masks: Masks | None = None,
    ) -> None:
        """One image: predictions (N, 4) / (N,) / (N,) and ground truth (M, 4) / (M,).

        AP ranks the predictions; precision and recall count `published` instead where given:
        what a deployment shows can differ from what an evaluation ranks (one class per box
        against every class above the threshold). With `masks` (and `published_masks` for
        `published`) predictions match ground truth by their masks' IoU, not their boxes'.
        """
        gt_xyxy = np.asarray(gt_xyxy, np.float64).reshape(-1, 4)
        gt_cls = np.asarray(gt_cls, np.int64).reshape(-1)
        if len(gt_xyxy) != len(gt_cls):
            raise ValueError("ground-truth boxes and classes differ in length")
        self._check_classes(gt_cls)
        ranked = self._rank((pred_xyxy, pred_scores, pred_cls), gt_xyxy, gt_cls, IOU_THRESHOLDS, masks)
        if published is None:
            shown = _Ranked(ranked.xyxy, ranked.scores, ranked.classes, ranked.tp[:, :1])
        else:
            shown = self._rank(published, gt_xyxy, gt_cls, IOU_THRESHOLDS[:1], published_masks)
        self._images.append(_Image(ranked, shown, gt_xyxy, gt_cls))

    def _check_classes(self, classes: np.ndarray) -> None:
        nc = len(self.class_names)
        if np.any((classes < 0) | (classes >= nc)):
            raise ValueError(f"class ids must lie in [0, {nc})")

    def _rank(
        self,
        predictions: Predictions,
        gt_xyxy: np.ndarray,
        gt_cls: np.ndarray,
        thresholds: np.ndarray,
        masks: Masks | None = None,
    ) -> _Ranked:
        xyxy = np.asarray(predictions[0], np.float64).reshape(-1, 4)
        scores = np.asarray(predictions[1], np.float64).reshape(-1)
        classes = np.asarray(predictions[2], np.int64).reshape(-1)
        if not len(xyxy) == len(scores) == len(classes):
            raise ValueError("prediction boxes, scores and classes differ in length")
        self._check_classes(classes)
        order = np.argsort(-scores, kind="stable")
        xyxy, scores, classes = xyxy[order], scores[order], classes[order]
        if masks is None:
            ious = box_iou(xyxy, gt_xyxy)
        else:
            pred_masks, gt_masks = masks
            if len(pred_masks) != len(order) or len(gt_masks) != len(gt_cls):
                raise ValueError("masks and their boxes differ in number")
            ious = mask_iou(pred_masks[order], gt_masks)
        ious[classes[:, None] != gt_cls[None, :]] = 0.0
        return _Ranked(xyxy, scores, classes, match(ious, thresholds))

    def report(self, conf: float = 0.25, convention: Convention = "ultralytics") -> EvalReport:
        """Metrics over everything added; precision/recall count published predictions scoring >= conf."""
        nc = len(self.class_names)
        images = self._images
        n_gt = np.bincount(np.concatenate([im.gt_cls for im in images]), minlength=nc) if images else np.zeros(nc, np.int64)
        aps = _coco_aps(images, nc) if convention == "coco" else _ultralytics_aps([im.ranked for im in images], n_gt)
        published = _joined([im.published for im in images])
        kept = published.scores >= conf
        per_class = []
        for c, name in enumerate(self.class_names):
            mine = kept & (published.classes == c)
            n_pred, hits = int(mine.sum()), int(published.tp[mine, 0].sum())
            precision = hits / n_pred if n_pred else 0.0
            recall = hits / int(n_gt[c]) if n_gt[c] else 0.0
            ap50, ap50_95 = float(aps[c, 0]), float(aps[c].mean())
            per_class.append(ClassMetrics(name, int(n_gt[c]), n_pred, precision, recall, ap50, ap50_95))
        scored = [m for m in per_class if m.n_gt > 0]

        def mean(field: str) -> float:
            return float(np.mean([getattr(m, field) for m in scored])) if scored else 0.0

        return EvalReport(
            per_class, mean("precision"), mean("recall"), mean("ap50"), mean("ap50_95"), len(images), conf, convention
        )


def _joined(parts: Sequence[_Ranked]) -> _Ranked:
    """The images' predictions one after another, in image order."""
    if not parts:
        return _Ranked(np.zeros((0, 4)), np.zeros(0), np.zeros(0, np.int64), np.zeros((0, len(IOU_THRESHOLDS)), bool))
    return _Ranked(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("xyxy", "scores", "classes", "tp")))


def _ultralytics_aps(images: Sequence[_Ranked], n_gt: np.ndarray) -> np.ndarray:
    """(classes, thresholds) APs as ``yolo val``: one sort of every image's predictions by score, then per class.

    The sort is stable, so equal scores keep image order; ultralytics' unstable sort leaves their
    order to numpy's sorting kernel of the day, which no figure should depend on.
    """
    ranked = _joined(images)
    order = np.argsort(-ranked.scores, kind="stable")
    tp, classes = ranked.tp[order], ranked.classes[order]
    aps = np.zeros((len(n_gt), len(IOU_THRESHOLDS)))
    for c in np.flatnonzero(n_gt):
        hits = tp[classes == c]
        aps[c] = [_ultralytics_ap(hits[:, t], int(n_gt[c])) for t in range(len(IOU_THRESHOLDS))]
    return aps


def require_pycocotools() -> None:
    """Fail before any work when the COCO convention is asked for and pycocotools is not installed."""
    try:
        import pycocotools.cocoeval  # noqa: F401
    except ImportError:
        raise MissingDependency(
            "the COCO convention (edged eval --coco) needs pycocotools: pip install pycocotools"
        ) from None


def _coco_aps(images: Sequence[_Image], nc: int) -> np.ndarray:
    """(classes, thresholds) APs from pycocotools' COCOeval, on the images converted to COCO json in memory."""
    require_pycocotools()
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    def document(annotations: list[dict[str, object]]) -> dict[str, object]:
        # COCO ids start at 1: COCOeval reads an annotation id of 0 as "no match".
        return {
            "images": [{"id": i + 1} for i in range(len(images))],
            "categories": [{"id": c + 1} for c in range(nc)],
            "annotations": [{**a, "id": k + 1, "iscrowd": 0} for k, a in enumerate(annotations)],
        }

    def box(xyxy: np.ndarray) -> dict[str, object]:
        x1, y1, x2, y2 = (float(v) for v in xyxy)
        return {"bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1)}

    truth = [
        {"image_id": i + 1, "category_id": int(c) + 1, **box(b)}
        for i, im in enumerate(images)
        for b, c in zip(im.gt_xyxy, im.gt_cls, strict=True)
    ]
    found = [
        {"image_id": i + 1, "category_id": int(c) + 1, "score": float(s), **box(b)}
        for i, im in enumerate(images)
        for b, s, c in zip(im.ranked.xyxy, im.ranked.scores, im.ranked.classes, strict=True)
    ]
    with contextlib.redirect_stdout(io.StringIO()):  # COCO and COCOeval narrate every step on stdout
        coco_truth, coco_found = COCO(), COCO()
        coco_truth.dataset, coco_found.dataset = document(truth), document(found)
        coco_truth.createIndex()
        coco_found.createIndex()
        evaluation = COCOeval(coco_truth, coco_found, "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
    # precision: (thresholds, recall points, classes, area ranges, max detections); -1 where a class has no truth.
    precision = np.asarray(evaluation.eval["precision"], np.float64)[:, :, :, 0, -1]
    aps: np.ndarray = np.clip(precision, 0.0, None).mean(axis=1).T
    return aps
