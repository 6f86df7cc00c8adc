"""edged.tools.metrics: hand-computed cases in both conventions, the ultralytics convention against a
transcription of ultralytics' own formulas, and the COCO convention against pycocotools itself."""

from __future__ import annotations

import sys
import tracemalloc
from typing import Any

import numpy as np
import pytest
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from edged.errors import MissingDependency
from edged.tools.metrics import Convention, EvalReport, MetricAccumulator, box_iou, mask_iou, require_pycocotools

pytestmark = pytest.mark.tools

NAMES = ("scratch", "spot", "crack")
A = [0.0, 0.0, 10.0, 10.0]
B = [20.0, 0.0, 30.0, 10.0]

Image = tuple[list[Any], list[float], list[int], list[Any], list[int]]  # predictions, scores, classes; truth, classes
Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _arrays(image: Image) -> Arrays:
    pred, scores, pcls, gt, gcls = image
    return (
        np.array(pred, float).reshape(-1, 4),
        np.array(scores, float),
        np.array(pcls, int),
        np.array(gt, float).reshape(-1, 4),
        np.array(gcls, int),
    )


def _report(convention: Convention, *images: Image, conf: float = 0.25) -> EvalReport:
    acc = MetricAccumulator(NAMES)
    for image in images:
        acc.add(*_arrays(image))
    return acc.report(conf=conf, convention=convention)


def test_box_iou_values() -> None:
    ious = box_iou(np.array([A]), np.array([A, [5, 5, 15, 15], B, [3, 3, 3, 8]]))
    np.testing.assert_allclose(ious, [[1.0, 25 / 175, 0.0, 0.0]])
    assert box_iou(np.zeros((0, 4)), np.array([A])).shape == (0, 1)


# --- The COCO convention, by hand ---


def test_coco_perfect_predictions_score_one() -> None:
    rep = _report("coco", ([A, B], [0.9, 0.8], [0, 1], [A, B], [0, 1]), ([B], [0.7], [2], [B], [2]))
    assert rep.convention == "coco"
    assert rep.map50 == pytest.approx(1.0) and rep.map50_95 == pytest.approx(1.0)
    assert rep.precision == pytest.approx(1.0) and rep.recall == pytest.approx(1.0)
    assert rep.n_images == 2 and [m.n_gt for m in rep.per_class] == [1, 1, 1]


def test_coco_duplicate_prediction_is_one_tp_one_fp() -> None:
    # Ranked TP, FP (duplicate on A), TP (B): recall .5 .5 1, precision 1 .5 2/3.
    # Envelope 1 for recall points 0.00..0.50 (51 of them), 2/3 for 0.51..1.00 (50).
    rep = _report("coco", ([A, A, B], [0.9, 0.8, 0.7], [0, 0, 0], [A, B], [0, 0]))
    scratch = rep.per_class[0]
    assert scratch.ap50 == pytest.approx((51 + 50 * 2 / 3) / 101)
    assert scratch.precision == pytest.approx(2 / 3) and scratch.recall == pytest.approx(1.0)


def test_coco_map50_95_by_hand() -> None:
    # IoU 0.92 (score .9) is a TP at 0.50..0.90; IoU 0.72 (score .8) at 0.50..0.70 only.
    # 0.50..0.70 (5 thresholds): AP 1. 0.75..0.90 (4): ranked TP, FP -> 51/101. 0.95: 0.
    preds = [[20.0, 0.0, 30.0, 9.2], [0.0, 0.0, 9.0, 8.0]]
    rep = _report("coco", (preds, [0.9, 0.8], [1, 1], [A, B], [1, 1]))
    spot = rep.per_class[1]
    assert spot.ap50 == pytest.approx(1.0)
    assert spot.ap50_95 == pytest.approx((5 + 4 * 51 / 101) / 10)
    assert rep.map50_95 == pytest.approx(spot.ap50_95)


STRAY: Image = ([B], [0.5], [0], [], [])  # a false positive in an image without truth
HIT: Image = ([A], [0.5], [0], [A], [0])  # a true positive of the same score


def test_coco_equal_scores_keep_insertion_order() -> None:
    assert _report("coco", STRAY, HIT).per_class[0].ap50 == pytest.approx(0.5)
    assert _report("coco", HIT, STRAY).per_class[0].ap50 == pytest.approx(1.0)


# --- The ultralytics convention, by hand: trapezoid rule over the 101-point envelope ---


def test_ultralytics_perfect_predictions_score_0995() -> None:
    # Precision 1 up to recall 0.99, 0 at recall 1.00: 0.99 + half of the last 0.01 step.
    rep = _report("ultralytics", ([A, B], [0.9, 0.8], [0, 1], [A, B], [0, 1]), ([B], [0.7], [2], [B], [2]))
    assert rep.convention == "ultralytics"
    assert rep.map50 == pytest.approx(0.995) and rep.map50_95 == pytest.approx(0.995)
    assert rep.precision == pytest.approx(1.0) and rep.recall == pytest.approx(1.0)


def test_ultralytics_duplicate_prediction_by_hand() -> None:
    # Recall .5 .5 1, precision 1 .5 2/3; the curve at recall points 0.00..0.49 is 1, at 0.50..0.99
    # it is 2/3 (at 0.50 exactly the later of the two recall-0.5 points counts), at 1.00 it is 0.
    rep = _report("ultralytics", ([A, A, B], [0.9, 0.8, 0.7], [0, 0, 0], [A, B], [0, 0]))
    by_hand = 0.49 + 0.01 * (1 + 2 / 3) / 2 + 0.49 * 2 / 3 + 0.01 * (2 / 3) / 2
    assert rep.per_class[0].ap50 == pytest.approx(by_hand)
    assert rep.per_class[0].precision == pytest.approx(2 / 3)


def test_ultralytics_map50_95_by_hand() -> None:
    # 0.50..0.70 (5 thresholds): TP, TP -> 0.995. 0.75..0.90 (4): TP, FP, recall stops at 0.5 and
    # the curve is 1 over 0.00..0.49, 0 from 0.50 on -> 0.49 + 0.005. 0.95: FP, FP -> 0.
    preds = [[20.0, 0.0, 30.0, 9.2], [0.0, 0.0, 9.0, 8.0]]
    rep = _report("ultralytics", (preds, [0.9, 0.8], [1, 1], [A, B], [1, 1]))
    spot = rep.per_class[1]
    assert spot.ap50 == pytest.approx(0.995)
    assert spot.ap50_95 == pytest.approx((5 * 0.995 + 4 * 0.495) / 10)


def test_ultralytics_equal_scores_keep_image_order() -> None:
    # FP, TP: the curve is 0.5 from recall 0.00 to 0.99, 0 at 1.00 -> 0.495 + 0.0025. TP, FP: 0.995.
    assert _report("ultralytics", STRAY, HIT).per_class[0].ap50 == pytest.approx(0.4975)
    assert _report("ultralytics", HIT, STRAY).per_class[0].ap50 == pytest.approx(0.995)


# --- What both conventions share ---


@pytest.mark.parametrize("convention", ["ultralytics", "coco"])
def test_no_predictions_score_zero(convention: Convention) -> None:
    rep = _report(convention, ([], [], [], [A, B], [0, 1]))
    assert rep.map50 == 0.0 and rep.map50_95 == 0.0 and rep.recall == 0.0
    assert rep.per_class[0].n_pred == 0 and rep.per_class[0].precision == 0.0


@pytest.mark.parametrize("convention", ["ultralytics", "coco"])
def test_nothing_added_scores_zero(convention: Convention) -> None:
    rep = MetricAccumulator(NAMES).report(convention=convention)
    assert rep.n_images == 0 and rep.map50 == 0.0 and [m.n_gt for m in rep.per_class] == [0, 0, 0]


@pytest.mark.parametrize(("convention", "perfect"), [("ultralytics", 0.995), ("coco", 1.0)])
def test_class_without_ground_truth_is_left_out_of_means(convention: Convention, perfect: float) -> None:
    rep = _report(convention, ([A, B], [0.9, 0.9], [0, 2], [A], [0]))
    crack = rep.per_class[2]
    assert crack.n_gt == 0 and crack.n_pred == 1 and crack.precision == 0.0 and crack.ap50 == 0.0
    assert rep.map50 == pytest.approx(perfect) and rep.precision == pytest.approx(1.0)


@pytest.mark.parametrize("convention", ["ultralytics", "coco"])
def test_conf_threshold_limits_precision_and_recall(convention: Convention) -> None:
    rep = _report(convention, ([A, B], [0.9, 0.1], [0, 0], [A, B], [0, 0]), conf=0.5)
    scratch = rep.per_class[0]
    assert scratch.n_pred == 1 and scratch.precision == 1.0 and scratch.recall == 0.5
    assert scratch.ap50 == pytest.approx(0.995 if convention == "ultralytics" else 1.0)


def test_precision_and_recall_count_the_published_predictions() -> None:
    # AP ranks a second class on A (spot, a hit) that the published boxes, one class each, lack.
    acc = MetricAccumulator(NAMES)
    ranked = (np.array([A, A]), np.array([0.9, 0.6]), np.array([0, 1]))
    published = (np.array([A]), np.array([0.9]), np.array([0]))
    acc.add(*ranked, np.array([A, A]), np.array([0, 1]), published=published)
    rep = acc.report(conf=0.25)
    scratch, spot = rep.per_class[0], rep.per_class[1]
    assert spot.ap50 == pytest.approx(0.995) and scratch.ap50 == pytest.approx(0.995)
    assert (spot.n_pred, spot.recall) == (0, 0.0) and (scratch.n_pred, scratch.recall) == (1, 1.0)


def test_rejects_bad_input() -> None:
    acc = MetricAccumulator(NAMES)
    with pytest.raises(ValueError):
        acc.add(np.zeros((1, 4)), np.zeros(2), np.zeros(1, int), np.zeros((0, 4)), np.zeros(0))
    with pytest.raises(ValueError):
        acc.add(np.zeros((1, 4)), np.zeros(1), np.array([3]), np.zeros((0, 4)), np.zeros(0))
    with pytest.raises(ValueError):
        acc.add(np.zeros((0, 4)), np.zeros(0), np.zeros(0), np.zeros((1, 4)), np.zeros(2))
    with pytest.raises(ValueError):
        published = (np.zeros((1, 4)), np.zeros(1), np.array([-1]))
        acc.add(np.zeros((0, 4)), np.zeros(0), np.zeros(0), np.zeros((0, 4)), np.zeros(0), published=published)


def test_coco_without_pycocotools_is_a_missing_dependency(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pycocotools", None)
    monkeypatch.setitem(sys.modules, "pycocotools.cocoeval", None)
    with pytest.raises(MissingDependency, match="pip install pycocotools"):
        require_pycocotools()
    with pytest.raises(MissingDependency):
        _report("coco", ([A], [0.9], [0], [A], [0]))
    assert _report("ultralytics", ([A], [0.9], [0], [A], [0])).map50 == pytest.approx(0.995)


# --- Against the references, on random prediction sets ---


def _random_images(seed: int, n_images: int = 12) -> list[Arrays]:
    """Images with truth of classes 0 and 1 (2 never), predictions near it, duplicates, strays and
    other-class guesses; one image with 150 predictions of one class (past COCOeval's 100)."""
    rng = np.random.default_rng(seed)
    images = []
    for index in range(n_images):
        n_gt = int(rng.integers(0, 6))
        xy = rng.uniform(0, 400, (n_gt, 2))
        gt = np.concatenate([xy, xy + rng.uniform(8, 120, (n_gt, 2))], axis=1)
        gt_cls = rng.integers(0, 2, n_gt)
        picked = rng.integers(0, n_gt, 3 * n_gt) if n_gt else np.zeros(0, int)
        near = gt[picked] + rng.normal(0, 4, (len(picked), 4))
        stray_xy = rng.uniform(0, 400, (int(rng.integers(0, 5)), 2))
        strays = np.concatenate([stray_xy, stray_xy + rng.uniform(8, 60, stray_xy.shape)], axis=1)
        pred = np.concatenate([near, strays])
        pred_cls = np.concatenate([gt_cls[picked], rng.integers(0, 3, len(strays))])
        flip = rng.random(len(pred)) < 0.15
        pred_cls = np.where(flip, (pred_cls + 1) % 3, pred_cls).astype(int)
        scores = rng.uniform(0.001, 1.0, len(pred))
        if index == 3:
            many_xy = rng.uniform(0, 400, (150, 2))
            pred = np.concatenate([pred, np.concatenate([many_xy, many_xy + 30], axis=1)])
            pred_cls = np.concatenate([pred_cls, np.zeros(150, int)])
            scores = np.concatenate([scores, rng.uniform(0.001, 0.3, 150)])
        order = np.argsort(-scores)
        images.append((pred[order], scores[order], pred_cls[order], gt, gt_cls))
    return images


def _iou_gt_pred(gt: np.ndarray, pred: np.ndarray) -> np.ndarray:
    """(M, N) IoU, written apart from edged's box_iou."""
    out = np.zeros((len(gt), len(pred)))
    for i, g in enumerate(gt):
        for j, p in enumerate(pred):
            w = min(g[2], p[2]) - max(g[0], p[0])
            h = min(g[3], p[3]) - max(g[1], p[1])
            inter = max(w, 0.0) * max(h, 0.0)
            union = (g[2] - g[0]) * (g[3] - g[1]) + (p[2] - p[0]) * (p[3] - p[1]) - inter
            out[i, j] = inter / union
    return out


def _ultralytics_reference(images: list[Arrays]) -> dict[int, np.ndarray]:
    """ultralytics 8.4: `DetectionValidator.match_predictions` (its greedy default), `ap_per_class`,
    `compute_ap`, transcribed; per class with truth, its AP at the ten IoU thresholds."""
    iouv = np.linspace(0.5, 0.95, 10)
    tps, confs, pred_classes, target_classes = [], [], [], []
    for pred, scores, pcls, gt, gcls in images:
        correct = np.zeros((len(pred), len(iouv)), bool)
        if len(gt) and len(pred):
            iou = _iou_gt_pred(gt, pred) * (gcls[:, None] == pcls)
            matched = np.zeros((len(gt), len(iouv)), bool)
            for j in np.flatnonzero((iou >= iouv.min()).any(0)):
                available = np.where(matched, 0, iou[:, j, None])
                k = available.argmax(0)
                correct[j] = available[k, range(len(iouv))] >= iouv
                matched[k, range(len(iouv))] |= correct[j]
        tps.append(correct)
        confs.append(scores)
        pred_classes.append(pcls)
        target_classes.append(gcls)
    tp, conf, pred_cls = np.concatenate(tps), np.concatenate(confs), np.concatenate(pred_classes)
    target_cls = np.concatenate(target_classes)
    i = np.argsort(-conf)
    tp, conf, pred_cls = tp[i], conf[i], pred_cls[i]
    unique_classes, nt = np.unique(target_cls, return_counts=True)
    ap = np.zeros((len(unique_classes), tp.shape[1]))
    x = np.linspace(0, 1, 101)
    for ci, c in enumerate(unique_classes):
        i = pred_cls == c
        if i.sum() == 0:
            continue
        fpc = (1 - tp[i]).cumsum(0)
        tpc = tp[i].cumsum(0)
        recall = tpc / (nt[ci] + 1e-16)
        precision = tpc / (tpc + fpc)
        for t in range(tp.shape[1]):
            mrec = np.concatenate(([0.0], recall[:, t], [recall[-1, t]], [1.0]))
            mpre = np.concatenate(([1.0], precision[:, t], [0.0], [0.0]))
            mpre = np.flip(np.maximum.accumulate(np.flip(mpre)))
            y = np.interp(x, mrec, mpre)
            ap[ci, t] = ((y[1:] + y[:-1]) * np.diff(x)).sum() / 2  # np.trapezoid(y, x)
    return {int(c): ap[ci] for ci, c in enumerate(unique_classes)}


def _pycocotools_reference(images: list[Arrays]) -> tuple[float, float, dict[int, tuple[float, float]]]:
    """COCOeval the usual way (json-like dicts, `loadRes`, `summarize`): AP50, AP, and per class."""
    truth = COCO()
    truth.dataset = {
        "images": [{"id": 100 + i, "width": 1000, "height": 1000} for i in range(len(images))],
        "categories": [{"id": 10 + c, "name": name} for c, name in enumerate(NAMES)],
        "annotations": [
            {"id": len(images) * k + i + 1, "image_id": 100 + i, "category_id": 10 + int(c), "iscrowd": 0, "area": 0.0}
            | {"bbox": [g[0], g[1], g[2] - g[0], g[3] - g[1]]}
            for i, (_, _, _, gt, gcls) in enumerate(images)
            for k, (g, c) in enumerate(zip(gt.tolist(), gcls, strict=True))
        ],
    }
    for ann in truth.dataset["annotations"]:
        ann["area"] = ann["bbox"][2] * ann["bbox"][3]
    truth.createIndex()
    results = [
        {"image_id": 100 + i, "category_id": 10 + int(c), "bbox": [p[0], p[1], p[2] - p[0], p[3] - p[1]], "score": float(s)}
        for i, (pred, scores, pcls, _, _) in enumerate(images)
        for p, s, c in zip(pred.tolist(), scores, pcls, strict=True)
    ]
    evaluation = COCOeval(truth, truth.loadRes(results), "bbox")
    evaluation.evaluate()
    evaluation.accumulate()
    evaluation.summarize()
    precision = evaluation.eval["precision"][:, :, :, 0, 2]  # area all, 100 detections
    per_class = {
        k: (float(precision[0, :, k].mean()), float(precision[:, :, k].mean()))
        for k in range(len(NAMES))
        if (precision[:, :, k] > -1).all()
    }
    return float(evaluation.stats[1]), float(evaluation.stats[0]), per_class


def _accumulated(images: list[Arrays]) -> MetricAccumulator:
    acc = MetricAccumulator(NAMES)
    for image in images:
        acc.add(*image)
    return acc


@pytest.mark.parametrize("seed", range(6))
def test_ultralytics_convention_equals_ultralytics_formulas(seed: int) -> None:
    images = _random_images(seed)
    reference = _ultralytics_reference(images)
    rep = _accumulated(images).report(convention="ultralytics")
    for c, aps in reference.items():
        assert rep.per_class[c].ap50 == pytest.approx(aps[0], abs=1e-12)
        assert rep.per_class[c].ap50_95 == pytest.approx(aps.mean(), abs=1e-12)
    assert rep.map50 == pytest.approx(np.mean([aps[0] for aps in reference.values()]), abs=1e-12)
    assert rep.map50_95 == pytest.approx(np.mean([aps.mean() for aps in reference.values()]), abs=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_coco_convention_equals_pycocotools(seed: int) -> None:
    images = _random_images(seed)
    ap50, ap, per_class = _pycocotools_reference(images)
    rep = _accumulated(images).report(convention="coco")
    assert rep.map50 == pytest.approx(ap50, abs=1e-12) and rep.map50_95 == pytest.approx(ap, abs=1e-12)
    assert sorted(per_class) == [m_index for m_index, m in enumerate(rep.per_class) if m.n_gt > 0]
    for c, (class_ap50, class_ap) in per_class.items():
        assert rep.per_class[c].ap50 == pytest.approx(class_ap50, abs=1e-12)
        assert rep.per_class[c].ap50_95 == pytest.approx(class_ap, abs=1e-12)


def test_mask_iou_of_many_masks_is_exact_without_a_float64_copy_of_them() -> None:
    # A densely labelled image's masks were copied whole into float64: 5000 at 160x160 took a gigabyte.
    rng = np.random.default_rng(0)
    predicted, truth = rng.random((8, 160 * 160)) > 0.5, rng.random((1000, 160 * 160)) > 0.7
    tracemalloc.start()
    try:
        iou = mask_iou(predicted, truth)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20  # the float64 copy alone is 205 MB
    inter = (predicted[:, None, :] & truth[None, :50, :]).sum(axis=2)
    union = (predicted[:, None, :] | truth[None, :50, :]).sum(axis=2)
    np.testing.assert_array_equal(iou[:, :50], inter / union)
    assert mask_iou(predicted, truth[:0]).shape == (8, 0)
