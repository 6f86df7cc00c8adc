"""Tests for edged.decode: every head format through the decoder, the order of NMS and mapping, hostile input."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from allocations import NumpyAllocations
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from ultralytics_reference import Boxes, differences, predict

from edged.decode import Decoder, Detections
from edged.errors import HeadError
from edged.geometry import BoxMap
from edged.heads.registry import HEADS

# 1280x720 into 640x640: scale 0.5, content 640x360, pad_x 0, pad_y 140.
LETTERBOX = BoxMap.letterbox(1280, 720, 640, 640)
# 1280x960 stretched to 640x640: scale_x 0.5, scale_y 2/3, no padding.
STRETCH = BoxMap.stretch(1280, 960, 640, 640)
NC = 3
N = 8
SHAPES: dict[str, tuple[int, int, int]] = {
    "yolov8": (1, 4 + NC, N),
    "yolov5": (1, N, 5 + NC),
    "end2end": (1, N, 6),
    "rtdetr": (1, N, 6),
}

# Candidates in input pixels: x1 y1 x2 y2, score, class.
SCENE = [
    (270.0, 295.0, 370.0, 345.0, 0.9, 1),  # well inside the content
    (-10.0, 130.0, 50.0, 190.0, 0.5, 0),  # sticks out of the top-left corner
    (100.0, 400.0, 140.0, 440.0, 0.2, 2),  # below conf 0.25
]
# x1 y1 x2 y2 score class; the class is a float so end2end rows can carry bad ids.
Candidate = tuple[float, float, float, float, float, float]


def yolov8_tensor(candidates: Sequence[Candidate], nc: int = NC, n: int = N) -> np.ndarray:
    """[1, 4+nc, n]: cx cy w h, then class scores (0.1 for the other classes)."""
    out = np.zeros((1, 4 + nc, n), dtype=np.float32)
    for j, (x1, y1, x2, y2, score, cls) in enumerate(candidates):
        out[0, :4, j] = [(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1]
        out[0, 4:, j] = 0.1
        out[0, 4 + int(cls), j] = score
    return out


def segment_tensor(candidates: Sequence[Candidate], nc: int = NC, n: int = N) -> np.ndarray:
    """[1, 4+nc+32, n]: yolov8's rows, then 32 mask coefficients (here 0)."""
    return np.concatenate([yolov8_tensor(candidates, nc, n), np.zeros((1, 32, n), np.float32)], axis=1)


def yolov5_tensor(candidates: Sequence[Candidate], nc: int = NC, n: int = N) -> np.ndarray:
    """[1, n, 5+nc]: cx cy w h, objectness = score, class prob 1 (0.5 for the others)."""
    out = np.zeros((1, n, 5 + nc), dtype=np.float32)
    for j, (x1, y1, x2, y2, score, cls) in enumerate(candidates):
        out[0, j, :5] = [(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1, score]
        out[0, j, 5:] = 0.5
        out[0, j, 5 + int(cls)] = 1.0
    return out


def end2end_tensor(candidates: Sequence[Candidate], n: int = N) -> np.ndarray:
    """[1, n, 6]: x1 y1 x2 y2 score class, zero rows as padding."""
    out = np.zeros((1, n, 6), dtype=np.float32)
    for j, candidate in enumerate(candidates):
        out[0, j] = candidate
    return out


def rtdetr_tensor(candidates: Sequence[Candidate], n: int = N, size: float = 640.0) -> np.ndarray:
    """[1, n, 6]: cx cy w h as fractions of a ``size`` square input, score, class; zero rows as padding."""
    out = np.zeros((1, n, 6), dtype=np.float32)
    for j, (x1, y1, x2, y2, score, cls) in enumerate(candidates):
        out[0, j] = [(x1 + x2) / 2 / size, (y1 + y2) / 2 / size, (x2 - x1) / size, (y2 - y1) / size, score, cls]
    return out


ENCODERS: dict[str, Callable[..., np.ndarray]] = {
    "yolov8": yolov8_tensor,
    "yolov5": yolov5_tensor,
    "end2end": end2end_tensor,
    "rtdetr": rtdetr_tensor,
    "segment": segment_tensor,
}


def test_every_registered_head_is_decoded_here() -> None:
    assert ENCODERS.keys() == HEADS.keys()


def decode(head: str, output: np.ndarray, box_map: BoxMap = LETTERBOX, **kwargs: Any) -> Detections:
    return Decoder(head, output.shape, NC, **kwargs).decode(output, box_map)


def assert_detections(det: Detections, xyxy: list[list[float]], scores: list[float], classes: list[int]) -> None:
    np.testing.assert_allclose(det.xyxy, np.reshape(xyxy, (-1, 4)), rtol=1e-6)
    np.testing.assert_allclose(det.scores, scores, rtol=1e-6)
    assert det.class_ids.tolist() == classes


@pytest.mark.parametrize(
    ("head", "box_map", "xyxy"),
    [
        # Letterbox: x / 0.5; y (y - 140) / 0.5; the second box is clipped to (0, 0).
        ("yolov8", LETTERBOX, [[540, 310, 740, 410], [0, 0, 100, 100]]),
        ("yolov5", LETTERBOX, [[540, 310, 740, 410], [0, 0, 100, 100]]),
        ("end2end", LETTERBOX, [[540, 310, 740, 410], [0, 0, 100, 100]]),
        # Stretch: x / 0.5, y * 1.5; the second box is clipped at x = 0 only.
        ("yolov8", STRETCH, [[540, 442.5, 740, 517.5], [0, 195, 100, 285]]),
        ("yolov5", STRETCH, [[540, 442.5, 740, 517.5], [0, 195, 100, 285]]),
        ("end2end", STRETCH, [[540, 442.5, 740, 517.5], [0, 195, 100, 285]]),
    ],
)
def test_decode_scene(head: str, box_map: BoxMap, xyxy: list[list[float]]) -> None:
    det = decode(head, ENCODERS[head](SCENE), box_map)
    assert_detections(det, xyxy, [0.9, 0.5], [1, 0])


def test_result_columns() -> None:
    det = decode("yolov8", yolov8_tensor(SCENE))
    assert len(det) == 2
    assert det.xyxy.dtype == det.scores.dtype == np.float32 and det.class_ids.dtype == np.int32
    assert det.xyxy.shape == (2, 4) and det.xyxy.flags.c_contiguous
    assert not det.xyxy.flags.writeable and not det.scores.flags.writeable


@pytest.mark.parametrize("head", ["yolov8", "yolov5", "end2end"])
def test_empty_output(head: str) -> None:
    # All-zero tensors (end2end padding) decode to zero rows with the right column shapes.
    det = decode(head, np.zeros(SHAPES[head], dtype=np.float32))
    assert len(det) == 0
    assert (det.xyxy.shape, det.scores.shape, det.class_ids.shape) == ((0, 4), (0,), (0,))


def test_yolov5_score_is_objectness_times_best_class() -> None:
    out = np.zeros(SHAPES["yolov5"], dtype=np.float32)
    out[0, 0] = [320, 320, 100, 50, 0.8, 0.25, 0.75, 0.5]  # 0.8 * 0.75 = 0.6, class 1
    out[0, 1] = [100, 400, 20, 20, 0.9, 0.2, 0.1, 0.1]  # 0.9 * 0.2 = 0.18 < 0.25
    out[0, 2] = [500, 400, 20, 20, 0.2, 1.0, 0.0, 0.0]  # objectness 0.2 < 0.25
    out[0, 3] = [100, 200, 40, 40, 0.5, 0.6, 0.1, 0.1]  # 0.5 * 0.6 = 0.3, class 0
    det = decode("yolov5", out)
    assert_detections(det, [[540, 310, 740, 410], [160, 80, 240, 160]], [0.6, 0.3], [1, 0])


def test_end2end_drops_bad_classes_and_skips_nms() -> None:
    rows = [
        (100, 200, 200, 300, 0.9, 0),  # kept
        (100, 200, 200, 300, 0.8, 0),  # identical box, kept: the model already ran NMS
        (300, 200, 400, 300, 0.7, NC),  # class id == nc: out of range
        (300, 200, 400, 300, 0.7, -1),  # negative class id
        (300, 200, 400, 300, 0.7, 1.5),  # not an integer class id
        (300, 200, 400, 300, 0.7, np.nan),  # NaN class id
    ]
    det = decode("end2end", end2end_tensor(rows))
    assert_detections(det, [[200, 120, 400, 320]] * 2, [0.9, 0.8], [0, 0])


def test_end2end_max_det_keeps_best_even_if_unsorted() -> None:
    rows = [(0, 200, 10, 210, s, 0) for s in (0.3, 0.9, 0.5, 0.7)]
    det = decode("end2end", end2end_tensor(rows), max_det=2)
    assert det.scores.tolist() == pytest.approx([0.9, 0.7])


def test_threshold_is_exclusive() -> None:
    # ultralytics keeps scores above conf: a score of exactly conf is not a detection.
    for head in ("yolov8", "yolov5", "end2end"):
        assert decode(head, ENCODERS[head]([(270.0, 295.0, 370.0, 345.0, 0.25, 1)])).scores.tolist() == []
        assert len(decode(head, ENCODERS[head]([(270.0, 295.0, 370.0, 345.0, 0.2500001, 1)]))) == 1


@pytest.mark.parametrize("head", ["yolov8", "yolov5", "end2end"])
def test_per_class_thresholds_change_exactly_their_classes(head: str) -> None:
    # Class 1 (0.9) below its 0.95, class 0 (0.5) below its 0.6, class 2 (0.2) above its 0.1.
    det = decode(head, ENCODERS[head](SCENE), thresholds=[0.6, 0.95, 0.1])
    assert_detections(det, [[200, 520, 280, 600]], [0.2], [2])
    det = decode(head, ENCODERS[head](SCENE), thresholds=[0.25, 0.95, 0.25])
    assert_detections(det, [[0, 0, 100, 100]], [0.5], [0])


@pytest.mark.parametrize("head", ["yolov8", "yolov5", "end2end", "rtdetr"])
def test_one_threshold_per_class_equal_to_conf_decodes_as_conf(head: str) -> None:
    for seed in range(3):
        frame = crowded(head, 300, seed)
        plain = decode(head, frame, conf=0.3, max_det=50)
        kept = (plain.xyxy.copy(), plain.scores.copy(), plain.class_ids.copy())
        same = decode(head, frame, conf=0.3, max_det=50, thresholds=[0.3] * NC)
        for before, after in zip(kept, (same.xyxy, same.scores, same.class_ids), strict=True):
            np.testing.assert_array_equal(after, before)


def test_a_candidate_below_its_class_threshold_suppresses_nothing() -> None:
    # Thresholds apply before NMS, as conf does: the 0.9 box under its class's 0.95 does not
    # suppress the overlapping 0.5 box, even with class-agnostic NMS.
    overlapping = [(270.0, 295.0, 370.0, 345.0, 0.9, 1), (272.0, 296.0, 372.0, 346.0, 0.5, 0)]
    det = decode("yolov8", yolov8_tensor(overlapping), agnostic=True, thresholds=[0.25, 0.95, 0.25])
    assert det.class_ids.tolist() == [0]
    assert decode("yolov8", yolov8_tensor(overlapping), agnostic=True).class_ids.tolist() == [1]


def test_thresholds_must_be_one_probability_per_class() -> None:
    for bad in ([0.5, 0.5], [0.5, 0.0, 0.5], [0.5, 1.5, 0.5]):
        with pytest.raises(ValueError, match="thresholds must be 3 values"):
            Decoder("yolov8", SHAPES["yolov8"], NC, thresholds=bad)


# ---- near misses (evidence under ng+near) ---------------------------------------------------------


@pytest.mark.parametrize("head", ["yolov8", "yolov5", "end2end", "rtdetr"])
def test_a_near_miss_is_handed_on_beside_the_detections_not_among_them(head: str) -> None:
    # SCENE's third candidate (0.2, class 2) is within 0.1 below conf 0.25: a near miss.
    det = decode(head, ENCODERS[head](SCENE), near_margin=0.1)
    assert det.scores.tolist() == pytest.approx([0.9, 0.5]) and det.class_ids.tolist() == [1, 0]
    assert det.near is not None
    assert_detections(det.near, [[200, 520, 280, 600]], [0.2], [2])
    assert not det.near.xyxy.flags.writeable
    assert decode(head, ENCODERS[head](SCENE)).near is None  # no margin, no search
    further = decode(head, ENCODERS[head](SCENE), near_margin=0.04)  # 0.2 is 0.05 below: not near
    assert further.near is not None and len(further.near) == 0
    at = decode(head, ENCODERS[head]([(270.0, 295.0, 370.0, 345.0, 0.25, 1)]), near_margin=0.1)
    assert len(at) == 0 and at.near is not None and len(at.near) == 1  # at the threshold: not passed, near


@pytest.mark.parametrize("head", ["yolov8", "yolov5"])
def test_a_weaker_box_around_a_detected_object_is_not_a_near_miss(head: str) -> None:
    # A detector scores several boxes around one object: the weaker ones are suppressed by the
    # detection in the near pass's NMS, as they are in the detections' own.
    object_boxes = [(270.0, 295.0, 370.0, 345.0, 0.9, 1), (272.0, 296.0, 372.0, 346.0, 0.2, 1)]
    det = decode(head, ENCODERS[head](object_boxes), near_margin=0.1)
    assert det.class_ids.tolist() == [1] and det.near is not None and len(det.near) == 0
    apart = [object_boxes[0], (100.0, 400.0, 140.0, 440.0, 0.2, 1)]
    det = decode(head, ENCODERS[head](apart), near_margin=0.1)
    assert det.near is not None and det.near.scores.tolist() == pytest.approx([0.2])


def test_a_near_miss_is_measured_from_its_own_class_threshold() -> None:
    # Class 1 at 0.9 under its 0.95 is near; class 0 at 0.5 under its 0.6 is further than 0.06.
    det = decode("yolov8", yolov8_tensor(SCENE), thresholds=[0.6, 0.95, 0.1], near_margin=0.06)
    assert det.class_ids.tolist() == [2]
    assert det.near is not None and det.near.class_ids.tolist() == [1]


@pytest.mark.parametrize("head", ["yolov8", "yolov5", "end2end", "rtdetr"])
@pytest.mark.parametrize("agnostic", [False, True])
def test_looking_for_near_misses_leaves_the_detections_as_they_were(head: str, agnostic: bool) -> None:
    thresholds = [0.3, 0.45, 0.2]  # a near miss of class 1 can outscore a detection of class 2
    for seed in range(3):
        frame = crowded(head, 300, seed)
        plain = decode(head, frame, max_det=100, agnostic=agnostic, thresholds=thresholds)
        kept = (plain.xyxy.copy(), plain.scores.copy(), plain.class_ids.copy())
        near = decode(head, frame, max_det=100, agnostic=agnostic, thresholds=thresholds, near_margin=0.15)
        for before, after in zip(kept, (near.xyxy, near.scores, near.class_ids), strict=True):
            np.testing.assert_array_equal(after, before)
        assert near.near is not None and len(near.near) > 0
        by_class = np.array(thresholds, np.float32)[near.near.class_ids]
        assert np.all(near.near.scores <= by_class) and np.all(near.near.scores > by_class - np.float32(0.15))


def test_a_near_margin_must_be_a_probability() -> None:
    for margin in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="near_margin"):
            decode("yolov8", yolov8_tensor(SCENE), near_margin=margin)


def test_yolov5_takes_the_first_class_whose_product_is_best() -> None:
    # 0.75 x p and 0.75 x the next float32 above p round to one value: the yolov5 repository
    # multiplies first and takes the first best, class 0, not the larger probability's class 1.
    out = np.zeros(SHAPES["yolov5"], dtype=np.float32)
    p = np.float32(0.8)
    out[0, 0] = [320, 320, 100, 50, 0.75, p, np.nextafter(p, np.float32(1)), 0.1]
    det = decode("yolov5", out)
    assert det.class_ids.tolist() == [0] and det.scores.tolist() == [np.float32(0.75) * p]


@pytest.mark.parametrize("head", ["yolov8", "yolov5"])
def test_nms_judges_the_unclipped_boxes(head: str) -> None:
    # In input pixels A spans x -60..40 and B 0..40: IoU 0.4, so both stay at iou 0.45, as in
    # ultralytics. Clipped to the frame first they would be the same box, and B would go.
    candidates = [(-60.0, 200.0, 40.0, 300.0, 0.9, 0), (0.0, 200.0, 40.0, 300.0, 0.8, 0)]
    det = decode(head, ENCODERS[head](candidates))
    assert_detections(det, [[0, 120, 80, 320], [0, 120, 80, 320]], [0.9, 0.8], [0, 0])


@pytest.mark.parametrize("head", ["yolov8", "yolov5", "end2end"])
def test_a_box_clipping_flattens_holds_its_max_det_slot(head: str) -> None:
    # The best box lies wholly in the top padding: ultralytics keeps it (flattened onto the
    # frame's top edge) as its one detection at max_det 1; edged drops it and publishes none.
    candidates = [(100.0, 20.0, 200.0, 100.0, 0.9, 0), (270.0, 295.0, 370.0, 345.0, 0.8, 1)]
    assert len(decode(head, ENCODERS[head](candidates), max_det=1)) == 0
    assert decode(head, ENCODERS[head](candidates), max_det=2).scores.tolist() == pytest.approx([0.8])


# Two boxes with IoU 81 / 119 = 0.68 and a third far away, in input pixels.
A = (200.0, 200.0, 210.0, 210.0)
B = (201.0, 201.0, 211.0, 211.0)
FAR = (400.0, 400.0, 410.0, 410.0)


@pytest.mark.parametrize(
    ("head", "candidates", "kwargs", "scores", "classes"),
    [
        # Same class, overlapping: the weaker box is suppressed.
        ("yolov8", [(*A, 0.9, 0), (*B, 0.8, 0), (*FAR, 0.7, 0)], {}, [0.9, 0.7], [0, 0]),
        ("yolov5", [(*A, 0.9, 0), (*B, 0.8, 0), (*FAR, 0.7, 0)], {}, [0.9, 0.7], [0, 0]),
        # Different classes, overlapping: both kept (class-aware).
        ("yolov8", [(*A, 0.9, 0), (*B, 0.8, 1)], {}, [0.9, 0.8], [0, 1]),
        ("yolov5", [(*A, 0.9, 0), (*B, 0.8, 1)], {}, [0.9, 0.8], [0, 1]),
        # Different classes, overlapping, agnostic: the weaker box is suppressed.
        ("yolov8", [(*A, 0.9, 0), (*B, 0.8, 1)], {"agnostic": True}, [0.9], [0]),
        ("yolov5", [(*A, 0.9, 0), (*B, 0.8, 1)], {"agnostic": True}, [0.9], [0]),
        # A looser iou keeps the pair (0.68 <= 0.7).
        ("yolov8", [(*A, 0.9, 0), (*B, 0.8, 0)], {"iou": 0.7}, [0.9, 0.8], [0, 0]),
        # Output is ordered by score whatever the candidate order.
        ("yolov8", [(*FAR, 0.3, 2), (*A, 0.9, 0), (*B, 0.5, 1)], {}, [0.9, 0.5, 0.3], [0, 1, 2]),
        # max_det keeps the best two after NMS.
        ("yolov8", [(*FAR, 0.3, 2), (*A, 0.9, 0), (*B, 0.5, 1)], {"max_det": 2}, [0.9, 0.5], [0, 1]),
        # A higher conf drops the weaker candidates before NMS.
        ("yolov8", [(*FAR, 0.3, 2), (*A, 0.9, 0), (*B, 0.5, 1)], {"conf": 0.6}, [0.9], [0]),
    ],
)
def test_decode_nms(
    head: str,
    candidates: list[Candidate],
    kwargs: dict[str, Any],
    scores: list[float],
    classes: list[int],
) -> None:
    det = decode(head, ENCODERS[head](candidates), **kwargs)
    np.testing.assert_allclose(det.scores, scores, rtol=1e-6)
    assert det.class_ids.tolist() == classes


@pytest.mark.parametrize(
    "candidate",
    [
        (100.0, 20.0, 200.0, 100.0, 0.9, 0),  # wholly inside the top letterbox padding
        (100.0, 300.0, 100.0, 350.0, 0.9, 0),  # zero width
        (100.0, 350.0, 200.0, 300.0, 0.9, 0),  # negative height
        (700.0, 300.0, 800.0, 350.0, 0.9, 0),  # right of the input
    ],
)
@pytest.mark.parametrize("head", ["yolov8", "yolov5", "end2end"])
def test_empty_or_outside_boxes_dropped(head: str, candidate: Candidate) -> None:
    assert len(decode(head, ENCODERS[head]([candidate]))) == 0


@pytest.mark.parametrize("head", ["yolov8", "yolov5", "end2end"])
def test_non_finite_rows_dropped(head: str) -> None:
    good = (270.0, 295.0, 370.0, 345.0, 0.9, 1)
    out = ENCODERS[head]([good, good, good, good])
    out_flat = out[0] if head != "yolov8" else out[0].T  # rows are candidates
    out_flat[1, 0] = np.nan  # NaN coordinate
    out_flat[2, 2] = np.inf  # infinite size
    out_flat[3, 4] = np.inf  # infinite score
    # iou=1.0 keeps identical boxes, so a corrupt row can only vanish through the finite check.
    det = decode(head, out, max_det=10, iou=1.0)
    assert_detections(det, [[540, 310, 740, 410]], [0.9], [1])
    assert det.nonfinite == 3  # counted: the daemon reports them as nonfinite_output


@pytest.mark.parametrize("head", ["yolov8", "yolov5", "end2end", "rtdetr"])
def test_an_output_of_nan_is_counted_not_silently_empty(head: str) -> None:
    # A NaN score never passes the threshold: without the count such a model publishes nothing, silently.
    out = np.full(SHAPES[head], np.nan, np.float32)
    det = decode(head, out)
    assert len(det) == 0 and det.nonfinite == out.size
    assert decode(head, ENCODERS[head](SCENE)).nonfinite == 0


@pytest.mark.parametrize("head", ["yolov8", "yolov5", "end2end"])
def test_scores_above_one_are_dropped_and_counted(head: str) -> None:
    # Raw logits or a missing /255 give "scores" like 219: never published, always reported.
    scene = [(*SCENE[0][:4], 219.0, 1), (*SCENE[1][:4], np.inf, 0), SCENE[2], (300.0, 300.0, 340.0, 340.0, 0.7, 2)]
    det = decode(head, ENCODERS[head](scene))
    assert det.scores_above_one == 2
    assert det.scores.tolist() == pytest.approx([0.7]) and det.class_ids.tolist() == [2]


def test_float16_output() -> None:
    det = decode("yolov8", yolov8_tensor(SCENE).astype(np.float16))
    np.testing.assert_allclose(det.xyxy, [[540, 310, 740, 410], [0, 0, 100, 100]], rtol=1e-3)
    assert det.class_ids.tolist() == [1, 0]


def test_decode_leaves_output_untouched() -> None:
    out = yolov8_tensor(SCENE)
    before = out.copy()
    decode("yolov8", out)
    np.testing.assert_array_equal(out, before)


def crowded(head: str, n: int, seed: int) -> np.ndarray:
    """An [1, ..] output of n candidates where more than half pass conf 0.25, many overlap,
    some boxes stick out of the input and a few rows are NaN."""
    rng = np.random.default_rng(seed)
    centre = rng.uniform((-20, 120), (660, 520), (n, 2))  # around the letterbox content
    size = rng.uniform(5, 120, (n, 2))
    score = rng.uniform(0.1, 0.5, n)
    cls = rng.integers(0, NC, n)
    candidates = [(*(centre[i] - size[i] / 2), *(centre[i] + size[i] / 2), score[i], cls[i]) for i in range(n)]
    out = ENCODERS[head](candidates, n=n)
    out.reshape(-1)[rng.integers(0, out.size, n // 50)] = np.nan
    return out


@pytest.mark.parametrize("head", ["yolov8", "yolov5", "end2end", "rtdetr"])
@pytest.mark.parametrize("n", [8, 300, 8400])
@pytest.mark.parametrize("near_margin", [None, 0.1])
def test_steady_state_creates_no_arrays(head: str, n: int, near_margin: float | None) -> None:
    # Counted through numpy's data allocator hook: every array that owns memory is one buffer,
    # temporaries included. Several frames with different candidate counts, after the first;
    # with a near margin, the near-miss pass included (at 8 candidates it finds some; in the
    # crowded outputs detections fill max_det first).
    counter = NumpyAllocations.get()
    assert counter is not None, "numpy's allocator hook is unavailable"
    frames = [crowded(head, n, seed) for seed in range(4)]
    decoder = Decoder(head, frames[0].shape, NC, max_det=50, near_margin=near_margin)

    def counts(det: Detections) -> tuple[int, int]:
        return len(det), -1 if det.near is None else len(det.near)

    kept = [counts(decoder.decode(frame, LETTERBOX)) for frame in frames]
    assert max(kept)[0] > 1
    assert near_margin is None or n > 8 or max(k[1] for k in kept) > 0
    with counter.counting():
        before = counter.buffers
        again = [counts(decoder.decode(frame, LETTERBOX)) for frame in frames]
        assert counter.buffers == before
    assert again == kept


@pytest.mark.parametrize("head", ["yolov8", "yolov5", "end2end", "rtdetr"])
def test_frames_do_not_leak_into_each_other(head: str) -> None:
    # Scratch reused across frames: a crowded frame in between leaves no trace in the next one.
    decoder = Decoder(head, SHAPES[head], NC)
    first = decoder.decode(ENCODERS[head](SCENE), LETTERBOX)
    kept = (first.xyxy.copy(), first.scores.copy(), first.class_ids.copy())
    assert len(decoder.decode(crowded(head, N, 0), LETTERBOX)) > 2
    again = decoder.decode(ENCODERS[head](SCENE), LETTERBOX)
    for before, after in zip(kept, (again.xyxy, again.scores, again.class_ids), strict=True):
        np.testing.assert_array_equal(after, before)


def test_all_candidates_above_threshold_is_bounded_by_max_det() -> None:
    # A broken model scoring every one of 8400 candidates 1.0 still yields <= max_det rows.
    rng = np.random.default_rng(0)
    out = np.ones((1, 84, 8400), dtype=np.float32)
    out[0, 0] = rng.uniform(0, 640, 8400)
    out[0, 1] = rng.uniform(150, 490, 8400)  # inside the content: no box is clipped away
    out[0, 2:4] = rng.uniform(2, 8, (2, 8400))
    det = Decoder("yolov8", out.shape, 80, max_det=100).decode(out, LETTERBOX)
    assert len(det) == 100


@pytest.mark.parametrize(
    ("output", "fragments"),
    [
        # Wrong feature count.
        (np.zeros((1, 8, N), np.float32), ["yolov8", "[1, 7, 8]", "[1, 8, 8]"]),
        # Batch 2.
        (np.zeros((2, 7, N), np.float32), ["[1, 7, 8]", "[2, 7, 8]"]),
        # Transposed.
        (np.zeros((1, N, 7), np.float32), ["[1, 8, 7]"]),
        # Integer tensor.
        (np.zeros((1, 7, N), np.int32), ["int32"]),
        # Not an array at all.
        ([[0.0]], ["list"]),
    ],
)
def test_decode_wrong_output_raises(output: Any, fragments: list[str]) -> None:
    decoder = Decoder("yolov8", (1, 7, N), NC)
    with pytest.raises(HeadError) as info:
        decoder.decode(output, LETTERBOX)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("head", "shape", "nc", "kwargs", "error", "fragment"),
    [
        # Shape disagrees with the class count.
        ("yolov8", (1, 84, 8400), 3, {}, HeadError, "[1, 84, 8400]"),
        ("yolov5", (1, 25200, 84), 80, {}, HeadError, "[1, N, 85]"),
        ("end2end", (1, 300, 7), 80, {}, HeadError, "[1, K, 6]"),
        # Symbolic dims must be resolved before building a decoder.
        ("yolov8", (1, 84, "anchors"), 80, {}, HeadError, "concrete"),
        ("yolov9", (1, 84, 8400), 80, {}, HeadError, "yolov9"),
        ("yolov8", (1, 4, 8400), 0, {}, HeadError, "num_classes"),
        # Thresholds outside (0, 1] and a useless max_det.
        ("yolov8", (1, 84, 8400), 80, {"conf": 0.0}, ValueError, "conf"),
        ("yolov8", (1, 84, 8400), 80, {"conf": 1.5}, ValueError, "conf"),
        ("yolov8", (1, 84, 8400), 80, {"conf": float("nan")}, ValueError, "conf"),
        ("yolov8", (1, 84, 8400), 80, {"iou": 0.0}, ValueError, "iou"),
        ("yolov8", (1, 84, 8400), 80, {"max_det": 0}, ValueError, "max_det"),
    ],
)
def test_decoder_rejects_bad_config(
    head: Any, shape: Any, nc: int, kwargs: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error) as info:
        Decoder(head, shape, nc, **kwargs)
    assert fragment in str(info.value)


_HUGE = float(np.float32(3.4e38))
_hostile_float = st.one_of(
    st.floats(0.0, 1.0, width=32),  # plausible scores
    st.floats(0.0, 640.0, width=32),  # plausible coordinates
    st.floats(-2000.0, 2000.0, width=32),
    # Near float32's largest value, as float32 holds it exactly (hypothesis refuses a value it would round).
    st.sampled_from([np.nan, np.inf, -np.inf, _HUGE, -_HUGE, 0.0, 1.0, 2.0]),
)
# end2end class ids: mostly valid, some out of range, fractional or non-finite.
_hostile_class = st.sampled_from([0.0, 1.0, 2.0, 0.0, 1.0, 2.0, 3.0, -1.0, 1.5, np.nan, np.inf])


@pytest.mark.filterwarnings("error")
@settings(max_examples=50, deadline=None)
@given(
    head=st.sampled_from(["yolov8", "yolov5", "end2end"]),
    data=st.data(),
    box_map=st.sampled_from([LETTERBOX, STRETCH, BoxMap.letterbox(640, 480, 320, 320)]),
    conf=st.sampled_from([0.01, 0.25, 0.9, 1.0]),
    iou=st.sampled_from([0.3, 0.45, 1.0]),
    max_det=st.sampled_from([1, 3, 100]),
    agnostic=st.booleans(),
)
def test_hostile_tensors_yield_sane_detections(
    head: str,
    data: st.DataObject,
    box_map: BoxMap,
    conf: float,
    iou: float,
    max_det: int,
    agnostic: bool,
) -> None:
    output = data.draw(hnp.arrays(np.float32, SHAPES[head], elements=_hostile_float))
    if head == "end2end":
        output[0, :, 5] = data.draw(hnp.arrays(np.float32, N, elements=_hostile_class))
        if data.draw(st.booleans()):  # order corners so that finite rows are real boxes
            rows = output[0]
            rows[:, [0, 2]] = np.sort(rows[:, [0, 2]], axis=1)
            rows[:, [1, 3]] = np.sort(rows[:, [1, 3]], axis=1)
    decoder = Decoder(head, SHAPES[head], NC, conf=conf, iou=iou, max_det=max_det, agnostic=agnostic)
    det = decoder.decode(output, box_map)

    n = len(det)
    assert n <= max_det
    assert det.xyxy.shape == (n, 4) and det.scores.shape == (n,) and det.class_ids.shape == (n,)
    assert np.isfinite(det.xyxy).all() and np.isfinite(det.scores).all()
    x1, y1, x2, y2 = det.xyxy.T
    assert (x1 >= 0).all() and (y1 >= 0).all()
    assert (x2 <= box_map.frame_w).all() and (y2 <= box_map.frame_h).all()
    assert (x2 > x1).all() and (y2 > y1).all()
    assert (det.scores > np.float32(conf)).all()
    assert (np.diff(det.scores) <= 0).all()
    assert ((det.class_ids >= 0) & (det.class_ids < NC)).all()
    if head != "end2end":  # ultralytics takes an end2end output's first rows, edged its best: equal once sorted
        want = ultralytics_boxes(output, head, box_map, conf=conf, iou=iou, max_det=max_det, agnostic=agnostic)
        got = Boxes(det.xyxy, det.scores, det.class_ids.astype(np.int64))
        assert differences(got, want.with_area()) == ([], [])


def ultralytics_boxes(output: np.ndarray, head: str, box_map: BoxMap, **settings: Any) -> Boxes:
    """ultralytics' boxes for ``output`` once the candidates edged refuses to trust are taken out:
    those with a non-finite box and those whose score is above 1. The stretched frame is mapped
    back with the stretch's own gains."""
    if box_map is STRETCH:
        settings["ratio_pad"] = ((640 / 960, 640 / 1280), (0, 0))
    rows = output[0].T if head == "yolov8" else output[0]
    with np.errstate(all="ignore"):
        if head == "yolov8":
            score = rows[:, 4:].max(1)
        else:
            score = (rows[:, 5:] * rows[:, 4:5]).max(1)
        trusted = np.isfinite(rows[:, :4]).all(1) & ~(score > 1)
        kept = rows[trusted].T[None] if head == "yolov8" else rows[trusted][None]
        return predict(
            kept, head, input_hw=(box_map.input_h, box_map.input_w), frame_hw=(box_map.frame_h, box_map.frame_w), **settings
        )
