"""Anomaly models (anomalib 2.x exports): edged's scores, maps, labels and masks are anomalib's own.

tests/data/anomaly holds a PaDiM and a PatchCore export made by anomalib's own ONNX export (PaDiM's
dynamic, PatchCore's static at a batch of 1) and ``Engine.predict``'s results on frames of several
sizes and aspect ratios (tests/reference/build_anomalib.py), which resize with antialiasing before
the model. edged reads the frames as a camera delivers them (BGR
uint8) and must give the same numbers.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import onnxruntime as ort
import pytest
from allocations import NumpyAllocations

from edged.anomaly import Anomaly, AnomalyDecoder
from edged.config import ModelConfig, RuntimeConfig
from edged.errors import ConfigError, ContractError, HeadError
from edged.geometry import BoxMap
from edged.heads.anomaly import AnomalyHead
from edged.messages import DetectionsMessage, ModelInfo, Timings
from edged.model import LoadedModel, load_model
from edged.pipeline import WITHIN_LIMITS, FramePath, FramePipeline, Processed
from edged.preprocess import AntialiasPreprocessor, antialias_taps
from edged.settings.inspect import InspectConfig
from edged.sources.base import Frame
from edged.verdict import AnomalyInspected, AnomalyInspector

DATA = Path(__file__).parent / "data" / "anomaly"
MODEL = DATA / "padim.onnx"
REFERENCE: dict[str, Any] = json.loads((DATA / "padim.json").read_text())
FRAMES = sorted(name for name in REFERENCE if not name.startswith("_"))
KINDS = ("padim", "patchcore")
_LOADED: dict[str, LoadedModel] = {}


def loaded(kind: str) -> LoadedModel:
    if kind not in _LOADED:
        _LOADED[kind] = load_model(ModelConfig(path=DATA / f"{kind}.onnx"), RuntimeConfig(intra_op_threads=1))
    return _LOADED[kind]


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return loaded("padim")


def run(model: LoadedModel, name: str) -> tuple[Anomaly, FramePipeline]:
    image = cv2.imread(str(DATA / f"{name}.png"))
    plan = FramePipeline(model, image.shape[1], image.shape[0], "bgr")
    result, _ = plan.process(image)
    assert isinstance(result, Anomaly)
    return result, plan


def output(model: LoadedModel, plan: FramePipeline, name: str) -> np.ndarray:
    return plan.binding.outputs[[o.name for o in model.engine.output_meta].index(name)][0, 0]


@pytest.mark.unit
def test_an_anomalib_export_is_recognised_fed_rgb_0_to_1_at_its_trained_size_with_antialiasing(model: LoadedModel) -> None:
    assert (model.head, model.task, model.labels) == ("anomaly", "anomaly", ["anomaly"])
    c = model.contract
    assert (c.shape, c.layout, c.channel_order, c.resize, c.dtype) == (
        (1, 3, 256, 256),
        "nchw",
        "rgb",
        "antialias",
        np.float32,
    )
    assert (c.scale, c.mean, c.std) == (1 / 255, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))


@pytest.mark.unit
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", FRAMES)
def test_score_label_map_and_mask_are_anomalibs_on_frames_of_every_size(kind: str, name: str) -> None:
    model = loaded(kind)
    result, plan = run(model, name)
    expected = json.loads((DATA / f"{kind}.json").read_text())[name]
    maps = np.load(DATA / f"{kind}_maps.npz")
    assert result.score == pytest.approx(expected["pred_score"], rel=1e-4)
    assert result.anomalous is expected["pred_label"]
    assert result.threshold == 0.5
    np.testing.assert_allclose(output(model, plan, "anomaly_map"), maps[f"{name}_map"], atol=1e-3, rtol=0)
    assert np.array_equal(output(model, plan, "pred_mask").astype(bool), maps[f"{name}_mask"])


@pytest.mark.unit
def test_the_export_fed_the_full_frame_scores_differently_which_is_why_edged_resizes_first(model: LoadedModel) -> None:
    # What anomalib's users report: the graph's own resize has no antialiasing.
    name = "good_1280x720"
    image = cv2.imread(str(DATA / f"{name}.png"))[:, :, ::-1].astype(np.float32) / 255
    session = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    naive = float(session.run(["pred_score"], {"input": np.ascontiguousarray(image.transpose(2, 0, 1)[None])})[0][0, 0])
    assert abs(naive - REFERENCE[name]["pred_score"]) > 0.05
    assert abs(run(model, name)[0].score - REFERENCE[name]["pred_score"]) < 1e-5


def dense(n_in: int, n_out: int) -> np.ndarray:
    """The resize of `antialias_taps` as an (n_out, n_in) matrix."""
    indices, weights = antialias_taps(n_in, n_out)
    matrix = np.zeros((n_out, n_in), dtype=np.float64)
    for row_indices, row_weights in zip(indices, weights, strict=True):
        np.add.at(matrix, (np.arange(n_out), row_indices), row_weights)
    return matrix


@pytest.mark.unit
@pytest.mark.parametrize(("n_in", "n_out"), [(720, 256), (256, 256), (200, 256), (1000, 3)])
def test_antialias_taps_sum_to_one_and_are_the_identity_at_the_same_size(n_in: int, n_out: int) -> None:
    weights = dense(n_in, n_out)
    assert (weights >= 0).all()
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-6)
    if n_in == n_out:
        assert np.array_equal(weights, np.eye(n_in))


@pytest.mark.unit
def test_the_antialiased_resize_is_the_matrix_product_and_allocates_nothing(model: LoadedModel) -> None:
    image = cv2.imread(str(DATA / "good_1280x720.png"))
    pre = AntialiasPreprocessor(model.contract, 1280, 720, "bgr")
    pre(image)
    counter = NumpyAllocations.get()
    assert counter is not None
    with counter.counting():
        before = counter.buffers
        tensor = pre(image)
        assert counter.buffers == before
    rgb = image[:, :, ::-1].astype(np.float64) / 255
    expected = np.stack([dense(720, 256) @ rgb[:, :, c] @ dense(1280, 256).T for c in range(3)])
    np.testing.assert_allclose(tensor[0], expected, atol=1e-5)


@pytest.mark.unit
def test_regions_are_the_masks_components_as_boxes_in_frame_pixels_with_area_and_peak(model: LoadedModel) -> None:
    result, plan = run(model, "scratch_200x300")
    mask = output(model, plan, "pred_mask").astype(np.uint8)
    n, _, stats, _ = cv2.connectedComponentsWithStats(mask, connectivity=8)
    assert len(result.scores) == n - 1 >= 1
    x, y, w, h, area = stats[1:][np.argmax(stats[1:, 4])].tolist()
    sx, sy = 256 / 200, 256 / 300
    np.testing.assert_allclose(result.xyxy[0], [x / sx, y / sy, (x + w) / sx, (y + h) / sy], rtol=1e-6)
    assert result.area_px[0] == pytest.approx(area / (sx * sy))
    assert 0.5 < result.scores[0] <= output(model, plan, "anomaly_map").max()
    fields = result.message_fields(model.label, None, None)
    assert fields["task"] == "anomaly" and fields["detections"] == [] and fields["anomalous"] is True
    region = fields["regions"][0]
    assert len(region.polygon) >= 3
    xs, ys = [p[0] for p in region.polygon], [p[1] for p in region.polygon]
    assert region.box[0] - 1 <= min(xs) and max(xs) <= region.box[2] + 1
    assert region.box[1] - 1 <= min(ys) and max(ys) <= region.box[3] + 1
    assert result.dataset_label(200, 300).startswith("0 ")


@pytest.mark.unit
def test_thresholds_in_config_override_the_exports() -> None:
    cfg = ModelConfig(path=MODEL, anomaly_threshold=0.95, pixel_threshold=0.9)
    strict = load_model(cfg, RuntimeConfig(intra_op_threads=1))
    ok, _ = run(strict, "spot_320x240")
    ng, plan = run(strict, "scratch_200x300")
    assert (ok.anomalous, ok.threshold, ng.anomalous) == (False, 0.95, True)
    above = output(strict, plan, "anomaly_map") > 0.9
    assert round(sum(ng.area_px.tolist()) * (256 / 200) * (256 / 300)) == int(above.sum())


@pytest.mark.unit
@pytest.mark.parametrize(("name", "regions"), [("good_320x240", 0), ("scratch_200x300", 2)])
def test_post_processing_creates_no_arrays_with_or_without_regions(model: LoadedModel, name: str, regions: int) -> None:
    counter = NumpyAllocations.get()
    assert counter is not None
    result, plan = run(model, name)
    expected = (result.xyxy.copy(), result.area_px.copy(), result.scores.copy())
    decoder = plan.decoder
    assert isinstance(decoder, AnomalyDecoder)
    outputs, box_map = plan.binding.outputs, plan.box_map
    with counter.counting():
        before = counter.buffers
        again = decoder.decode(outputs, box_map)
        assert counter.buffers == before
    assert len(again.scores) == regions
    for got, want in zip((again.xyxy, again.area_px, again.scores), expected, strict=True):
        assert np.array_equal(got, want)


@pytest.mark.unit
def test_verdict_is_ng_when_anomalous_and_zones_judge_the_regions(model: LoadedModel) -> None:
    result, _ = run(model, "scratch_200x300")
    assert AnomalyInspector(InspectConfig(), 100)(result, 200, 300).verdict == "ng"
    inside = InspectConfig(zones={"left": [[0, 0], [0.7, 0], [0.7, 1], [0, 1]]})
    judged = AnomalyInspector(inside, 100)(result, 200, 300)
    assert judged.verdict == "ng" and judged.ng[judged.reason_region]
    elsewhere = InspectConfig(zones={"corner": [[0.9, 0.9], [1, 0.9], [1, 1], [0.9, 1]]})
    assert AnomalyInspector(elsewhere, 100)(result, 200, 300).verdict == "ok"
    good, _ = run(model, "good_320x240")
    assert AnomalyInspector(InspectConfig(), 100)(good, 320, 240).verdict == "ok"


@pytest.mark.unit
def test_with_the_cameras_scale_a_regions_message_gives_its_area_in_mm2(model: LoadedModel) -> None:
    image = cv2.imread(str(DATA / "scratch_200x300.png"))
    messages = []
    for scale in (None, 0.1):
        path = FramePath(model, "cam0", "bgr", AnomalyInspector(InspectConfig(mm_per_px=scale), 100))
        done = path.run(Frame(image, 1, time.monotonic_ns(), time.time_ns(), "bgr"))
        assert isinstance(done, Processed)
        messages.append(path.message(done, seq=0, thermal_state="ok"))
    plain, scaled = (m.regions for m in messages)
    assert plain and scaled and messages[1].verdict == "ng"
    assert plain[0].area_mm2 is None and "area_mm2" not in messages[0].model_dump_json()
    assert scaled[0].area_mm2 == pytest.approx(scaled[0].area_px * 0.01, abs=1e-3)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("keys", "words"),
    [
        ({"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}, ["model.mean", "ImageNet", "inside"]),
        ({"scale": 1.0}, ["model.scale", "0..1"]),
        ({"channel_order": "bgr"}, ["'bgr'", "RGB"]),
        ({"imgsz": 320}, ["[320, 320]", "trained at [256, 256]", "antialiasing"]),
    ],
)
def test_a_config_that_feeds_the_wrong_range_order_or_size_is_refused_naming_it(
    keys: dict[str, Any], words: list[str]
) -> None:
    with pytest.raises(ContractError) as info:
        load_model(ModelConfig(path=MODEL, **keys), RuntimeConfig(intra_op_threads=1))
    assert all(word in str(info.value) for word in words), info.value


@pytest.mark.unit
def test_forcing_a_detection_head_on_an_anomaly_export_is_refused() -> None:
    with pytest.raises(ContractError):
        load_model(ModelConfig(path=MODEL, head="yolov8"), RuntimeConfig(intra_op_threads=1))


@pytest.mark.unit
def test_patchcores_default_export_fixed_at_a_batch_of_two_is_refused_by_name() -> None:
    # The shapes of anomalib's own default PatchCore export, recorded when the test data was made.
    exported = json.loads((DATA / "patchcore.json").read_text())["_exports"]["default_export"]
    outputs = [(name, shape) for name, shape in exported.items() if name != "input"]
    assert exported["input"][0] == 2
    with pytest.raises(HeadError, match=r"batch of 2.*re-export the model with a batch of 1.*PatchCore"):
        AnomalyHead.check(outputs)
    AnomalyHead.check([("pred_score", ["batch_size", 1]), ("anomaly_map", ["batch_size", 1, 256, 256])])


@pytest.mark.unit
@pytest.mark.parametrize(
    ("keys", "words"),
    [
        ({"class_conf": {"anomaly": 0.5}}, ["inspect.class_conf", "model.anomaly_threshold"]),
        ({"ng_classes": ["anomaly"]}, ["inspect.ng_classes", "model.anomaly_threshold"]),
        ({"min_confidence": 0.5}, ["inspect.min_confidence", "classification models"]),
        ({"max_area_px": {"dent": 10.0}}, ["inspect.max_area_px", "the one class 'anomaly'", "dent"]),
        ({"mm_per_px": 0.1, "max_length_mm": {"0": 1.0}}, ["inspect.max_length_mm", "the one class 'anomaly'"]),
        ({"max_area_mm2": {"anomaly": 1.0}}, ["max_area_mm2 need the camera's scale, inspect.mm_per_px"]),
        ({"max_length_mm": {"anomaly": 1.0}}, ["inspect.max_length_mm", "inspect.mm_per_px"]),
    ],
)
def test_inspect_keys_that_mean_nothing_for_an_anomaly_model_or_name_another_class_are_refused_naming_them(
    keys: dict[str, Any], words: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        AnomalyInspector(InspectConfig(**keys), 100)
    assert all(word in str(info.value) for word in words), info.value


MAP = 64  # the synthetic model's map: 64 x 64, stretched over frames of other sizes


def decoded(shapes: list[tuple[str, tuple[int, ...]]], frame: tuple[int, int] = (128, 256), score: float = 0.9) -> Anomaly:
    """A frame of a synthetic model whose mask holds ``shapes``: ("rect", (x1, y1, x2, y2)) filled, or
    ("line", (x1, y1, x2, y2)) one map pixel wide, in map pixels."""
    mask = np.zeros((1, 1, MAP, MAP), dtype=np.uint8)
    for kind, (x1, y1, x2, y2) in shapes:
        if kind == "rect":
            mask[0, 0, y1:y2, x1:x2] = 1
        else:
            cv2.line(mask[0, 0], (x1, y1), (x2, y2), 1, 1)
    decoder = AnomalyDecoder([("pred_score", (1,)), ("pred_mask", (1, 1, MAP, MAP))])
    return decoder.decode([np.array([score], dtype=np.float32), mask], BoxMap.stretch(*frame, MAP, MAP))


def judge(result: Anomaly, frame: tuple[int, int] = (128, 256), **keys: Any) -> tuple[AnomalyInspected, list[Any]]:
    """The inspector's verdict on ``result`` and the regions of its message."""
    inspector = AnomalyInspector(InspectConfig(**keys), 100)
    judged = inspector(result, *frame)
    notes = [WITHIN_LIMITS if w else None for w in judged.within.tolist()]
    fields = result.message_fields(lambda _: "anomaly", None, None, notes=notes, mm_per_px=inspector.mm_per_px)
    return judged, fields["regions"]


@pytest.mark.unit
@pytest.mark.parametrize(("score", "near"), [(0.45, 1), (0.41, 1), (0.39, 0), (0.55, 0)])
def test_a_score_within_the_near_margin_below_the_threshold_is_a_near_miss(score: float, near: int) -> None:
    decoder = AnomalyDecoder([("pred_score", (1,))], threshold=0.5, near_margin=0.1)
    result = decoder.decode([np.array([score], dtype=np.float32)], BoxMap.stretch(64, 64, MAP, MAP))
    assert result.near_misses() == near


@pytest.mark.unit
def test_a_regions_length_and_width_are_its_min_area_rectangles_sides_in_frame_pixels_under_any_scale() -> None:
    # Frame 128 x 256 over a 64 x 64 map: x doubles and y quadruples, so a diagonal in the map is
    # steep in the frame, and its rectangle must be found on the outline mapped there.
    result = decoded([("line", (10, 10, 40, 40)), ("rect", (50, 2, 60, 6))])
    _, regions = judge(result)
    square, diagonal = regions  # 40 map pixels, then 31
    assert diagonal.length_px == pytest.approx(math.hypot(30 * 2, 30 * 4), abs=1.5)
    assert diagonal.width_px < 6
    assert (square.length_px, square.width_px) == (18.0, 12.0)  # 9 x 3 map pixels between outline corners
    assert diagonal.length_mm is None and "length_mm" not in diagonal.model_dump_json()
    _, scaled = judge(result, mm_per_px=0.5)
    assert (scaled[0].length_mm, scaled[0].width_mm) == (9.0, 6.0)
    assert all(r.note is None for r in regions) and "note" not in regions[0].model_dump_json()


@pytest.mark.unit
def test_an_anomaly_frame_traces_its_outlines_once_for_the_verdict_and_the_message() -> None:
    result = decoded([("rect", (10, 10, 20, 20)), ("line", (30, 30, 50, 40))])
    first = result.outlines()
    assert result.outlines() is first and len(first) == 2
    judge(result, max_length_px={"anomaly": 100.0})
    assert result.outlines() is first


@pytest.mark.unit
def test_a_region_within_an_area_limit_in_pixels_does_not_count_and_is_noted() -> None:
    result = decoded([("rect", (10, 10, 20, 20))])  # 10 x 10 map pixels: 800 frame pixels
    assert result.area_px.tolist() == [800.0]
    judged, regions = judge(result, max_area_px={"anomaly": 800.0})
    assert judged.verdict == "ok" and judged.within.tolist() == [True] and regions[0].note == WITHIN_LIMITS
    judged, regions = judge(result, max_area_px={"anomaly": 799.0})
    assert judged.verdict == "ng" and judged.within.tolist() == [False] and regions[0].note is None


@pytest.mark.unit
def test_a_region_within_limits_in_millimetres_does_not_count() -> None:
    result = decoded([("rect", (10, 10, 20, 20))])  # 800 px; 36 x 18 px between outline corners
    judged, regions = judge(result, mm_per_px=0.5, max_area_mm2={"anomaly": 200.0}, max_length_mm={"anomaly": 18.0})
    assert judged.verdict == "ok" and regions[0].note == WITHIN_LIMITS
    assert (regions[0].area_mm2, regions[0].length_mm) == (200.0, 18.0)
    assert judge(result, mm_per_px=0.5, max_length_mm={"anomaly": 17.9})[0].verdict == "ng"
    assert judge(result, mm_per_px=0.5, max_area_mm2={"anomaly": 199.0})[0].verdict == "ng"
    # A limit past a float once in pixels is still a limit (before: inf, no limit, which tolerates nothing).
    assert judge(result, mm_per_px=0.05, max_length_mm={"anomaly": 1e308})[0].verdict == "ok"


@pytest.mark.unit
def test_sizes_in_mm_under_a_micrometre_per_pixel_keep_their_digits() -> None:
    # 800 px at 0.5 um per pixel is 0.0002 mm2, over a limit of 0.0001: NG, and published as 0.0 (3 decimals).
    result = decoded([("rect", (10, 10, 20, 20))])  # 800 px; 36 x 18 px between outline corners
    judged, regions = judge(result, mm_per_px=0.0005, max_area_mm2={"anomaly": 0.0001})
    assert judged.verdict == "ng" and regions[0].note is None
    assert (regions[0].area_mm2, regions[0].length_mm, regions[0].width_mm) == (0.0002, 0.018, 0.009)


@pytest.mark.unit
def test_one_region_within_and_one_over_the_limits_is_ng_naming_the_one_over() -> None:
    # The block is the larger region and within the length limit; the long thin line is over it.
    result = decoded([("rect", (5, 5, 15, 15)), ("line", (20, 50, 60, 50))])
    judged, regions = judge(result, max_length_px={"anomaly": 40.0})
    assert judged.verdict == "ng" and judged.within.tolist() == [True, False]
    assert judged.reason_region == 1 and judged.ng.tolist() == [False, True]
    assert [r.note for r in regions] == [WITHIN_LIMITS, None]


@pytest.mark.unit
def test_limits_judge_only_the_regions_in_the_zones() -> None:
    # The small block sits in the left half of the frame, the large one in the right half.
    result = decoded([("rect", (40, 40, 60, 60)), ("rect", (5, 5, 10, 10))])
    left = {"left": [[0, 0], [0.5, 0], [0.5, 1], [0, 1]]}
    judged, regions = judge(result, zones=left, outside_zones="keep", max_area_px={"anomaly": 400.0})
    assert judged.verdict == "ok" and judged.within.tolist() == [False, True]
    assert [r.note for r in regions] == [None, WITHIN_LIMITS]
    judged, _ = judge(result, zones=left, max_area_px={"anomaly": 100.0})
    assert judged.verdict == "ng" and judged.reason_region == 1


@pytest.mark.unit
def test_a_high_score_without_any_region_stays_ng_whatever_the_limits() -> None:
    judged, regions = judge(decoded([]), max_area_px={"anomaly": 1e9}, max_length_px={"anomaly": 1e9})
    assert (judged.verdict, judged.reason_region, regions) == ("ng", 0, [])
    calm, _ = judge(decoded([("rect", (10, 10, 20, 20))], score=0.1), max_area_px={"anomaly": 1.0})
    assert calm.verdict == "ok"


@pytest.mark.unit
def test_area_limits_alone_judge_a_frame_without_creating_arrays() -> None:
    counter = NumpyAllocations.get()
    assert counter is not None
    result = decoded([("rect", (10, 10, 20, 20)), ("rect", (30, 30, 35, 35))])  # 800 and 200 frame pixels
    inspector = AnomalyInspector(InspectConfig(max_area_px={"anomaly": 200.0}), 100)
    inspector(result, 128, 256)
    with counter.counting():
        before = counter.buffers
        judged = inspector(result, 128, 256)
        assert counter.buffers == before
    assert judged.verdict == "ng" and judged.within.tolist() == [False, True]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("score", "problem"), [(7.0, "score_above_one"), (-3.0, "score_above_one"), (math.nan, "nonfinite_output")]
)
def test_a_score_outside_0_to_1_is_dropped_and_counted_and_the_message_holds_none(score: float, problem: str) -> None:
    decoder = AnomalyDecoder([("pred_score", (1,)), ("pred_label", (1,))], near_margin=10.0)
    result = decoder.decode([np.array([score], np.float32), np.array([True])], BoxMap.stretch(64, 64, MAP, MAP))
    assert result.problems() == [(problem, 1)] and not result.anomalous and result.near_misses() == 0
    fields = result.message_fields(lambda _: "anomaly", None, None)
    assert fields["anomaly_score"] is None and fields["anomalous"] is False
    assert decoded([], score=1.0).problems() == [] and decoded([], score=0.0).problems() == []


@pytest.mark.unit
@pytest.mark.parametrize("mask", [False, True], ids=["pixel_threshold", "pred_mask"])
@pytest.mark.parametrize(
    ("value", "problem"),
    [(7.0, "score_above_one"), (math.inf, "nonfinite_output"), (math.nan, "nonfinite_output"), (-0.5, "score_above_one")],
)
def test_a_map_with_values_outside_0_to_1_gives_no_regions_is_counted_and_its_message_is_valid_json(
    value: float, problem: str, mask: bool
) -> None:
    # A spot of 4 x 4 map pixels at ``value`` in a normalised map (an export without anomalib's
    # normalisation, a broken one): its region's peak was published as max_score 7.0 (or inf), which
    # the message refused, and the daemon died on the frame.
    scores = np.full((MAP, MAP), 0.2, dtype=np.float32)
    scores[10:20, 10:20] = 0.9
    scores[12:16, 12:16] = value
    outputs = [np.array([0.9], dtype=np.float32), scores[None, None]]
    if mask:
        outputs.append(np.zeros((1, 1, MAP, MAP), dtype=np.uint8))
        outputs[2][0, 0, 10:20, 10:20] = 1
    decoder = map_decoder(MAP, MAP, mask, 100)
    result = decoder.decode(outputs, BoxMap.stretch(128, 128, MAP, MAP))
    assert result.problems() == [(problem, 16)] and len(result.scores) == 0 and result.anomalous
    judged, regions = judge(result, (128, 128))
    assert judged.verdict == "uncertain" and regions == []
    message = DetectionsMessage(
        camera_id="cam0",
        seq=0,
        frame_id=0,
        capture_time_ns=0,
        frame_size=(128, 128),
        input_size=(MAP, MAP),
        model=ModelInfo(name="m", sha256="0", provider="CPU"),
        **result.message_fields(lambda _: "anomaly", None, None),
        timings=Timings(preprocess_ms=0, inference_ms=0, decode_ms=0, age_ms=0),
        thermal_state="ok",
    )
    sent = json.loads(message.model_dump_json())  # no NaN or Infinity: a strict reader's JSON
    assert sent["anomaly_score"] == 0.9 and sent["regions"] == [] and sent["anomalous"] is True
    scores[12:16, 12:16] = 0.95  # the same map in 0..1: its region, as ever
    again = decoder.decode(outputs, BoxMap.stretch(128, 128, MAP, MAP))
    assert again.problems() == [] and again.scores.tolist() == [pytest.approx(0.95)]


@pytest.mark.unit
def test_a_map_and_a_mask_of_different_sizes_are_refused_naming_both() -> None:
    outputs = [("pred_score", (1, 1)), ("anomaly_map", (1, 1, 64, 64)), ("pred_mask", (1, 1, 32, 32))]
    words = r"anomaly_map \[1, 1, 64, 64\] and pred_mask \[1, 1, 32, 32\] differ"
    with pytest.raises(HeadError, match=words):
        AnomalyHead.check(outputs)
    with pytest.raises(HeadError, match=words):
        AnomalyDecoder(outputs)
    AnomalyHead.check([("pred_score", (1, 1)), ("anomaly_map", (1, 1, 64, 64)), ("pred_mask", (1, 1, "h", "w"))])


@pytest.mark.unit
def test_regions_past_max_det_count_against_the_part_as_they_are_not_judged() -> None:
    # 100 specks of 3 x 3 map pixels within the limits, and a line 8 map pixels long, over the length
    # limit and smaller in area than any speck: cut at max_det (the smallest go), it was not judged,
    # and the part was OK.
    specks = [("rect", (x, y, x + 3, y + 3)) for y in range(0, 40, 4) for x in range(0, 40, 4)]
    limits = {"max_area_px": {"anomaly": 1000.0}, "max_length_px": {"anomaly": 10.0}}
    result = decoded([*specks, ("line", (10, 50, 17, 50))])
    assert len(result.scores) == 100 and result.cut == 1
    assert judge(result, **limits)[0].verdict == "ng"
    within = decoded(specks)
    assert within.area_px.tolist() == [72.0] * 100 and within.cut == 0
    assert judge(within, **limits)[0].verdict == "ok"  # all of them judged, all within the limits


@pytest.mark.unit
def test_the_evidence_label_of_a_one_pixel_region_or_a_thin_line_is_its_boxs_corners() -> None:
    result = decoded([("rect", (20, 20, 30, 30)), ("line", (10, 40, 39, 40)), ("rect", (10, 10, 11, 11))])
    lines = result.dataset_label(128, 256).splitlines()
    assert len(lines) == 3 and all(line.startswith("0 ") and len(line.split()) >= 7 for line in lines)
    (x1, y1, x2, y2), single = result.xyxy[2].tolist(), lines[2].split()[1:]
    assert [float(v) for v in single] == pytest.approx(
        [x1 / 128, y1 / 256, x2 / 128, y1 / 256, x2 / 128, y2 / 256, x1 / 128, y2 / 256]
    )


def hostile_map(h: int, w: int, seed: int) -> np.ndarray:
    """A noisy map, scores in 0..1 with ``0.5`` the pixel threshold: isolated specks (regions of one
    pixel, equal areas ordered by label alone) around a ring holding a blob, a diagonal line, an
    L, and a staircase of pixels touching only at corners, which 8-connectivity joins. Its first
    pixels sit at an odd row and column."""
    rng = np.random.default_rng(seed)
    scores = rng.uniform(0.0, 0.45, (h, w)).astype(np.float32)
    high = np.zeros((h, w), dtype=np.uint8)
    high[1:h:3, 1:w:3] = 1  # specks, 2 pixels apart
    high[4:37, 4:49] = 0
    cv2.rectangle(high, (8, 8), (40, 30), 1, 1)  # the ring, its rectangle holding the blob's
    high[15:22, 14:30] = 1
    high[38:69, 4:61] = 0
    cv2.line(high, (6, 40), (26, 62), 1, 1)  # 8-connected diagonal steps
    high[40:61, 34] = high[60, 34:51] = 1  # the L
    for k in range(4):
        high[42 + k, 44 + k] = 1
    scores[high == 1] = rng.uniform(0.55, 1.0, int(high.sum()))
    return scores


def reference_regions(
    mask: np.ndarray, scores: np.ndarray, most: int
) -> tuple[list[tuple[int, int, tuple[int, int, int, int], float]], int]:
    """The regions straight from OpenCV's labels and numpy, one label at a time: (label, area, box
    (x1, y1, x2, y2) in map pixels, peak), largest first and equal areas in label order, at most
    ``most``; and how many more there are."""
    n, labels = cv2.connectedComponents(mask, connectivity=8, ltype=cv2.CV_32S)
    regions = []
    for label in range(1, n):
        ys, xs = np.nonzero(labels == label)
        box = (int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1)
        regions.append((label, len(xs), box, float(scores[labels == label].max())))
    regions.sort(key=lambda r: (-r[1], r[0]))
    return regions[:most], max(0, len(regions) - most)


def map_decoder(h: int, w: int, mask: bool, most: int) -> AnomalyDecoder:
    """A decoder of a map ``h`` x ``w``: its mask the export's (``mask``) or the map above 0.5."""
    outputs: list[tuple[str, tuple[int, ...]]] = [("pred_score", (1,)), ("anomaly_map", (1, 1, h, w))]
    if mask:
        return AnomalyDecoder([*outputs, ("pred_mask", (1, 1, h, w))], max_regions=most)
    return AnomalyDecoder(outputs, pixel_threshold=0.5, max_regions=most)


def decode_map(decoder: AnomalyDecoder, scores: np.ndarray, frame: tuple[int, int], mask: bool = False) -> Anomaly:
    """``scores`` decoded for a frame ``frame`` (width, height), with the export's mask (``mask``)."""
    h, w = scores.shape
    outputs = [np.array([0.9], dtype=np.float32), scores[None, None]]
    if mask:
        outputs.append((scores > 0.5)[None, None])
    return decoder.decode(outputs, BoxMap.stretch(*frame, w, h))


@pytest.mark.unit
@pytest.mark.parametrize("mask", [False, True], ids=["pixel_threshold", "pred_mask"])
@pytest.mark.parametrize(("shape", "most"), [((70, 90), 100), ((70, 90), 2000), ((67, 81), 5), ((64, 64), 1)])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_noisy_maps_regions_are_its_components_largest_first_and_the_rest_cut(
    shape: tuple[int, int], most: int, mask: bool, seed: int
) -> None:
    h, w = shape
    scores = hostile_map(h, w, seed)
    frame = (w * 3, h * 2)
    sx, sy = w / frame[0], h / frame[1]
    decoder = map_decoder(h, w, mask, most)
    for _ in range(2):  # the second frame in the buffers the first grew
        result = decode_map(decoder, scores, frame, mask)
        expected, cut = reference_regions((scores > 0.5).astype(np.uint8), scores, most)
        assert result.cut == cut and (cut > 0) is (most < 2000)
        assert result.ids.tolist() == [label for label, *_ in expected]
        assert result.area_px.tolist() == [np.float32(area / (sx * sy)) for _, area, _, _ in expected]
        boxes = [[x1 / sx, y1 / sy, x2 / sx, y2 / sy] for _, _, (x1, y1, x2, y2), _ in expected]
        assert np.array_equal(result.xyxy, np.array(boxes, dtype=np.float32).reshape(-1, 4))
        assert result.scores.tolist() == [np.float32(peak) for *_, peak in expected]


@pytest.mark.unit
@pytest.mark.parametrize("seed", range(40))
def test_random_masks_of_any_density_and_offset_give_the_components_of_the_whole_map(seed: int) -> None:
    # Labels are found within the mask's bounding rectangle; the order of equal areas must still be
    # the whole map's labels'.
    rng = np.random.default_rng(seed)
    h, w = (int(v) for v in rng.integers(3, 60, 2))
    scores = rng.uniform(0.0, 1.0, (h, w)).astype(np.float32)
    scores[scores < 1 - rng.choice([0.01, 0.05, 0.2, 0.45])] = 0.0
    scores[: int(rng.integers(0, h)), :] = 0.0
    scores[:, : int(rng.integers(0, w))] = 0.0
    if not (scores > 0.5).any():
        scores[h - 1, w - 1] = 0.9
    most = int(rng.integers(1, 8))
    result = decode_map(map_decoder(h, w, False, most), scores, (w, h))
    expected, cut = reference_regions((scores > 0.5).astype(np.uint8), scores, most)
    assert result.ids.tolist() == [label for label, *_ in expected] and result.cut == cut
    assert result.area_px.tolist() == [area for _, area, _, _ in expected]
    assert result.xyxy.astype(int).tolist() == [list(box) for _, _, box, _ in expected]
    assert result.scores.tolist() == [np.float32(peak) for *_, peak in expected]


@pytest.mark.unit
@pytest.mark.parametrize("specks", [0, 30], ids=["few regions", "many regions"])
def test_outlines_of_regions_whose_rectangles_overlap_are_those_traced_over_the_whole_map(specks: int) -> None:
    h, w = 48, 64
    scores = np.zeros((h, w), dtype=np.float32)
    high = np.zeros((h, w), dtype=np.uint8)
    cv2.rectangle(high, (3, 3), (40, 30), 1, 2)  # a thick ring
    high[10:20, 12:30] = 1  # inside it
    high[24:27, 8:12] = 1  # inside it, touching nothing
    high[10:35, 44] = high[34, 10:45] = 1  # an L around its corner, its rectangle over the ring's
    high[44, 1:w:2][:specks] = 1
    scores[high == 1] = 0.8
    result = decode_map(map_decoder(h, w, False, 100), scores, (w * 2, h * 2))
    n, labels = cv2.connectedComponents(high, connectivity=8, ltype=cv2.CV_32S)
    assert len(result.ids) == n - 1 == 4 + specks
    for outline, label in zip(result.outlines(), result.ids.tolist(), strict=True):
        alone = (labels == label).astype(np.uint8)
        contours, _ = cv2.findContours(alone, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
        assert np.array_equal(outline, max(contours, key=len))


@pytest.mark.unit
def test_a_noisy_maps_regions_are_found_without_creating_arrays_once_its_buffers_have_grown() -> None:
    counter = NumpyAllocations.get()
    assert counter is not None
    scores = hostile_map(70, 90, 0)
    decoder = map_decoder(70, 90, False, 2000)
    outputs, box_map = [np.array([0.9], dtype=np.float32), scores[None, None]], BoxMap.stretch(90, 70, 90, 70)
    first = decoder.decode(outputs, box_map).ids.tolist()
    assert len(first) > 300
    with counter.counting():
        before = counter.buffers
        again = decoder.decode(outputs, box_map)
        assert counter.buffers == before
    assert again.ids.tolist() == first and again.cut == 0


@pytest.mark.unit
def test_a_region_outline_longer_than_max_outline_points_is_published_thinned_and_counted() -> None:
    """A noisy map's region has a ragged edge of thousands of points (a 512x512 map of noise: 10,000 in
    its largest region's outline), sent in every message and label; at most max_outline_points now,
    as a segmentation outline."""
    mask = np.zeros((1, 1, MAP, MAP), dtype=np.uint8)
    mask[0, 0, 4:40, 4:40:2] = 1  # a comb: 18 teeth on a bar, one region of a long outline
    mask[0, 0, 4, 4:40] = 1
    mask[0, 0, 50:58, 50:58] = 1  # a square: 4 points
    outputs = [("pred_score", (1,)), ("pred_mask", (1, 1, MAP, MAP))]
    frame = BoxMap.stretch(256, 128, MAP, MAP)
    whole = AnomalyDecoder(outputs).decode([np.array([0.9], np.float32), mask], frame)
    whole_points, whole_sides = [len(p) for p in whole.polygons()], whole.sides()
    assert whole_points[0] > 60 and whole.problems() == []
    thinned = AnomalyDecoder(outputs, max_outline_points=20).decode([np.array([0.9], np.float32), mask], frame)
    polygons = thinned.polygons()
    assert 10 < len(polygons[0]) <= 20 and polygons[0][0] == whole.polygons()[0][0]
    assert len(polygons[1]) == whole_points[1]  # within the bound: as traced
    assert thinned.problems() == [("outline_thinned", 1)]
    assert thinned.sides() == whole_sides  # the sizes are the whole outline's
    fields = thinned.message_fields(lambda _: "anomaly", None, None)
    assert fields["anomaly_score"] == 0.9 and [len(r.polygon) for r in fields["regions"]] == [len(p) for p in polygons]
    label = thinned.dataset_label(256, 128).splitlines()
    assert len(label[0].split()) == 1 + 2 * len(polygons[0])
