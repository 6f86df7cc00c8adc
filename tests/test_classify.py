"""Classification: edged's classes against ultralytics' own predict, and the ranking on its own.

``tests/data/tasks`` holds a real YOLOv8 ``-cls`` export (random weights made input-sensitive) and
what ultralytics' ``predict`` returned for frames of four aspect ratios and for a region of one
(`tests/reference/build_ultralytics_tasks.py` made them). edged must give the same probabilities,
within 1e-4, and the same five best classes in the same order.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import cv2
import numpy as np
import pytest
from allocations import NumpyAllocations

from edged.classify import Classifier
from edged.config import ModelConfig, RuntimeConfig
from edged.errors import ConfigError, ContractError, HeadError
from edged.geometry import BoxMap
from edged.messages import parse_message
from edged.model import LoadedModel, load_model
from edged.pipeline import REPLAN_AFTER, FramePath, FramePipeline, Processed, Rejected, verdict_message
from edged.settings.inspect import InspectConfig
from edged.sources.base import Frame
from edged.verdict import ClassInspector

DATA = Path(__file__).parent / "data" / "tasks"
REFERENCE = json.loads((DATA / "cls.json").read_text())
BOX_MAP = BoxMap.stretch(64, 64, 64, 64)


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return load_model(ModelConfig(path=DATA / "cls.onnx"), RuntimeConfig())


def test_a_cls_export_loads_as_a_classifier_fed_the_centre_crop(model: LoadedModel) -> None:
    assert (model.head, model.task, model.num_classes) == ("classify", "classify", 5)
    assert model.labels == ["good", "scratch", "dent", "stain", "crack"]
    assert model.contract.resize == "crop"


@pytest.mark.parametrize("name", ["wide", "tall", "square", "strip", "wide-roi"])
def test_probabilities_and_top5_are_ultralytics_predict(model: LoadedModel, name: str) -> None:
    image = cv2.imread(str(DATA / f"{name.removesuffix('-roi')}.png"))
    roi = tuple(REFERENCE["roi"]) if name.endswith("-roi") else None
    plan = FramePipeline(model, image.shape[1], image.shape[0], "bgr", roi=roi)
    classes, _ = plan.process(image)
    expected = REFERENCE["frames"][name]
    np.testing.assert_allclose(plan.output[0], expected["probs"], atol=1e-4)
    assert classes.class_ids.tolist() == expected["top5"]
    np.testing.assert_allclose(classes.scores, np.array(expected["probs"])[expected["top5"]], atol=1e-4)


@pytest.mark.unit
def test_ranking_keeps_top_k_best_first_the_first_of_equals_first() -> None:
    classes = Classifier((1, 5), 5, top_k=3).decode(np.array([[0.1, 0.3, 0.05, 0.3, 0.25]], np.float32), BOX_MAP)
    assert classes.class_ids.tolist() == [1, 3, 4]
    assert classes.scores.tolist() == pytest.approx([0.3, 0.3, 0.25])
    assert classes.top == (1, pytest.approx(0.3))


@pytest.mark.unit
@pytest.mark.parametrize(
    ("output", "problems"),
    [
        ([0.5, 3.0, -2.0], [("score_above_one", 2)]),  # logits: 'crack' is the strongest, 'ok' alone in 0..1
        ([0.3, np.nan, 0.1], [("nonfinite_output", 1)]),
        ([np.inf, 1.5, 0.4], [("nonfinite_output", 1), ("score_above_one", 1)]),
    ],
)
def test_a_frame_with_any_value_that_is_no_probability_ranks_no_class_and_is_never_ok(
    output: list[float], problems: list[tuple[str, int]]
) -> None:
    # The values that happened to lie in 0..1 were ranked: logits [0.5, 3.0, -2.0] published 'ok 0.50', verdict OK.
    classes = Classifier((1, 3), 3, top_k=3).decode(np.array([output], np.float32), BOX_MAP)
    assert len(classes) == 0 and classes.top is None
    assert classes.problems() == problems
    inspector = ClassInspector(InspectConfig(ng_classes=["crack", "scratch"]), ["ok", "crack", "scratch"], 3, 0.25)
    assert inspector(classes).verdict == "uncertain"


@pytest.mark.unit
def test_outputs_outside_0_to_1_tell_once_to_export_the_classifier_with_its_softmax(
    caplog: pytest.LogCaptureFixture,
) -> None:
    classifier = Classifier((1, 3), 3, top_k=3)
    with caplog.at_level(logging.ERROR, logger="edged.classify"):
        classifier.decode(np.array([[0.3, np.nan, 0.1]], np.float32), BOX_MAP)  # NaN: a broken model, no softmax hint
        assert not caplog.records
        for _ in range(3):
            classifier.decode(np.array([[0.5, 3.0, -2.0]], np.float32), BOX_MAP)
    assert [r.getMessage() for r in caplog.records] == [
        "the classifier output 2 value(s) outside 0..1: its outputs must be probabilities, so its frames rank "
        "no class and their verdict is uncertain; export the classifier with its softmax (ultralytics' -cls "
        "exports include it), and check model.scale, mean and std against how it was trained"
    ]


def test_a_frame_that_is_no_probabilities_creates_no_arrays() -> None:
    counter = NumpyAllocations.get()
    assert counter is not None
    classifier = Classifier((1, 3), 3, top_k=3)
    good, logits = np.array([[0.2, 0.7, 0.1]], np.float32), np.array([[0.5, 3.0, -2.0]], np.float32)
    for output in (good, logits):
        classifier.decode(output, BOX_MAP)
    tops = []
    with counter.counting():
        before = counter.buffers
        for _ in range(5):
            tops += [classifier.decode(logits, BOX_MAP).top, classifier.decode(good, BOX_MAP).top]
        assert counter.buffers == before
    assert tops == [None, (1, pytest.approx(0.7))] * 5


@pytest.mark.unit
def test_a_model_without_any_probability_has_no_top() -> None:
    classes = Classifier((1, 2), 2, top_k=5).decode(np.array([[np.nan, 7.0]], np.float32), BOX_MAP)
    assert len(classes) == 0 and classes.top is None
    assert classes.dataset_class() is None


@pytest.mark.unit
def test_an_output_of_another_shape_is_refused() -> None:
    with pytest.raises(HeadError, match=r"expects output \[1, 5\], got \[1, 4\]"):
        Classifier((1, 4), 5, top_k=5)


def _path(model: LoadedModel, **inspect: object) -> FramePath:
    cfg = InspectConfig.model_validate(inspect)
    return FramePath(model, "cam0", "bgr", ClassInspector(cfg, model.labels, 5, 0.25), roi=cfg.roi)


def _run(path: FramePath, name: str) -> Processed:
    done = path.run(Frame(cv2.imread(str(DATA / f"{name}.png")), 7, 0, 0, "bgr"))
    assert isinstance(done, Processed)
    return done


# The best classes (cls.json): wide 'crack' 0.80, tall 'dent' 0.77, square 'scratch' 0.42.
def test_the_message_has_the_task_and_top_classes_and_no_detections(model: LoadedModel) -> None:
    path = _path(model, ng_classes=["crack"])
    done = _run(path, "wide")
    msg = parse_message(path.message(done, seq=0, thermal_state="ok").model_dump_json().encode())
    assert msg.kind == "detections"
    assert (msg.task, msg.detections, msg.verdict) == ("classify", [], "ng")
    probs = REFERENCE["frames"]["wide"]["probs"]
    assert msg.top is not None
    assert [t.label for t in msg.top] == ["crack", "scratch", "good", "dent", "stain"]
    assert [t.score for t in msg.top] == pytest.approx([probs[c] for c in (4, 1, 0, 2, 3)], abs=1e-4)
    assert [(r.detection, r.label) for r in msg.reasons] == [(0, "crack")]
    verdict = verdict_message(msg, 0)
    assert verdict is not None and verdict.verdict == "ng"


@pytest.mark.parametrize(
    ("inspect", "frame", "verdict"),
    [
        ({"ng_classes": ["crack"]}, "tall", "ok"),  # dent is no NG class
        ({"ng_classes": ["crack"], "class_conf": {"crack": 0.85}}, "wide", "ok"),  # 0.80 is under its threshold
        ({"ng_classes": ["dent"], "min_confidence": 0.5}, "tall", "ng"),
        ({"ng_classes": ["dent"], "min_confidence": 0.5}, "square", "uncertain"),  # 0.42 is under 0.5
    ],
)
def test_the_verdict_is_the_best_class_against_its_threshold_and_min_confidence(
    model: LoadedModel, inspect: dict[str, object], frame: str, verdict: str
) -> None:
    path = _path(model, **inspect)
    done = _run(path, frame)
    assert done.inspected is not None and done.inspected.verdict == verdict
    reasons = path.reasons(done)
    assert len(reasons) == (0 if verdict == "ok" else 1)


def test_a_region_is_classified_and_a_frame_it_does_not_fit_is_rejected(model: LoadedModel) -> None:
    path = _path(model, ng_classes=["crack"], roi=REFERENCE["roi"])
    done = _run(path, "wide")
    assert done.result.class_ids.tolist() == REFERENCE["frames"]["wide-roi"]["top5"]
    rejected = path.run(Frame(np.zeros((100, 100, 3), np.uint8), 8, 0, 0, "bgr"))
    assert isinstance(rejected, Rejected) and rejected.reason == "bad_frame_size"
    assert "inspect.roi [40, 30, 220, 200] does not fit in a 100x100 frame" in rejected.detail


def test_a_camera_whose_frames_the_region_does_not_fit_cannot_run_while_such_an_image_is_skipped(
    model: LoadedModel,
) -> None:
    # Every frame of such a camera was rejected, counted, and the daemon never reported ready; now it is
    # the configuration's error (exit 78), as masks too large for the camera's frames are.
    small = np.zeros((100, 100, 3), np.uint8)
    with pytest.raises(ContractError, match=r"inspect\.roi \[40, 30, 220, 200\] does not fit .* \(camera cam0\)"):
        _path(model, ng_classes=["crack"], roi=REFERENCE["roi"]).run(Frame(small, 1, 0, 0, "bgr"))
    path = _path(model, ng_classes=["crack"], roi=REFERENCE["roi"])
    _run(path, "wide")
    for seq in range(2, REPLAN_AFTER + 1):  # a few frames of another size are the camera's glitch: rejected
        rejected = path.run(Frame(small, seq, 0, 0, "bgr"))
        assert isinstance(rejected, Rejected) and rejected.reason == "bad_frame_size"
    with pytest.raises(ContractError):  # that size lasting is the camera's size now
        path.run(Frame(small, REPLAN_AFTER + 1, 0, 0, "bgr"))
    cfg = InspectConfig.model_validate({"ng_classes": ["crack"], "roi": REFERENCE["roi"]})
    folder = FramePath(model, "cam0", "bgr", ClassInspector(cfg, model.labels, 5, 0.25), sizes_vary=True, roi=cfg.roi)
    for seq in range(1, REPLAN_AFTER + 3):  # an image folder's small image is skipped, however many there are
        rejected = folder.run(Frame(small, seq, 0, 0, "bgr", "small.png"))
        assert isinstance(rejected, Rejected) and rejected.reason == "bad_frame_size"
    _run(folder, "wide")


@pytest.mark.parametrize(
    ("inspect", "problem"),
    [
        ({}, "inspect.ng_classes: a classification model's verdict needs the classes that make a part NG"),
        ({"ng_classes": ["crack"], "zones": {"a": [(0, 0), (1, 0), (1, 1)]}}, "inspect.zones: a classification model"),
        ({"ng_classes": ["rust"]}, "inspect.ng_classes: 'rust' is not a class of the model"),
        ({"ng_classes": ["crack"], "max_area_px": {"crack": 50.0}}, "inspect.max_area_px: a classification model"),
        ({"ng_classes": ["crack"], "max_length_mm": {"crack": 2.0}}, "inspect.max_length_mm: a classification model"),
    ],
)
def test_inspection_a_classifier_cannot_apply_is_refused(
    model: LoadedModel, inspect: dict[str, object], problem: str
) -> None:
    with pytest.raises(ConfigError, match=problem):
        ClassInspector(InspectConfig.model_validate(inspect), model.labels, 5, 0.25)


def test_a_classified_frame_creates_no_arrays_from_contract_check_to_verdict(model: LoadedModel) -> None:
    counter = NumpyAllocations.get()
    assert counter is not None
    path = _path(model, ng_classes=["crack"], min_confidence=0.3, roi=REFERENCE["roi"])
    frame = Frame(cv2.imread(str(DATA / "wide.png")), 7, 0, 0, "bgr")
    for _ in range(3):
        path.run(frame)
    with counter.counting():
        before = counter.buffers
        for _ in range(10):
            done = path.run(frame)
            assert isinstance(done, Processed)
            record = path.verdict_record(done, None)
        assert counter.buffers == before
    assert record is not None and record.verdict == "ng"
