"""Segmentation: edged's instances against ultralytics' own predict of a real ``-seg`` export.

``tests/data/tasks`` holds a YOLOv8 ``-seg`` export (random weights, made input-sensitive) and what
ultralytics' ``predict`` returned for frames of four aspect ratios
(`tests/reference/build_ultralytics_tasks.py` made them): boxes, classes, scores, the masks mapped to
the frame (``ops.scale_masks``) and the outlines (``masks.xy``). edged must keep the same detections
(ultralytics drops those whose mask is empty), with masks of IoU >= 0.99 and the same outlines.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np
import onnx
import pytest
from allocations import NumpyAllocations
from onnx import TensorProto, helper, numpy_helper
from pydantic import ValidationError

from edged.config import CandidateConfig, ModelConfig, RuntimeConfig, Settings
from edged.errors import ConfigError, ModelError
from edged.geometry import BoxMap
from edged.heads.segment import SegmentHead
from edged.messages import parse_message
from edged.model import LoadedModel, load_model
from edged.pipeline import FramePath, FramePipeline, Processed, frame_path
from edged.segment import MASK_BUFFER_BUDGET, Instances, Segmenter, mask_bytes, merge_segments
from edged.settings.inspect import InspectConfig
from edged.settings.sources import SyntheticSourceConfig
from edged.shadow import Shadow
from edged.sources.base import Frame
from edged.stats import VerdictRecord
from edged.tools.evaluate import read_yolo_outlines
from edged.verdict import Inspector

DATA = Path(__file__).parent / "data" / "tasks"
REFERENCE = np.load(DATA / "seg.npz")
FRAMES = ["wide", "tall", "square", "strip"]


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    # ultralytics predict's defaults: conf 0.25, NMS IoU 0.7, 300 detections.
    return load_model(ModelConfig(path=DATA / "seg.onnx", iou=0.7, max_det=300, max_masks=300), RuntimeConfig())


def test_a_seg_export_loads_as_a_segmentation_model(model: LoadedModel) -> None:
    assert (model.head, model.task, model.num_classes) == ("segment", "segment", 3)
    assert model.labels == ["scratch", "dent", "stain"]


@pytest.mark.parametrize("name", FRAMES)
def test_instances_are_ultralytics_predicts(model: LoadedModel, name: str) -> None:
    image = cv2.imread(str(DATA / f"{name}.png"))
    h, w = image.shape[:2]
    instances, _ = FramePipeline(model, w, h, "bgr").process(image)
    assert isinstance(instances, Instances)
    expected_masks = np.unpackbits(REFERENCE[f"{name}/frame_masks"], axis=-1)[..., :w].astype(bool)
    assert instances.class_ids.tolist() == REFERENCE[f"{name}/cls"].tolist()
    np.testing.assert_allclose(instances.xyxy, REFERENCE[f"{name}/xyxy"], atol=0.05)
    np.testing.assert_allclose(instances.scores, REFERENCE[f"{name}/conf"], atol=2e-3)
    assert len(instances.polygons) == len(expected_masks) > 0
    for i, expected in enumerate(expected_masks):
        mask = instances.masks[i]
        assert (mask & expected).sum() / (mask | expected).sum() >= 0.99
        assert instances.area_px[i] == int(mask.sum())
        polygon = REFERENCE[f"{name}/polygon{i}"]
        assert instances.polygons[i].shape == polygon.shape
        np.testing.assert_allclose(instances.polygons[i], polygon, atol=0.5)
        (_, _), (rw, rh), _ = cv2.minAreaRect(polygon)
        assert instances.sides[i] == pytest.approx((max(rw, rh), min(rw, rh)), abs=0.5)


def test_the_message_carries_each_instances_outline_and_sizes(model: LoadedModel) -> None:
    path = FramePath(model, "cam0", "bgr")
    done = path.run(Frame(cv2.imread(str(DATA / "tall.png")), 3, 0, 0, "bgr"))
    assert isinstance(done, Processed) and isinstance(done.result, Instances)
    msg = parse_message(path.message(done, seq=0, thermal_state="ok").model_dump_json().encode())
    assert msg.kind == "detections" and msg.task == "segment" and msg.top is None
    first = msg.detections[0]
    assert first.polygon == [(round(x, 1), round(y, 1)) for x, y in REFERENCE["tall/polygon0"].tolist()]
    assert first.area_px == done.result.area_px[0]
    assert (first.length_px, first.width_px) == pytest.approx(done.result.sides[0], abs=0.05)
    label = done.result.dataset_label(180, 320).splitlines()[0].split()
    assert int(label[0]) == first.class_id and len(label) == 1 + 2 * len(first.polygon)


def test_detections_past_max_masks_are_published_without_a_mask(model: LoadedModel) -> None:
    image = cv2.imread(str(DATA / "wide.png"))
    every, _ = FramePipeline(model, 320, 240, "bgr").process(image)
    few = load_model(ModelConfig(path=DATA / "seg.onnx", iou=0.7, max_det=300, max_masks=9), RuntimeConfig())
    instances, _ = FramePipeline(few, 320, 240, "bgr").process(image)
    assert isinstance(every, Instances) and isinstance(instances, Instances)
    # Of the nine best, those with an empty mask are dropped; the ones past nine are kept, with no mask.
    masked = len(instances.polygons)
    assert 0 < masked < 9 < len(instances)
    assert instances.area_px == every.area_px[:masked]
    fields = instances.message_fields(few.label, None, None)
    assert [d.polygon is not None for d in fields["detections"]] == [i < masked for i in range(len(instances))]


@pytest.mark.unit
def test_separate_outlines_are_joined_at_their_closest_points_as_ultralytics_joins_them() -> None:
    a = np.array([[0, 0], [2, 0], [2, 2], [0, 2]])
    b = np.array([[5, 0], [7, 0], [7, 2], [5, 2]])
    merged = merge_segments([a, b])
    # Out along a from its point nearest b, across, round b and back: ultralytics' merge_multi_segment.
    assert merged.tolist() == [[2, 0], [2, 2], [0, 2], [0, 0], [2, 0], [5, 0], [7, 0], [7, 2], [5, 2], [5, 0]]


def test_a_defect_within_its_class_size_limits_is_noted_and_makes_no_ng_and_mm_come_with_a_scale(
    model: LoadedModel,
) -> None:
    image = cv2.imread(str(DATA / "tall.png"))
    every, _ = FramePipeline(model, 180, 320, "bgr").process(image)
    assert isinstance(every, Instances)
    # The class of the shortest instance tolerates it, in mm at 0.1 mm per pixel, and nothing longer.
    shortest = min(range(len(every.polygons)), key=lambda i: every.sides[i][0])
    label, length = model.label(int(every.class_ids[shortest])), every.sides[shortest][0]
    limit_mm = (length + 0.05) * 0.1
    cfg = InspectConfig(ng_classes=[label], mm_per_px=0.1, max_length_mm={label: limit_mm})
    path = FramePath(model, "cam0", "bgr", Inspector(cfg, model.labels, 3, 0.25, 300, masks=True))
    done = path.run(Frame(image, 3, 0, 0, "bgr"))
    assert isinstance(done, Processed)
    msg = path.message(done, seq=0, thermal_state="ok")
    ours = [i for i, d in enumerate(msg.detections) if d.label == label]
    within = {i for i in ours if i < len(every.polygons) and every.sides[i][0] <= length + 0.05}
    assert shortest in within
    assert {i for i, d in enumerate(msg.detections) if d.note == "within limits"} == within
    assert {r.detection for r in msg.reasons} == set(ours) - within
    first = msg.detections[shortest]
    assert first.length_mm == pytest.approx(first.length_px * 0.1, abs=1e-3)
    assert first.area_mm2 == pytest.approx(first.area_px * 0.01, abs=1e-3)


def test_sizes_in_mm_under_a_micrometre_per_pixel_keep_their_digits(model: LoadedModel) -> None:
    # At 0.5 um per pixel a mask of 1000 pixels is 0.00025 mm2: rounded to 3 decimals it was published as 0.0.
    image = cv2.imread(str(DATA / "tall.png"))
    every, _ = FramePipeline(model, 180, 320, "bgr").process(image)
    assert isinstance(every, Instances) and every.polygons
    detections = every.message_fields(model.label, None, None, mm_per_px=0.0005)["detections"]
    for d, area, (length, width) in zip(detections, every.area_px, every.sides, strict=False):
        assert d.area_mm2 == pytest.approx(area * 0.0005**2, rel=1e-5) and d.area_mm2 > 0
        assert d.length_mm == pytest.approx(length * 0.0005, rel=1e-5)
        assert d.width_mm == pytest.approx(width * 0.0005, rel=1e-5)


@pytest.mark.parametrize(
    "limits",
    [{"max_length_mm": 1e6, "max_area_mm2": 1e6}, {"max_length_mm": 1e308}],
    ids=["large", "past-a-float-in-pixels"],  # 1e308 mm at 0.1 mm a pixel: tolerated nothing before
)
def test_a_class_without_size_limits_stays_ng_beside_one_that_has_them(model: LoadedModel, limits: dict[str, float]) -> None:
    image = cv2.imread(str(DATA / "tall.png"))
    path = FramePath(model, "cam0", "bgr", None)
    done = path.run(Frame(image, 3, 0, 0, "bgr"))
    assert isinstance(done, Processed)
    labels = [d.label for d in path.message(done, seq=0, thermal_state="ok").detections]
    limited = labels[0]
    assert set(labels) - {limited}, "the frame needs instances of a second class"
    # Limits no instance reaches, for one class only: every other class's instances stay NG.
    cfg = InspectConfig(mm_per_px=0.1, **{key: {limited: limit} for key, limit in limits.items()})
    path = FramePath(model, "cam0", "bgr", Inspector(cfg, model.labels, 3, 0.25, 300, masks=True))
    done = path.run(Frame(image, 3, 0, 0, "bgr"))
    assert isinstance(done, Processed)
    msg = path.message(done, seq=0, thermal_state="ok")
    assert [d.note for d in msg.detections] == ["within limits" if d.label == limited else None for d in msg.detections]
    assert {r.detection for r in msg.reasons} == {i for i, d in enumerate(msg.detections) if d.label != limited}
    assert msg.verdict == "ng"


@pytest.mark.parametrize("size", [(1280, 720), (1920, 1080), (640, 480), (720, 1280)])
def test_a_mask_mapped_over_its_box_alone_is_the_whole_frames_mapping_bit_for_bit(
    model: LoadedModel, size: tuple[int, int]
) -> None:
    # Frames a whole number of times the letterboxed content map each mask over its box's part of
    # the frame only; random smooth masks and boxes, some off the content, against the whole frame.
    w, h = size
    pipeline = FramePipeline(model, w, h, "bgr")
    segmenter, box_map = pipeline.decoder, pipeline.box_map
    assert isinstance(segmenter, Segmenter)
    segmenter._plan(box_map)
    side = box_map.input_w
    aligned = segmenter._whole
    assert aligned is not None
    rng = np.random.default_rng(0)
    for _ in range(40):
        noise = rng.standard_normal((side // 4, side // 4)).astype(np.float32) * 3 + np.float32(rng.uniform(-3, 1))
        logits = cv2.GaussianBlur(noise, (0, 0), 2).reshape(-1)
        x1, y1 = rng.uniform(-10, side - 20, 2)
        box = [float(x1), float(y1), float(x1 + rng.uniform(1, side / 2)), float(y1 + rng.uniform(1, side / 2))]
        over_box, over_frame = np.zeros((h, w), bool), np.zeros((h, w), bool)
        found = segmenter._mask(logits, box, box_map, over_box)
        segmenter._whole = None
        whole = segmenter._mask(logits, box, box_map, over_frame)
        segmenter._whole = aligned
        assert np.array_equal(over_box, over_frame)
        assert (found is None) == (whole is None)
        if found is not None and whole is not None:
            assert found[0] == whole[0]
            outside = over_box.copy()
            outside[found[1]] = False  # the mask is 0 outside the part of the frame it says
            assert not outside.any()


@pytest.mark.parametrize("size", [(1280, 720), (1920, 1080), (640, 480), (720, 1280), (320, 240)])
def test_a_retina_mask_made_over_its_box_alone_is_the_whole_frames_bit_for_bit(size: tuple[int, int]) -> None:
    # With retina masks, frames a whole number of times the native content make each mask over its
    # box's part of the frame, from the native and prototype pixels it needs: against the whole frame.
    cfg = ModelConfig(path=DATA / "seg.onnx", iou=0.7, max_det=300, max_masks=300, retina_masks=True)
    w, h = size
    pipeline = FramePipeline(load_model(cfg, RuntimeConfig()), w, h, "bgr")
    segmenter, box_map = pipeline.decoder, pipeline.box_map
    assert isinstance(segmenter, Segmenter)
    segmenter._plan(box_map)
    aligned = segmenter._native_whole
    assert aligned is not None
    rng = np.random.default_rng(2)
    side = segmenter._mh
    for _ in range(40):
        noise = rng.standard_normal((side, segmenter._mw)).astype(np.float32) * 3 + np.float32(rng.uniform(-3, 1))
        logits = cv2.GaussianBlur(noise, (0, 0), 2).reshape(-1)
        x1, y1 = rng.uniform(-10, w - 5), rng.uniform(-10, h - 5)
        box = [float(x1), float(y1), float(x1 + rng.uniform(1, w / 2)), float(y1 + rng.uniform(1, h / 2))]
        over_box, over_frame = np.zeros((h, w), bool), np.zeros((h, w), bool)
        found = segmenter._native_mask(logits, box, box_map, over_box)
        segmenter._native_whole = None
        assert segmenter._native_mask(logits, box, box_map, over_frame) == found
        segmenter._native_whole = aligned
        assert np.array_equal(over_box, over_frame)


@pytest.mark.parametrize("input_size", [(640, 640), (640, 384), (320, 320)])
def test_a_mask_upsampled_over_its_box_alone_is_the_whole_upsampled_mask_bit_for_bit(
    model: LoadedModel, input_size: tuple[int, int]
) -> None:
    # Inputs a whole number of times the prototypes upsample each mask over the prototype pixels
    # its box's pixels interpolate between; random masks and boxes, some off the input, some on its
    # edges, against the whole mask upsampled, and their outlines against the whole mask's.
    in_w, in_h = input_size
    pipeline = FramePipeline(model, 1280, 720, "bgr")
    segmenter = pipeline.decoder
    assert isinstance(segmenter, Segmenter)
    box_map = BoxMap.letterbox(1280, 720, in_w, in_h)
    segmenter._mh, segmenter._mw = in_h // 4, in_w // 4
    segmenter._plan(box_map)
    step = segmenter._step
    assert step == (4, 4)
    rng = np.random.default_rng(1)
    for _ in range(60):
        logits = (rng.standard_normal(in_h * in_w // 16) * 3).astype(np.float32)
        x1, x2 = sorted(rng.uniform(-20, in_w + 20, 2))
        y1, y2 = sorted(rng.uniform(-20, in_h + 20, 2))
        r0, r1, c0, c1 = max(math.ceil(y1), 0), min(math.ceil(y2), in_h), max(math.ceil(x1), 0), min(math.ceil(x2), in_w)
        if r1 <= r0 or c1 <= c0:
            continue
        part = segmenter._upsampled(logits, box_map, r0, r1, c0, c1).copy()
        segmenter._step = None
        whole = segmenter._upsampled(logits, box_map, r0, r1, c0, c1).copy()
        segmenter._step = step
        assert np.array_equal(part, whole)
        mask = np.zeros((in_h, in_w), bool)
        np.greater(part, 0, out=mask[r0:r1, c0:c1])
        inside = (slice(r0, r1), slice(c0, c1))
        outline = segmenter._outline(mask, inside, 0, in_input=True).copy()
        everywhere = segmenter._outline(mask, (slice(0, in_h), slice(0, in_w)), 0, in_input=True)
        assert np.array_equal(outline, everywhere)


def test_limits_in_mm_need_the_cameras_scale(model: LoadedModel) -> None:
    with pytest.raises(ConfigError, match=r"need the camera's scale, inspect\.mm_per_px"):
        Inspector(InspectConfig(max_area_mm2={"dent": 4.0}), model.labels, 3, 0.25, 300, masks=True)


@pytest.mark.unit
@pytest.mark.parametrize("scale", [1e-300, 1e300, 1e-7, 1e5])
def test_a_scale_no_camera_has_is_refused_naming_mm_per_px_not_a_traceback(scale: float) -> None:
    with pytest.raises(ValidationError) as e:  # 1e-300 divided by zero, 1e300 overflowed, squared
        InspectConfig(mm_per_px=scale, max_area_mm2={"dent": 4.0})
    assert [error["loc"] for error in e.value.errors()] == [("mm_per_px",)]
    assert InspectConfig(mm_per_px=1e-6, max_area_mm2={"dent": 4.0}).mm_per_px == 1e-6
    assert InspectConfig(mm_per_px=1e4).mm_per_px == 1e4


@pytest.mark.parametrize("name", FRAMES)
def test_retina_masks_are_ultralytics_retina_masks(name: str) -> None:
    cfg = ModelConfig(path=DATA / "seg.onnx", iou=0.7, max_det=300, max_masks=300, retina_masks=True)
    image = cv2.imread(str(DATA / f"{name}.png"))
    h, w = image.shape[:2]
    instances, _ = FramePipeline(load_model(cfg, RuntimeConfig()), w, h, "bgr").process(image)
    assert isinstance(instances, Instances)
    expected_masks = np.unpackbits(REFERENCE[f"{name}/retina_masks"], axis=-1)[..., :w].astype(bool)
    assert len(instances.masks) == len(expected_masks) > 0
    for mask, expected in zip(instances.masks, expected_masks, strict=True):
        assert (mask & expected).sum() / (mask | expected).sum() >= 0.99


@pytest.mark.parametrize("retina", [False, True])
def test_a_mask_buffer_the_next_frame_reuses_holds_that_frames_mask_alone(retina: bool) -> None:
    # Only the part of a mask buffer the last mask was written to is cleared for the next: frames
    # whose instances lie elsewhere, after one another on one pipeline, against each on a new one.
    cfg = ModelConfig(path=DATA / "seg.onnx", iou=0.7, max_det=300, max_masks=300, retina_masks=retina)
    model = load_model(cfg, RuntimeConfig())
    image = cv2.imread(str(DATA / "wide.png"))
    frames = [image, cv2.flip(image, -1), np.ascontiguousarray(image[::-1]), image]
    pipeline = FramePipeline(model, 320, 240, "bgr")
    for frame in frames:
        reused, _ = pipeline.process(frame)
        fresh, _ = FramePipeline(model, 320, 240, "bgr").process(frame)
        assert isinstance(reused, Instances) and isinstance(fresh, Instances)
        assert len(reused.masks) == len(fresh.masks) > 0
        assert np.array_equal(reused.masks, fresh.masks)
        assert reused.area_px == fresh.area_px


def test_zones_place_an_instance_by_its_mask_and_keep_its_outline_when_others_are_dropped(model: LoadedModel) -> None:
    image = cv2.imread(str(DATA / "wide.png"))
    every, _ = FramePipeline(model, 320, 240, "bgr").process(image)
    assert isinstance(every, Instances)
    # A zone over the left third of the frame (x < 106.7): an instance is in it when any of its mask is.
    left = [(0.0, 0.0), (1 / 3, 0.0), (1 / 3, 1.0), (0.0, 1.0)]
    in_left = [i for i, mask in enumerate(every.masks) if mask[:, :106].any()]
    by_box = [i for i in range(len(every.polygons)) if (every.xyxy[i, 0] + every.xyxy[i, 2]) / 2 < 320 / 3]
    assert set(in_left) != set(by_box)  # the masks decide other than the boxes' centres would
    cfg = InspectConfig(zones={"left": left})
    path = FramePath(model, "cam0", "bgr", Inspector(cfg, model.labels, 3, 0.25, 300, masks=True))
    done = path.run(Frame(image, 3, 0, 0, "bgr"))
    assert isinstance(done, Processed) and isinstance(done.result, Instances)
    msg = path.message(done, seq=0, thermal_state="ok")
    masked = [d for d in msg.detections if d.polygon is not None]
    assert [d.area_px for d in masked] == [every.area_px[i] for i in in_left]
    assert {d.zone for d in msg.detections} == {"left"}


@pytest.mark.unit
def test_the_class_scores_edged_eval_masks_are_the_scores_alone_not_the_mask_coefficients() -> None:
    output = np.zeros((1, 4 + 3 + 32, 10), np.float32)
    scores = SegmentHead.class_scores(output)
    assert scores.shape == (3, 10)
    scores[:] = 1.0
    assert output[0, 4:7].all() and not output[0, 7:].any()


def test_a_float16_export_is_segmented_not_a_crash(tmp_path: Path) -> None:
    # Both outputs cast to float16 inside the graph, as a half-precision export hands them out.
    graph = onnx.load(str(DATA / "seg.onnx"))
    for output in graph.graph.output:
        graph.graph.node.append(helper.make_node("Cast", [output.name], [output.name + "_f16"], to=TensorProto.FLOAT16))
        output.name += "_f16"
        output.type.tensor_type.elem_type = TensorProto.FLOAT16
    onnx.save(graph, str(tmp_path / "seg16.onnx"))
    image = cv2.imread(str(DATA / "square.png"))
    half = load_model(ModelConfig(path=tmp_path / "seg16.onnx", iou=0.7, max_det=300, max_masks=300), RuntimeConfig())
    instances, _ = FramePipeline(half, 200, 200, "bgr").process(image)
    assert isinstance(instances, Instances)
    # float16 rounds the scores, so one near the threshold may come or go: the masks are made all the same.
    assert abs(len(instances) - len(REFERENCE["square/cls"])) <= 2
    assert len(instances.polygons) == len(instances) and all(mask.any() for mask in instances.masks)


def _arrays_made(
    path: FramePath, frame: Frame, each: Callable[[VerdictRecord | None], object] = lambda record: None
) -> tuple[Instances, int]:
    """``path`` run on ``frame`` three times (warm-up), then five times counting the numpy arrays made,
    each frame's verdict record handed to ``each``: the last frame's instances, and the count."""
    counter = NumpyAllocations.get()
    assert counter is not None
    for _ in range(3):
        path.run(frame)
    with counter.counting():
        before = counter.buffers
        for _ in range(5):
            done = path.run(frame)
            assert isinstance(done, Processed) and isinstance(done.result, Instances)
            each(path.verdict_record(done, None))
        return done.result, counter.buffers - before


@pytest.mark.parametrize("retina", [False, True])
def test_a_segmented_frame_creates_no_arrays_but_opencvs_contours(retina: bool) -> None:
    # From contract check to verdict, with size limits judged: after warm-up a frame allocates only
    # what cv2.findContours returns, per mask (each of tall's is one piece) its contour and hierarchy.
    cfg = ModelConfig(path=DATA / "seg.onnx", iou=0.7, max_det=300, max_masks=300, retina_masks=retina)
    model = load_model(cfg, RuntimeConfig())
    inspect = InspectConfig(ng_classes=["dent"], mm_per_px=0.1, max_length_mm={"dent": 5.0}, max_area_mm2={"dent": 40.0})
    path = FramePath(model, "cam0", "bgr", Inspector(inspect, model.labels, 3, 0.25, 300, masks=True))
    records: list[VerdictRecord | None] = []
    found, created = _arrays_made(path, Frame(cv2.imread(str(DATA / "tall.png")), 3, 0, 0, "bgr"), records.append)
    masks = len(found.polygons)
    assert masks >= 5 and records[-1] is not None
    assert created == 5 * 2 * masks


def spoiled_prototypes(path: Path, value: float) -> Path:
    """The ``-seg`` export with ``value`` (NaN, inf) added to its prototypes inside the graph: output1
    is all ``value``, output0 as it was."""
    graph = onnx.load(str(DATA / "seg.onnx"))
    protos = next(o for o in graph.graph.output if o.name == "output1")
    spoil = numpy_helper.from_array(np.full((1, 1, 1, 1), value, np.float32), "spoil")
    graph.graph.node.append(helper.make_node("Constant", [], ["spoil_c"], value=spoil))
    graph.graph.node.append(helper.make_node("Add", ["output1", "spoil_c"], ["output1_spoiled"]))
    protos.name = "output1_spoiled"
    onnx.save(graph, str(path))
    return path


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_nan_or_inf_prototypes_count_as_a_nonfinite_output_not_a_frame_without_defects(tmp_path: Path, value: float) -> None:
    # Every kept detection's mask is made from them: before, each came out empty and was dropped, unseen.
    model = load_model(ModelConfig(path=spoiled_prototypes(tmp_path / "m.onnx", value), iou=0.7), RuntimeConfig())
    instances, _ = FramePipeline(model, 180, 320, "bgr").process(cv2.imread(str(DATA / "tall.png")))
    assert isinstance(instances, Instances)
    assert instances.problems() == [("nonfinite_output", 32 * 40 * 40)]
    path = FramePath(model, "cam0", "bgr", Inspector(InspectConfig(), model.labels, 3, 0.25, 100, masks=True))
    done = path.run(Frame(cv2.imread(str(DATA / "tall.png")), 3, 0, 0, "bgr"))
    assert isinstance(done, Processed) and done.inspected is not None
    # Their masks are empty, so the detections are still dropped, as ultralytics drops them: the
    # frame is one the model could not judge, not an OK part.
    assert (done.inspected.verdict, len(done.result)) == ("uncertain", 0)


def test_mask_buffers_past_the_budget_are_refused_naming_max_masks_and_the_frame_size() -> None:
    # 3840x2160: 8.3 MB a mask. The most that fit in the budget are planned; one more is refused
    # before any buffer is made (max_masks = 10000 was a 77 GiB allocation, and a traceback).
    image = np.zeros((2160, 3840, 3), np.uint8)
    box_map = BoxMap.letterbox(3840, 2160, 160, 160)
    fit = MASK_BUFFER_BUDGET // mask_bytes(box_map, 40 * 40, retina=False)
    assert 100 < fit < 200
    most = load_model(ModelConfig(path=DATA / "seg.onnx", max_masks=fit), RuntimeConfig())
    FramePipeline(most, 3840, 2160, "bgr").process(image)
    for max_masks in (fit + 1, 10000):
        model = load_model(ModelConfig(path=DATA / "seg.onnx", max_masks=max_masks), RuntimeConfig())
        pipeline = FramePipeline(model, 3840, 2160, "bgr")
        with pytest.raises(ModelError) as e:
            pipeline.process(image)
        for words in (f"model.max_masks = {max_masks}", "3840x2160", "GiB", f"set model.max_masks to {fit} or less"):
            assert words in str(e.value)


def _constant_seg_export(
    path: Path, output0: np.ndarray, prototypes: np.ndarray, metadata: dict[str, str], imgsz: int = 64
) -> Path:
    """An export at ``imgsz`` whose outputs are ``output0`` and ``prototypes`` whatever the input (it is
    read, times 0)."""
    nodes = [
        helper.make_node("ReduceMean", ["images"], ["mean"], keepdims=0),
        helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.zeros((), np.float32), "z")),
        helper.make_node("Mul", ["mean", "zero"], ["nothing"]),
    ]
    outputs = []
    for name, value in (("output0", output0), ("output1", prototypes)):
        nodes.append(helper.make_node("Constant", [], [name + "_c"], value=numpy_helper.from_array(value, name + "_v")))
        nodes.append(helper.make_node("Add", [name + "_c", "nothing"], [name]))
        outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(value.shape)))
    images = helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, imgsz, imgsz])
    model = helper.make_model(
        helper.make_graph(nodes, "seg", [images], outputs), opset_imports=[helper.make_opsetid("", 18)]
    )
    model.ir_version = 8
    helper.set_model_props(model, metadata)
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize(("classes", "candidates"), [(80, 84), (2, 20)])
def test_a_small_seg_export_with_fewer_candidates_than_rows_is_segmented(
    tmp_path: Path, classes: int, candidates: int
) -> None:
    # 80 classes at imgsz 64: [1, 116, 84] (8*8 + 4*4 + 2*2 candidates), which the lengths alone read
    # as a yolov5 head of 79 classes. One candidate of class 1, its mask the first prototype.
    output0 = np.zeros((1, 4 + classes + 32, candidates), np.float32)
    output0[0, :4, 0] = (32, 32, 16, 16)
    output0[0, 4 + 1, 0] = 0.9
    output0[0, 4 + classes, 0] = 1.0
    prototypes = np.zeros((1, 32, 16, 16), np.float32)
    prototypes[0, 0] = 1.0
    names = str({i: f"c{i}" for i in range(classes)})
    path = _constant_seg_export(tmp_path / "m.onnx", output0, prototypes, {"task": "segment", "names": names})
    model = load_model(ModelConfig(path=path), RuntimeConfig())
    assert (model.head, model.task, model.num_classes) == ("segment", "segment", classes)
    instances, _ = FramePipeline(model, 64, 64, "bgr").process(np.zeros((64, 64, 3), np.uint8))
    assert isinstance(instances, Instances)
    assert instances.class_ids.tolist() == [1] and instances.area_px == (16 * 16,)


def covering_seg_export(path: Path, mask: np.ndarray, imgsz: int = 320, classes: int = 3) -> Path:
    """An export at ``imgsz`` with one detection per class, each over most of the input, whose mask
    logits are ``mask`` (the first prototype, ``imgsz`` / 4 square, +1 in the mask and -1 outside)."""
    output0 = np.zeros((1, 4 + classes + 32, classes), np.float32)
    for c in range(classes):
        output0[0, :4, c] = (imgsz / 2, imgsz / 2, imgsz - 8, imgsz - 8)
        output0[0, 4 + c, c] = 0.9
        output0[0, 4 + classes, c] = 1.0
    prototypes = np.zeros((1, 32, imgsz // 4, imgsz // 4), np.float32)
    prototypes[0, 0] = np.where(mask, 1.0, -1.0)
    names = str({c: f"c{c}" for c in range(classes)})
    return _constant_seg_export(path, output0, prototypes, {"task": "segment", "names": names}, imgsz)


def fragmented_seg_export(path: Path, imgsz: int = 320, classes: int = 3) -> Path:
    """`covering_seg_export` whose masks are every other prototype pixel each way: each mask breaks
    into a piece per such pixel (900 of them in a 640x360 frame at imgsz 320), as the masks of a
    broken or badly trained export, or of a textured part, may."""
    dots = np.zeros((imgsz // 4, imgsz // 4), bool)
    dots[::2, ::2] = True
    return covering_seg_export(path, dots, imgsz, classes)


GREY = np.full((360, 640, 3), 114, np.uint8)


@pytest.mark.parametrize("retina", [False, True])
def test_a_mask_in_hundreds_of_pieces_is_outlined_in_at_most_max_outline_points_its_sizes_the_whole_masks(
    tmp_path: Path, retina: bool
) -> None:
    # Its joined outline was about 15000 points, 40000 with retina masks: 200 kB and more of a message each.
    path = fragmented_seg_export(tmp_path / "m.onnx")
    sizes = set()
    for bound in (8, 300, 2000):
        cfg = ModelConfig(path=path, retina_masks=retina, max_outline_points=bound)
        instances, _ = FramePipeline(load_model(cfg, RuntimeConfig()), 640, 360, "bgr").process(GREY)
        assert isinstance(instances, Instances) and len(instances.polygons) == 3
        assert all(bound // 2 < len(polygon) <= bound for polygon in instances.polygons)
        assert instances.problems() == [("outline_thinned", 3)]
        assert instances.area_px == tuple(int(np.count_nonzero(mask)) for mask in instances.masks)
        sizes.add((instances.area_px, instances.sides))
        if retina:  # the outline is the frame mask's: its points are the mask's contours', its sides all of theirs
            contours, _ = cv2.findContours(instances.masks[0].view(np.uint8), cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
            assert len(contours) > 500
            every = np.concatenate(contours).reshape(-1, 2)
            assert {tuple(p) for p in instances.polygons[0].astype(int).tolist()} <= {tuple(p) for p in every.tolist()}
            (_, _), (w, h), _ = cv2.minAreaRect(every)
            assert instances.sides[0] == pytest.approx((max(w, h), min(w, h)), abs=1e-3)
    assert len(sizes) == 1  # the same areas, lengths and widths whatever the bound


def test_the_outline_of_a_part_in_specks_keeps_its_largest_pieces_whole(tmp_path: Path) -> None:
    # A disc among specks, too many to join within the bound: the disc's outline is kept whole, beside
    # the largest specks, not the whole outline thinned into a zigzag between specks.
    yy, xx = np.mgrid[:80, :80]
    specks = np.zeros((80, 80), bool)
    specks[::2, ::2] = True
    mask = ((yy - 40) ** 2 + (xx - 40) ** 2 < 12**2) | (specks & ((yy - 40) ** 2 + (xx - 40) ** 2 >= 16**2))
    cfg = ModelConfig(path=covering_seg_export(tmp_path / "m.onnx", mask), retina_masks=True)
    instances, _ = FramePipeline(load_model(cfg, RuntimeConfig()), 640, 360, "bgr").process(GREY)
    assert isinstance(instances, Instances) and instances.thinned == 3
    contours, _ = cv2.findContours(instances.masks[0].view(np.uint8), cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
    disc = max(contours, key=len).reshape(-1, 2)
    assert len(disc) > 100 and sum(map(len, contours)) > 2000
    outline = {tuple(p) for p in instances.polygons[0].astype(int).tolist()}
    assert {tuple(p) for p in disc.tolist()} <= outline and len(instances.polygons[0]) <= 2000


def test_a_fragmented_masks_message_and_label_hold_at_most_max_outline_points_a_mask(tmp_path: Path) -> None:
    model = load_model(ModelConfig(path=fragmented_seg_export(tmp_path / "m.onnx"), max_outline_points=500), RuntimeConfig())
    # Through a zone, whose inspection keeps the instances inside it: the thinned outlines are still counted.
    zone = InspectConfig(zones={"all": [(0.0, 0.0), (1.0, 0.0), (1.0, 1.0), (0.0, 1.0)]})
    path = FramePath(model, "cam0", "bgr", Inspector(zone, model.labels, 3, 0.25, 100, masks=True))
    done = path.run(Frame(GREY, 3, 0, 0, "bgr"))
    assert isinstance(done, Processed) and isinstance(done.result, Instances)
    assert done.result.problems() == [("outline_thinned", 3)]
    payload = path.message(done, seq=0, thermal_state="ok").model_dump_json().encode()
    msg = parse_message(payload)
    assert [len(d.polygon or []) for d in msg.detections] == [len(p) for p in done.result.polygons]
    assert all(250 < len(d.polygon or []) <= 500 for d in msg.detections)
    assert len(payload) < 3 * 500 * 16 + 3000  # 16 bytes a point at most, and the rest of the message
    # The evidence label: a YOLO segmentation label as `edged eval` (and ultralytics) reads it.
    label = tmp_path / "frame.txt"
    label.write_text(done.labelled.dataset_label(640, 360))
    _, classes, outlines = read_yolo_outlines(label, 640, 360, 3)
    assert classes.tolist() == [0, 1, 2] and [len(o) for o in outlines] == [len(p) for p in done.result.polygons]


def test_a_thinned_one_piece_outline_creates_no_arrays_but_opencvs_contours(tmp_path: Path) -> None:
    # A disc filling the input, its outline (hundreds of points) thinned to 8: its every point and its
    # thinned outline go into buffers made once, as an outline within the bound does.
    yy, xx = np.mgrid[:80, :80]
    disc = covering_seg_export(tmp_path / "m.onnx", (yy - 40) ** 2 + (xx - 40) ** 2 < 38**2)
    model = load_model(ModelConfig(path=disc, max_outline_points=8), RuntimeConfig())
    path = FramePath(model, "cam0", "bgr", Inspector(InspectConfig(), model.labels, 3, 0.25, 100, masks=True))
    found, created = _arrays_made(path, Frame(GREY, 3, 0, 0, "bgr"))
    assert found.thinned == len(found.polygons) == 3
    assert created == 5 * 2 * 3


def test_a_candidate_whose_outlines_are_thinned_is_compared_not_failed(tmp_path: Path) -> None:
    # A thinned outline is counted, but the candidate's boxes are whole: the frame is compared.
    live = fragmented_seg_export(tmp_path / "live.onnx")
    trial = CandidateConfig(
        path=fragmented_seg_export(tmp_path / "candidate.onnx"), sample_every=1, control=f"ipc://{tmp_path}/c.sock"
    )
    s = Settings(model=ModelConfig(path=live, candidate=trial), source=(SyntheticSourceConfig(width=640, height=360),))
    model = load_model(s.model, s.runtime)
    done = frame_path(s, model, s.source[0]).run(Frame(GREY, 0, time.monotonic_ns(), time.time_ns(), "bgr"))
    assert isinstance(done, Processed) and done.result.problems() == [("outline_thinned", 3)]
    shadow = Shadow(s, trial, model)
    shadow.observe("cam0", done)
    assert shadow.run(10.0)
    report = shadow.report()
    assert (report.frames, report.failed_frames, report.agreement) == (1, 0, 1.0)
