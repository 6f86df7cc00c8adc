"""The live view: offered only while watched, scaled, annotated, encoded once for every viewer."""

from __future__ import annotations

import time
from collections.abc import Iterator

import cv2
import numpy as np
import pytest
from allocations import NumpyAllocations
from waiting import wait_for

from edged.messages import AnomalyRegion, Detection, DetectionsMessage, ModelInfo, Reason, Timings, TopClass, Verdict
from edged.sources.base import Frame
from edged.view import BANNER, PALETTE, TALLEST, TOP_CLASSES_Y, ZONE_PALETTE, LiveView

MODEL = ModelInfo(name="probe", sha256="ab" * 32, provider="CPUExecutionProvider")
GREY = (60, 60, 60)


def _message(frame_id: int, boxes: list[tuple[float, float, float, float]], size: tuple[int, int]) -> DetectionsMessage:
    return DetectionsMessage(
        camera_id="cam0",
        seq=frame_id,
        frame_id=frame_id,
        capture_time_ns=time.time_ns(),
        frame_size=size,
        input_size=(64, 64),
        model=MODEL,
        detections=[Detection(class_id=i, label=f"c{i}", score=0.9, box=box) for i, box in enumerate(boxes)],
        timings=Timings(preprocess_ms=1.0, inference_ms=2.0, decode_ms=0.5, age_ms=4.0),
        thermal_state="ok",
    )


def _frame(frame_id: int, image: np.ndarray, order: str = "bgr") -> Frame:
    return Frame(image, frame_id, time.monotonic_ns(), time.time_ns(), order)  # type: ignore[arg-type]


@pytest.fixture
def view() -> Iterator[LiveView]:
    v = LiveView("cam0", fps=1000.0, width=960, quality=90, zones={})
    v.start()
    yield v
    v.close()


def _decode(jpeg: bytes) -> np.ndarray:
    image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    assert image is not None
    return image


def test_nobody_watching_means_no_frame_is_wanted(view: LiveView) -> None:
    assert not view.wants_frame()
    with view.watch():
        assert view.viewers == 1
        assert view.wants_frame()
    assert view.viewers == 0
    assert not view.wants_frame()


def test_a_viewer_joining_while_another_watches_has_the_latest_frame_at_once(view: LiveView) -> None:
    """A slow or triggered camera's next frame may be seconds away, and a viewer joining one already
    watched waited for it with a blank image; one joining a view nobody watched still waits for the
    next frame, as what was encoded then may show a part long gone."""
    image = np.full((480, 640, 3), GREY, np.uint8)
    assert view.start_seq() == 0  # nothing encoded yet
    with view.watch():
        view.offer(_frame(1, image), None)
        assert view.next_jpeg(0, 5.0) is not None
        joining = view.start_seq()
        assert joining == view.seq - 1
        got = view.next_jpeg(joining, 0.0)  # no frame offered since: at once
        assert got is not None and got[0] == view.seq
    assert view.start_seq() == view.seq  # nobody watches now: the next frame is waited for
    assert view.next_jpeg(view.start_seq(), 0.05) is None


def test_frames_are_scaled_to_the_view_width_with_boxes_where_the_detections_are(view: LiveView) -> None:
    image = np.full((1080, 1920, 3), GREY, np.uint8)
    box = (400.0, 300.0, 1000.0, 700.0)  # half of it in the 960-wide view: 200, 150, 500, 350
    with view.watch():
        view.offer(_frame(7, image), _message(7, [box], (1920, 1080)))
        got = view.next_jpeg(0, 5.0)
    assert got is not None
    shown = _decode(got[1])
    assert shown.shape == (540, 960, 3)
    colour = np.array(PALETTE[0], np.int32)
    for y, x in ((250, 200), (250, 500), (350, 350)):  # left, right, bottom edges
        assert np.abs(shown[y, x].astype(np.int32) - colour).sum() < 60, shown[y, x]
    for y, x in ((250, 350), (100, 800)):  # inside the box and far from it: the frame itself
        assert np.abs(shown[y, x].astype(np.int32) - np.array(GREY)).sum() < 30


def _near(pixel: np.ndarray, colour: tuple[int, int, int], within: int = 60) -> bool:
    return int(np.abs(pixel.astype(np.int32) - np.array(colour, np.int32)).sum()) < within


def _inspected(verdict: Verdict) -> DetectionsMessage:
    """A 1920x1080 frame's message: one detection in zone "left", NG or not."""
    detection = Detection(class_id=2, label="scratch", score=0.9, box=(400.0, 600.0, 800.0, 1000.0), zone="left")
    reason = Reason(detection=0, class_id=2, label="scratch", score=0.9, zone="left")
    return _message(3, [], (1920, 1080)).model_copy(
        update={"detections": [detection], "verdict": verdict, "reasons": [reason] if verdict == "ng" else []}
    )


@pytest.mark.parametrize(("width", "height"), [(1, 65535), (40, 65535), (1024, 30000)])
def test_a_frame_far_taller_than_wide_is_shown_whole_at_most_four_views_tall_with_its_boxes(
    view: LiveView, width: int, height: int
) -> None:
    # An image folder's frame may be 65535 tall, a JPEG at most 65500: such a frame was not encoded, and
    # the view stayed on the frame before it. A line-scan strip of 1024x30000 was a 15 MB JPEG at the
    # view's width, though the page shows it within the window's height.
    image = np.full((height, width, 3), GREY, np.uint8)
    box = (width / 4, height * 0.9, width * 3 / 4, height * 0.99)
    with view.watch():
        view.offer(_frame(1, image), _message(1, [box], (width, height)))
        got = view.next_jpeg(0, 10.0)
    assert got is not None, "no JPEG of the frame"
    shown = _decode(got[1])
    tallest = TALLEST * 960  # the view's width
    assert shown.shape == (tallest, max(1, round(width * tallest / height)), 3)
    bottom = round(box[3] * tallest / height)
    assert _near(shown[bottom, shown.shape[1] // 2], PALETTE[0]), shown[bottom - 2 : bottom + 3, shown.shape[1] // 2]


def test_zones_the_boxes_in_them_and_the_verdict_banner_are_drawn(view: LiveView) -> None:
    image = np.full((1080, 1920, 3), GREY, np.uint8)
    # Shown 960x540: the zone spans x 96..480, y 108..485; the box 200..400, 300..500.
    view.show_zones({"left": [(0.1, 0.2), (0.5, 0.2), (0.5, 0.9), (0.1, 0.9)]})
    shown = []
    with view.watch():
        for i, verdict in enumerate(("ng", "ok")):
            assert wait_for(view.wants_frame, 5.0)
            view.offer(_frame(i, image), _inspected(verdict))  # type: ignore[arg-type]
            got = view.next_jpeg(i, 5.0)
            assert got is not None
            shown.append(_decode(got[1]))
        view.show_zones({})
        assert wait_for(view.wants_frame, 5.0)
        view.offer(_frame(2, image), _message(2, [], (1920, 1080)))
        got = view.next_jpeg(2, 5.0)
        assert got is not None
        plain = _decode(got[1])
    for image_shown, verdict in zip(shown, ("ng", "ok"), strict=True):
        assert _near(image_shown[300, 480], ZONE_PALETTE[0]), image_shown[300, 480]  # the zone's right edge
        assert _near(image_shown[200, 96], ZONE_PALETTE[0]), image_shown[200, 96]  # its left edge
        assert _near(image_shown[400, 200], ZONE_PALETTE[0])  # the box in the zone, in the zone's colour
        assert _near(image_shown[250, 300], GREY, 30)  # inside the zone: the frame itself
        assert _near(image_shown[3, 950], BANNER[verdict]), image_shown[3, 950]  # the banner, across the top
    assert _near(plain[300, 480], GREY, 30) and _near(plain[3, 950], GREY, 30)  # no zones, no verdict: neither


def test_an_instances_outline_is_drawn_in_its_class_colour(view: LiveView) -> None:
    image = np.full((540, 960, 3), GREY, np.uint8)
    outline = [(300.0, 200.0), (500.0, 200.0), (400.0, 400.0)]  # a triangle inside its box
    found = Detection(class_id=1, label="dent", score=0.9, box=(300, 200, 500, 400), polygon=outline, area_px=20000)
    msg = _message(0, [], (960, 540)).model_copy(update={"task": "segment", "detections": [found]})
    with view.watch():
        assert wait_for(view.wants_frame, 5.0)
        view.offer(_frame(0, image), msg)
        got = view.next_jpeg(0, 5.0)
    assert got is not None
    shown = _decode(got[1])
    assert _near(shown[300, 350], PALETTE[1]), shown[300, 350]  # on the triangle's left edge
    assert _near(shown[300, 320], GREY, 30)  # inside the box, outside the outline


def test_a_classifiers_best_classes_are_listed_below_an_uncertain_banner(view: LiveView) -> None:
    image = np.full((540, 960, 3), GREY, np.uint8)
    top = [TopClass(class_id=3, label="crack", score=0.42), TopClass(class_id=1, label="good", score=0.4)]
    msg = _message(0, [], (960, 540)).model_copy(update={"task": "classify", "top": top, "verdict": "uncertain"})
    with view.watch():
        assert wait_for(view.wants_frame, 5.0)
        view.offer(_frame(0, image), msg)
        got = view.next_jpeg(0, 5.0)
    assert got is not None
    shown = _decode(got[1])
    assert _near(shown[3, 950], BANNER["uncertain"]), shown[3, 950]
    for i, t in enumerate(top):  # each class on its colour, one a line
        assert _near(shown[TOP_CLASSES_Y + 20 * i + 2, 5], PALETTE[t.class_id % len(PALETTE)]), shown[TOP_CLASSES_Y + 2, 5]
    assert _near(shown[TOP_CLASSES_Y + 60, 5], GREY, 30)  # two classes, two lines


def test_a_preview_shows_the_frame_and_its_zones_with_a_caption_but_nothing_of_a_model(view: LiveView) -> None:
    image = np.full((1080, 1920, 3), GREY, np.uint8)
    view.show_zones({"left": [(0.1, 0.2), (0.5, 0.2), (0.5, 0.9), (0.1, 0.9)]})
    with view.watch():
        view.offer(_frame(5, image), None)
        got = view.next_jpeg(0, 5.0)
    assert got is not None
    shown = _decode(got[1])
    assert shown.shape == (540, 960, 3)
    assert _near(shown[300, 480], ZONE_PALETTE[0])  # the zone, to aim the camera by
    assert _near(shown[3, 950], GREY, 30) and _near(shown[250, 300], GREY, 30)  # no banner, no box
    assert shown[530:540, 0:200].mean() < 40  # the caption's black band, bottom left


def test_an_rgb_frame_is_shown_in_its_true_colours(view: LiveView) -> None:
    rgb = np.zeros((96, 128, 3), np.uint8)
    rgb[..., 0] = 255  # red, in RGB order
    with view.watch():
        view.offer(_frame(1, rgb, "rgb"), _message(1, [], (128, 96)))
        got = view.next_jpeg(0, 5.0)
    assert got is not None
    b, g, r = _decode(got[1])[10, 10]
    assert r > 200 and b < 50 and g < 50


def test_while_the_encoder_is_busy_or_the_rate_is_spent_no_frame_is_wanted() -> None:
    view = LiveView("cam0", fps=2.0, width=960, quality=70, zones={})  # not started: the encoder never takes the frame
    with view.watch():
        view.offer(_frame(1, np.zeros((48, 64, 3), np.uint8)), _message(1, [], (64, 48)))
        assert not view.wants_frame()  # the offered frame is still waiting for the encoder
    started = LiveView("cam0", fps=2.0, width=960, quality=70, zones={})
    started.start()
    try:
        with started.watch():
            started.offer(_frame(1, np.zeros((48, 64, 3), np.uint8)), _message(1, [], (64, 48)))
            assert started.next_jpeg(0, 5.0) is not None
            assert not started.wants_frame()  # 2 fps: the next one is due half a second later
            assert wait_for(started.wants_frame, 5.0)
    finally:
        started.close()


def test_one_encoding_is_shared_by_every_viewer(view: LiveView) -> None:
    image = np.full((96, 128, 3), GREY, np.uint8)
    with view.watch(), view.watch():
        view.offer(_frame(1, image), _message(1, [], (128, 96)))
        first = view.next_jpeg(0, 5.0)
        second = view.next_jpeg(0, 5.0)
    assert first is not None and second is not None
    assert first[0] == second[0] == view.seq == 1
    assert first[1] is second[1]


def test_offering_a_frame_creates_no_numpy_array_after_the_first(view: LiveView) -> None:
    counter = NumpyAllocations.get()
    assert counter is not None, "numpy's allocator hook is unavailable"
    image = np.full((720, 1280, 3), GREY, np.uint8)
    messages = [_message(i, [(10.0, 10.0, 50.0, 50.0)], (1280, 720)) for i in range(4)]
    with view.watch():
        view.offer(_frame(0, image), messages[0])
        assert view.next_jpeg(0, 5.0) is not None
        for i in range(1, 4):
            assert wait_for(view.wants_frame, 5.0)
            with counter.counting():
                before = counter.buffers
                view.offer(_frame(i, image), messages[i])
                assert counter.buffers == before
            assert view.next_jpeg(i - 1, 5.0) is not None


def test_close_wakes_a_waiting_viewer() -> None:
    view = LiveView("cam0", fps=5.0, width=960, quality=70, zones={})
    view.start()
    started = time.monotonic()
    with view.watch():
        view.close()
        assert view.next_jpeg(0, 10.0) is None
    assert time.monotonic() - started < 5


def test_an_anomaly_models_regions_are_outlined_and_its_score_shown(view: LiveView) -> None:
    image = np.full((1080, 1920, 3), GREY, np.uint8)
    # Shown 960x540: the region's outline runs along x 200 from y 100 to 200.
    square = [(400.0, 200.0), (800.0, 200.0), (800.0, 400.0), (400.0, 400.0)]
    message = _message(0, [], (1920, 1080)).model_copy(
        update={
            "task": "anomaly",
            "anomaly_score": 0.8,
            "anomalous": True,
            "threshold": 0.5,
            "regions": [
                AnomalyRegion(
                    box=(400, 200, 800, 400), area_px=80000, max_score=0.9, polygon=square, length_px=400, width_px=200
                )
            ],
        }
    )
    with view.watch():
        assert wait_for(view.wants_frame, 5.0)
        view.offer(_frame(0, image), message)
        got = view.next_jpeg(0, 5.0)
        assert got is not None
    shown = _decode(got[1])
    assert _near(shown[150, 200], PALETTE[0]), shown[150, 200]  # the outline's left edge
    assert _near(shown[150, 300], GREY, 30)  # inside the region: the frame itself
    assert _near(shown[31, 945], (0, 0, 160), 60), shown[31, 945]  # the score's label, red: anomalous


def test_an_anomaly_map_offered_with_the_frame_is_overlaid_as_a_heatmap(view: LiveView) -> None:
    image = np.full((480, 640, 3), GREY, np.uint8)
    heat = np.zeros((256, 256), np.uint8)
    heat[:, 128:] = 255  # the right half most anomalous
    with view.watch():
        assert wait_for(view.wants_frame, 5.0)
        view.offer(_frame(0, image), _message(0, [], (640, 480)), heat)
        got = view.next_jpeg(0, 5.0)
        assert got is not None
    shown = _decode(got[1])
    left, right = shown[240, 100].astype(int), shown[240, 540].astype(int)
    assert left[0] > left[2] + 40, left  # blue over the normal half (BGR)
    assert right[2] > right[0] + 40, right  # red over the anomalous half
