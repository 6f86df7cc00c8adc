"""Hand-computed cases for edged.tools.metrics (COCO-style matching, 101-point AP)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from edged.tools.metrics import MetricAccumulator, average_precision, box_iou

pytestmark = pytest.mark.tools

NAMES = ("scratch", "spot", "crack")
A = [0.0, 0.0, 10.0, 10.0]
B = [20.0, 0.0, 30.0, 10.0]


Image = tuple[list[Any], list[float], list[int], list[Any], list[int]]  # predictions, scores, classes; truth, classes


def _acc(*images: Image) -> MetricAccumulator:
    acc = MetricAccumulator(NAMES)
    for pred, scores, pcls, gt, gcls in images:
        acc.add(
            np.array(pred).reshape(-1, 4),
            np.array(scores),
            np.array(pcls, int),
            np.array(gt).reshape(-1, 4),
            np.array(gcls, int),
        )
    return acc


def test_box_iou_values() -> None:
    ious = box_iou(np.array([A]), np.array([A, [5, 5, 15, 15], B, [3, 3, 3, 8]]))
    np.testing.assert_allclose(ious, [[1.0, 25 / 175, 0.0, 0.0]])
    assert box_iou(np.zeros((0, 4)), np.array([A])).shape == (0, 1)


def test_perfect_predictions_score_one() -> None:
    acc = _acc(([A, B], [0.9, 0.8], [0, 1], [A, B], [0, 1]), ([B], [0.7], [2], [B], [2]))
    rep = acc.report(conf=0.25)
    assert rep.map50 == pytest.approx(1.0) and rep.map50_95 == pytest.approx(1.0)
    assert rep.precision == pytest.approx(1.0) and rep.recall == pytest.approx(1.0)
    assert rep.n_images == 2 and [m.n_gt for m in rep.per_class] == [1, 1, 1]


def test_no_predictions_score_zero() -> None:
    rep = _acc(([], [], [], [A, B], [0, 1])).report(conf=0.25)
    assert rep.map50 == 0.0 and rep.map50_95 == 0.0 and rep.recall == 0.0
    assert rep.per_class[0].n_pred == 0 and rep.per_class[0].precision == 0.0


def test_class_without_ground_truth_is_left_out_of_means() -> None:
    rep = _acc(([A, B], [0.9, 0.9], [0, 2], [A], [0])).report(conf=0.25)
    crack = rep.per_class[2]
    assert crack.n_gt == 0 and crack.n_pred == 1 and crack.precision == 0.0
    assert rep.map50 == pytest.approx(1.0) and rep.precision == pytest.approx(1.0)


def test_duplicate_prediction_is_one_tp_one_fp() -> None:
    # Ranked TP, FP (duplicate on A), TP (B): recall .5 .5 1, precision 1 .5 2/3.
    # Envelope 1 for recall points 0.00..0.50 (51 of them), 2/3 for 0.51..1.00 (50).
    rep = _acc(([A, A, B], [0.9, 0.8, 0.7], [0, 0, 0], [A, B], [0, 0])).report(conf=0.25)
    scratch = rep.per_class[0]
    assert scratch.ap50 == pytest.approx((51 + 50 * 2 / 3) / 101)
    assert scratch.precision == pytest.approx(2 / 3) and scratch.recall == pytest.approx(1.0)


def test_map50_95_by_hand() -> None:
    # IoU 0.92 (score .9) is a TP at 0.50..0.90; IoU 0.72 (score .8) at 0.50..0.70 only.
    # 0.50..0.70 (5 thresholds): AP 1. 0.75..0.90 (4): ranked TP, FP -> 51/101. 0.95: 0.
    gts = [A, B]
    preds = [[20.0, 0.0, 30.0, 9.2], [0.0, 0.0, 9.0, 8.0]]
    rep = _acc((preds, [0.9, 0.8], [1, 1], gts, [1, 1])).report(conf=0.25)
    spot = rep.per_class[1]
    assert spot.ap50 == pytest.approx(1.0)
    assert spot.ap50_95 == pytest.approx((5 + 4 * 51 / 101) / 10)
    assert rep.map50_95 == pytest.approx(spot.ap50_95)


def test_equal_scores_keep_insertion_order() -> None:
    assert average_precision(np.array([False, True]), np.array([0.5, 0.5]), 1) == 0.5
    assert average_precision(np.array([True, False]), np.array([0.5, 0.5]), 1) == 1.0


def test_conf_threshold_limits_precision_and_recall() -> None:
    rep = _acc(([A, B], [0.9, 0.1], [0, 0], [A, B], [0, 0])).report(conf=0.5)
    scratch = rep.per_class[0]
    assert scratch.n_pred == 1 and scratch.precision == 1.0 and scratch.recall == 0.5
    assert scratch.ap50 == pytest.approx(1.0)


def test_rejects_bad_input() -> None:
    acc = MetricAccumulator(NAMES)
    with pytest.raises(ValueError):
        acc.add(np.zeros((1, 4)), np.zeros(2), np.zeros(1, int), np.zeros((0, 4)), np.zeros(0))
    with pytest.raises(ValueError):
        acc.add(np.zeros((1, 4)), np.zeros(1), np.array([3]), np.zeros((0, 4)), np.zeros(0))
