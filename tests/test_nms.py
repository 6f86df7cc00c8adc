"""Tests for edged.nms: greedy suppression rules, ordering, max_det, max_nms, class awareness, ranking."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from allocations import NumpyAllocations
from hypothesis import given, settings
from hypothesis import strategies as st

from edged.nms import MAX_WH, PAIRWISE_MAX, GreedyNms, float32_threshold


def _iou(a: list[float], b: list[float]) -> float:
    """Reference IoU of two x1 y1 x2 y2 boxes, written out plainly."""
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _reference_nms(boxes: list[list[float]], scores: list[float], iou: float) -> list[int]:
    """Textbook greedy NMS over all candidates in Python, to compare against."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    keep: list[int] = []
    for i in order:
        if all(_iou(boxes[i], boxes[k]) <= iou for k in keep):
            keep.append(i)
    return keep


def run_nms(
    boxes: Any,
    scores: Any,
    iou: float | None,
    *,
    class_ids: Any = None,
    max_det: int | None = None,
    max_nms: int | None = None,
    capacity: int = 64,
) -> list[int]:
    """Indices kept by a `GreedyNms` (agnostic unless ``class_ids`` is given) for these candidates."""
    xyxy = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    k = len(xyxy)
    limit = max_det or max(k, 1)
    cap = {} if max_nms is None else {"max_nms": max_nms}
    nms = GreedyNms(capacity, iou, max_det=limit, agnostic=class_ids is None, **cap)
    ids = np.zeros(k, np.intp) if class_ids is None else np.asarray(class_ids, np.intp)
    keep = np.full(limit, -1, dtype=np.intp)
    n = nms(np.ascontiguousarray(xyxy.T), np.asarray(scores, np.float32).copy(), ids, keep)
    assert (keep[n:] == -1).all()
    return [int(i) for i in keep[:n]]


@pytest.mark.parametrize(
    ("boxes", "scores", "iou", "max_det", "expected"),
    [
        # IoU(0, 1) = 81 / 119 = 0.68 > 0.45: the lower-scored box 1 goes, disjoint box 2 stays.
        ([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30]], [0.9, 0.8, 0.7], 0.45, None, [0, 2]),
        # The same pair survives a looser threshold: 0.68 <= 0.7.
        ([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30]], [0.9, 0.8, 0.7], 0.7, None, [0, 1, 2]),
        # Disjoint boxes come back highest score first.
        ([[0, 0, 1, 1], [2, 2, 3, 3], [4, 4, 5, 5]], [0.3, 0.9, 0.5], 0.45, None, [1, 2, 0]),
        # IoU exactly 0.5 (50 / 100) is not suppressed at iou=0.5: suppression is strict.
        ([[0, 0, 10, 10], [0, 0, 10, 5]], [0.9, 0.8], 0.5, None, [0, 1]),
        # ... and is suppressed just below it.
        ([[0, 0, 10, 10], [0, 0, 10, 5]], [0.9, 0.8], 0.49, None, [0]),
        # max_det keeps the two best of four disjoint boxes.
        ([[0, 0, 1, 1], [2, 2, 3, 3], [4, 4, 5, 5], [6, 6, 7, 7]], [0.1, 0.4, 0.3, 0.2], 0.45, 2, [1, 2]),
        # Equal scores keep input order; of two identical boxes the first wins.
        ([[0, 0, 10, 10], [0, 0, 10, 10], [20, 20, 30, 30]], [0.5, 0.5, 0.5], 0.45, None, [0, 2]),
        # Chain A-B-C: B (IoU 1/3 with A) is suppressed by A, so C (IoU 0 with A) survives.
        ([[0, 0, 10, 10], [5, 0, 15, 10], [10, 0, 20, 10]], [0.9, 0.8, 0.7], 0.3, None, [0, 2]),
        # Two empty boxes have union 0, count as not overlapping and do not divide by zero.
        ([[5, 5, 5, 5], [5, 5, 5, 5]], [0.9, 0.8], 0.45, None, [0, 1]),
        # No candidates, no work.
        (np.empty((0, 4)), [], 0.45, None, []),
    ],
)
def test_nms_table(boxes: Any, scores: list[float], iou: float, max_det: int | None, expected: list[int]) -> None:
    assert run_nms(boxes, scores, iou, max_det=max_det) == expected


@pytest.mark.parametrize(
    ("boxes", "class_ids", "expected"),
    [
        # Heavily overlapping boxes of different classes both stay.
        ([[0, 0, 10, 10], [1, 1, 11, 11]], [0, 1], [0, 1]),
        # The same pair in one class: the lower score goes.
        ([[0, 0, 10, 10], [1, 1, 11, 11]], [3, 3], [0]),
        # Negative coordinates: classes stay apart wherever the boxes lie.
        ([[-50, -50, -40, -40], [-49, -49, -39, -39]], [0, 1], [0, 1]),
        ([[-50, -50, -40, -40], [-49, -49, -39, -39]], [0, 0], [0]),
        # Only boxes of one class are compared: the class-1 pair is disjoint, the class-0 box alone.
        ([[100, 0, 110, 10], [0, 0, 10, 10], [0, 100, 10, 110]], [0, 1, 1], [0, 1, 2]),
    ],
)
def test_class_aware_table(boxes: list[list[float]], class_ids: list[int], expected: list[int]) -> None:
    scores = np.linspace(0.9, 0.5, len(boxes))
    assert run_nms(boxes, scores, 0.45, class_ids=class_ids) == expected


def test_classes_are_kept_apart_by_ultralytics_offset() -> None:
    # Each class's boxes are shifted by class x MAX_WH in float32 before comparing, as ultralytics
    # does: two identical 0.0004-wide boxes overlap fully in class 0, but at class 2's shift of
    # 15360 their width rounds to zero, so they are two empty boxes that suppress nothing.
    thin = [[0.0, 0.0, 0.0004, 10.0]] * 2
    assert run_nms(thin, [0.9, 0.8], 0.45, class_ids=[0, 0]) == [0]
    assert run_nms(thin, [0.9, 0.8], 0.45, class_ids=[2, 2]) == [0, 1]
    # Boxes larger than the shift reach into the next class, as they do in ultralytics.
    w = float(MAX_WH)
    wide = [[0.0, 0.0, 2 * w, 2 * w], [w, w, 3 * w, 3 * w]]
    assert run_nms(wide, [0.9, 0.8], 0.45, class_ids=[0, 0]) == [0, 1]  # IoU 1/7 within one class
    assert run_nms(wide, [0.9, 0.8], 0.45, class_ids=[1, 0]) == [0]  # IoU 1 once class 1 is shifted


@pytest.mark.parametrize("iou", [0.3, 0.45, 0.5, 0.6, 0.7, 0.1 + 0.2, 0.95])
def test_threshold_compares_as_torchvision_does(iou: float) -> None:
    # torchvision compares the float32 IoU with the threshold as a double; float32 0.3 is above 0.3.
    t = float32_threshold(iou)
    near = np.float32(iou) + np.arange(-3, 4, dtype=np.float32) * np.spacing(np.float32(iou))
    np.testing.assert_array_equal(near > t, near.astype(np.float64) > iou)


@pytest.mark.parametrize(
    ("boxes", "scores", "max_nms", "expected"),
    [
        # Only the two best candidates enter NMS, so the third-best never comes out.
        ([[0, 0, 1, 1], [2, 2, 3, 3], [4, 4, 5, 5], [6, 6, 7, 7]], [0.1, 0.4, 0.3, 0.2], 2, [1, 2]),
        # A suppressed box still counts towards max_nms: C is fourth by score, outside the cut.
        ([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30], [40, 40, 50, 50]], [0.9, 0.8, 0.1, 0.7], 3, [0, 3]),
        # Ties at the cut stay in.
        ([[0, 0, 1, 1], [2, 2, 3, 3], [4, 4, 5, 5]], [0.5, 0.4, 0.4], 2, [0, 1, 2]),
        # Candidates already at -inf do not count.
        ([[0, 0, 1, 1], [2, 2, 3, 3], [4, 4, 5, 5]], [0.5, -np.inf, 0.4], 2, [0, 2]),
    ],
)
def test_max_nms_keeps_only_the_best_candidates(
    boxes: list[list[float]], scores: list[float], max_nms: int, expected: list[int]
) -> None:
    assert run_nms(boxes, scores, 0.45, max_nms=max_nms) == expected


def test_minus_infinity_scores_are_never_kept() -> None:
    boxes = [[0, 0, 10, 10], [20, 20, 30, 30], [40, 40, 50, 50]]
    assert run_nms(boxes, [0.5, -np.inf, 0.7], 0.45) == [2, 0]
    assert run_nms(boxes, [-np.inf] * 3, 0.45) == []


def test_rank_only_keeps_overlaps_in_score_order() -> None:
    # iou=None: NMS already ran inside the model; only the max_det best remain, best first.
    boxes = [[0, 0, 10, 10]] * 4
    assert run_nms(boxes, [0.2, 0.9, 0.5, 0.9], None, max_det=3) == [1, 3, 2]


def test_kept_order_is_written_and_the_rest_of_keep_left_alone() -> None:
    nms = GreedyNms(4, 0.45, max_det=4)
    xyxy = np.ascontiguousarray(np.array([[0, 0, 10, 10], [1, 1, 11, 11]], np.float32).T)
    keep = np.full(4, -1, np.intp)
    assert nms(xyxy, np.array([0.8, 0.9], np.float32), np.zeros(2, np.intp), keep) == 1
    assert keep.tolist() == [1, -1, -1, -1]


def test_more_candidates_than_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity of 2"):
        run_nms([[0, 0, 1, 1]] * 3, [0.5] * 3, 0.45, capacity=2)


@pytest.mark.parametrize(("iou", "max_det", "max_nms"), [(0.0, 1, 10), (1.5, 1, 10), (0.5, 0, 10), (0.5, 1, 0)])
def test_bad_settings_are_refused(iou: float, max_det: int, max_nms: int) -> None:
    with pytest.raises(ValueError):
        GreedyNms(4, iou, max_det=max_det, max_nms=max_nms)


_box = st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(1, 25), st.integers(1, 25)).map(
    lambda b: [float(b[0]), float(b[1]), float(b[0] + b[2]), float(b[1] + b[3])]
)
# Thresholds and integer coordinates that are exact in binary, so the reference's division
# and the implementation's multiplication agree even on IoU ties.
_iou_threshold = st.sampled_from([0.25, 0.5, 0.75, 1.0])
_score = st.sampled_from([0.1, 0.3, 0.5, 0.9])


@settings(max_examples=50, deadline=None)
@given(
    candidates=st.lists(st.tuples(_box, _score, st.integers(0, 2)), max_size=30),
    iou=_iou_threshold,
)
def test_nms_matches_reference(candidates: list[tuple[list[float], float, int]], iou: float) -> None:
    boxes = [c[0] for c in candidates]
    scores = [c[1] for c in candidates]
    assert run_nms(boxes, scores, iou) == _reference_nms(boxes, scores, iou)


@settings(max_examples=50, deadline=None)
@given(
    candidates=st.lists(st.tuples(_box, _score, st.integers(0, 2)), max_size=30),
    iou=_iou_threshold,
    max_det=st.integers(1, 5),
)
def test_class_aware_nms_matches_per_class_reference(
    candidates: list[tuple[list[float], float, int]], iou: float, max_det: int
) -> None:
    boxes = [c[0] for c in candidates]
    scores = [c[1] for c in candidates]
    classes = [c[2] for c in candidates]
    per_class: list[int] = []
    for cls in set(classes):
        members = [i for i, c in enumerate(classes) if c == cls]
        kept = _reference_nms([boxes[i] for i in members], [scores[i] for i in members], iou)
        per_class += [members[k] for k in kept]
    expected = sorted(per_class, key=lambda i: (-scores[i], i))[:max_det]
    assert run_nms(boxes, scores, iou, class_ids=classes, max_det=max_det) == expected


@settings(max_examples=50, deadline=None)
@given(
    boxes=st.lists(_box, max_size=30),
    iou=_iou_threshold,
    max_nms=st.integers(1, 20),
    seed=st.integers(0, 2**32 - 1),
)
def test_max_nms_matches_cutting_first(boxes: list[list[float]], iou: float, max_nms: int, seed: int) -> None:
    # ultralytics sorts, keeps the max_nms best and runs NMS on those: the same boxes come out.
    scores = np.random.default_rng(seed).permutation(len(boxes)).astype(np.float32) / 32 + 0.1  # distinct
    best = sorted(range(len(boxes)), key=lambda i: -scores[i])[:max_nms]
    kept = _reference_nms([boxes[i] for i in best], [float(scores[i]) for i in best], iou)
    assert run_nms(boxes, scores, iou, max_nms=max_nms) == [best[k] for k in kept]


_fine_box = st.tuples(*[st.floats(0, 60, width=32)] * 2, *[st.floats(0, 30, width=32)] * 2).map(
    lambda b: [b[0], b[1], b[0] + b[2], b[1] + b[3]]
)


@settings(max_examples=60, deadline=None)
@given(
    candidates=st.lists(
        st.tuples(_fine_box, st.sampled_from([0.2, 0.5, 0.5, 0.9, -np.inf]), st.integers(0, 2)), max_size=40
    ),
    iou=st.floats(0.05, 1.0),
    max_det=st.integers(1, 40),
    agnostic=st.booleans(),
)
def test_many_candidates_walk_one_box_at_a_time_and_keep_what_few_keep_at_once(
    candidates: list[tuple[list[float], float, int]], iou: float, max_det: int, agnostic: bool
) -> None:
    # Past PAIRWISE_MAX candidates NMS suppresses around each kept box in turn; the same candidates
    # followed by enough that can never be kept must come out the same as the few alone, with
    # fractional corners, empty boxes, ties and thresholds that fall between float32 values.
    boxes = [c[0] for c in candidates]
    scores = [c[1] for c in candidates]
    classes = None if agnostic else [c[2] for c in candidates]
    pad = PAIRWISE_MAX + 1
    few = run_nms(boxes, scores, iou, class_ids=classes, max_det=max_det, capacity=len(boxes) + pad)
    many = run_nms(
        boxes + [[0.0, 0.0, 10.0, 10.0]] * pad,
        scores + [-np.inf] * pad,
        iou,
        class_ids=None if classes is None else classes + [0] * pad,
        max_det=max_det,
        capacity=len(boxes) + pad,
    )
    assert few == many


@pytest.mark.parametrize(
    ("candidates", "agnostic", "max_nms"),
    [(100, False, 1000), (100, True, 1000), (100, False, 60), (PAIRWISE_MAX + 72, False, 1000)],
)
def test_a_call_creates_no_arrays(candidates: int, agnostic: bool, max_nms: int) -> None:
    counter = NumpyAllocations.get()
    assert counter is not None
    rng = np.random.default_rng(0)
    corner = rng.uniform(0, 600, (2, candidates)).astype(np.float32)
    xyxy = np.concatenate([corner, corner + rng.uniform(5, 80, (2, candidates)).astype(np.float32)])
    classes = rng.integers(0, 3, candidates).astype(np.intp)
    nms = GreedyNms(candidates, 0.45, max_det=50, agnostic=agnostic, max_nms=max_nms)
    keep = np.empty(50, np.intp)
    scores = rng.uniform(0.3, 1, candidates).astype(np.float32)
    work = scores.copy()
    kept = nms(xyxy, work, classes, keep)
    with counter.counting():
        before = counter.buffers
        np.copyto(work, scores)
        assert nms(xyxy, work, classes, keep) == kept > 1
        assert counter.buffers == before
