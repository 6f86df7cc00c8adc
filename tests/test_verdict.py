"""Tests for edged.verdict: class names resolved against the model, zones applied, the NG rules."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from allocations import NumpyAllocations
from onnx_models import fixed_scene

from edged.config import load_config
from edged.decode import Detections
from edged.errors import ConfigError
from edged.model import load_model
from edged.pipeline import frame_path
from edged.settings.inspect import InspectConfig
from edged.verdict import Inspector
from edged.zones import NO_ZONE

LABELS = ["scratch", "crack", "dust"]
W, H = 1000, 500
LEFT = [(0.0, 0.0), (0.5, 0.0), (0.5, 1.0), (0.0, 1.0)]
RIGHT = [(0.5, 0.0), (1.0, 0.0), (1.0, 1.0), (0.5, 1.0)]
TOP_LEFT = [(0.0, 0.0), (0.3, 0.0), (0.3, 0.3), (0.0, 0.3)]


def detections(rows: list[tuple[float, float, float, float, float, int]]) -> Detections:
    """x1 y1 x2 y2 score class rows in frame pixels."""
    table = np.array(rows, np.float32).reshape(-1, 6)
    return Detections(table[:, :4].copy(), table[:, 4].copy(), table[:, 5].astype(np.int32))


def inspector(max_det: int = 20, **keys: Any) -> Inspector:
    return Inspector(InspectConfig(**keys), LABELS, len(LABELS), 0.25, max_det)


# A scratch in the left half, a crack in the right half, dust in the top-left corner.
SCENE = detections([(100, 200, 200, 300, 0.9, 0), (700, 200, 800, 300, 0.8, 1), (20, 20, 40, 40, 0.5, 2)])


def test_class_conf_by_label_or_id_fills_the_thresholds_the_decoder_uses() -> None:
    assert inspector(class_conf={"crack": 0.6, "2": 0.1}).thresholds == [0.25, 0.6, 0.1]


def test_keys_a_detector_cannot_honour_are_config_errors_naming_them() -> None:
    with pytest.raises(ConfigError) as raised:
        inspector(max_area_px={"crack": 50.0}, max_length_px={"dust": 9.0}, min_confidence=0.5)
    problems = raised.value.problems
    assert raised.value.exit_code == 78 and len(problems) == 3
    assert problems[0].startswith("inspect.min_confidence is for classification models")
    assert problems[1].startswith("inspect.max_length_px is for segmentation and anomaly models")
    assert problems[2].startswith("inspect.max_area_px is for segmentation and anomaly models")
    masked = Inspector(InspectConfig(max_area_px={"crack": 50.0}), LABELS, len(LABELS), 0.25, 20, masks=True)
    assert masked.thresholds == [0.25] * 3


def test_unknown_class_names_are_config_errors_listing_the_models_classes() -> None:
    with pytest.raises(ConfigError) as raised:
        inspector(class_conf={"scrach": 0.5}, ng_classes=["crack", "7"], min_area={"dents": 0.1})
    assert raised.value.exit_code == 78
    assert raised.value.problems == [
        f"inspect.{key}: {name!r} is not a class of the model (its classes: scratch, crack, dust)"
        for key, name in (("class_conf", "scrach"), ("ng_classes", "7"), ("min_area", "dents"))
    ]


def test_a_class_named_by_digits_other_than_ascii_is_a_config_error_not_a_crash() -> None:
    """``'²'.isdigit()`` is true and ``int('²')`` raises: ``ng_classes = ["²"]`` stopped the daemon with a
    ValueError traceback (exit 1, restarted for ever) rather than naming the key."""
    with pytest.raises(ConfigError) as raised:
        inspector(class_conf={"\u00b2": 0.5}, ng_classes=["\u0661", "1" * 5000])
    assert raised.value.exit_code == 78
    assert [problem.split(":")[0] for problem in raised.value.problems] == [
        "inspect.class_conf",
        "inspect.ng_classes",
        "inspect.ng_classes",
    ]
    assert inspector(ng_classes=["1"])(SCENE, W, H).ng.tolist() == [False, True, False]  # ASCII digits are a class id


def test_without_zones_every_detection_of_an_ng_class_makes_the_frame_ng() -> None:
    done = inspector()(SCENE, W, H)
    assert done.verdict == "ng" and done.ng.tolist() == [True, True, True]
    assert done.zones.tolist() == [NO_ZONE] * 3 and len(done.detections) == 3
    assert inspector(ng_classes=["crack"])(SCENE, W, H).ng.tolist() == [False, True, False]
    ok = inspector(ng_classes=["crack"])(detections([(100, 200, 200, 300, 0.9, 0)]), W, H)
    assert ok.verdict == "ok" and ok.ng.tolist() == [False]
    empty = inspector()(detections([]), W, H)
    assert empty.verdict == "ok" and len(empty.detections) == 0


def test_a_frame_whose_model_output_was_broken_is_uncertain_unless_something_ng_was_found() -> None:
    # NaN candidates and scores above 1 are dropped before NMS: a defect may be among them, and the
    # frame was judged OK.
    scratch = (100, 200, 200, 300, 0.9, 0)
    for broken in ({"nonfinite": 3}, {"scores_above_one": 1}):
        found = detections([scratch])
        fine = Detections(found.xyxy, found.scores, found.class_ids, **broken)
        assert inspector(ng_classes=["crack"])(fine, W, H).verdict == "uncertain"
        assert inspector(ng_classes=["scratch"])(fine, W, H).verdict == "ng"  # what was found still decides NG
    assert inspector(ng_classes=["crack"])(detections([scratch]), W, H).verdict == "ok"


def test_min_area_is_a_fraction_of_the_frame() -> None:
    # The scratch is 100x100 px of 1000x500: 0.02 of the frame.
    assert inspector(min_area={"scratch": 0.02})(SCENE, W, H).ng.tolist() == [True, True, True]
    assert inspector(min_area={"scratch": 0.0201})(SCENE, W, H).ng.tolist() == [False, True, True]


def test_zones_drop_what_is_outside_and_tag_the_rest() -> None:
    done = inspector(zones={"left": LEFT, "corner": TOP_LEFT})(SCENE, W, H)
    assert done.detections.class_ids.tolist() == [0, 2] and done.detections.scores.tolist() == pytest.approx([0.9, 0.5])
    np.testing.assert_array_equal(done.detections.xyxy, SCENE.xyxy[[0, 2]])
    assert done.zones.tolist() == [0, 0]  # the first zone in order holds the corner too
    assert done.verdict == "ng" and done.ng.tolist() == [True, True]


def test_zones_keep_outside_detections_untagged_and_they_never_make_ng() -> None:
    done = inspector(zones={"right": RIGHT}, outside_zones="keep", ng_classes=["scratch", "dust"])(SCENE, W, H)
    assert len(done.detections) == 3 and done.zones.tolist() == [NO_ZONE, 0, NO_ZONE]
    assert done.verdict == "ok" and done.ng.tolist() == [False, False, False]


def test_overlap_matching_takes_boxes_across_a_zone_edge() -> None:
    across = detections([(450, 200, 600, 300, 0.9, 0)])  # centre x 525: right half, box reaches into the left
    assert len(inspector(zones={"left": LEFT})(across, W, H).detections) == 0
    assert inspector(zones={"left": LEFT}, match="overlap")(across, W, H).zones.tolist() == [0]


def test_zone_problems_name_the_zone_when_the_config_loads(tmp_path: Path) -> None:
    model = tmp_path / "m.onnx"
    model.write_bytes(b"")
    config = tmp_path / "edged.toml"
    config.write_text(
        f'[model]\npath = "{model}"\n[inspect.zones]\nbelt = [[0.1, 0.1], [0.9, 0.9], [0.9, 0.1], [0.1, 0.9]]\n'
        "tray = [[0.1, 0.1], [0.2, 0.2]]\nok = [[0, 0], [1, 0], [1, 1]]\n"
    )
    with pytest.raises(ConfigError) as raised:
        load_config(config)
    text = str(raised.value)
    assert "zone 'belt' is self-intersecting: edge 1 crosses edge 3" in text
    assert "zone 'tray' has 2 point(s); a zone needs at least 3" in text
    assert "'ok'" not in text and raised.value.exit_code == 78


def with_near(found: Detections, near: Detections) -> Detections:
    return Detections(found.xyxy, found.scores, found.class_ids, near=near)


def test_near_misses_outside_every_zone_go_where_detections_outside_them_go() -> None:
    # A near scratch in each half; only the left half is a zone.
    near = detections([(100, 200, 200, 300, 0.2, 0), (700, 200, 800, 300, 0.2, 0)])
    dropped = inspector(zones={"left": LEFT}, outside_zones="drop")(with_near(SCENE, near), W, H)
    assert dropped.detections.near is not None
    assert dropped.detections.near.xyxy.tolist() == [[100, 200, 200, 300]]
    kept = inspector(zones={"left": LEFT}, outside_zones="keep")(with_near(SCENE, near), W, H)
    assert kept.detections.near is near
    assert inspector()(with_near(SCENE, near), W, H).detections.near is near


@pytest.mark.parametrize("match", ["centre", "overlap"])
@pytest.mark.parametrize("outside", ["drop", "keep"])
def test_inspecting_creates_no_arrays(match: str, outside: str) -> None:
    counter = NumpyAllocations.get()
    assert counter is not None
    rng = np.random.default_rng(0)
    check = inspector(
        max_det=100,
        zones={"left": LEFT, "corner": TOP_LEFT},
        outside_zones=outside,
        match=match,
        min_area={"dust": 0.001},
        ng_classes=["scratch", "dust"],
    )
    frames = []
    for n in (100, 7, 0, 40):
        xy = rng.uniform(0, (W, H), (n, 2))
        wh = rng.uniform(2, 80, (n, 2))
        rows = [(*xy[i], *(xy[i] + wh[i]), 0.5, int(rng.integers(0, 3))) for i in range(n)]
        frames.append(with_near(detections(rows), detections([(*r[:4], 0.2, r[5]) for r in rows[: n // 2]])))
    first = [(check(f, W, H).verdict, check(f, W, H).ng.tolist()) for f in frames]
    with counter.counting():
        before = counter.buffers
        for frame in frames:
            check(frame, W, H)
        assert counter.buffers == before
    assert [(check(f, W, H).verdict, check(f, W, H).ng.tolist()) for f in frames] == first
    assert {verdict for verdict, _ in first} == {"ok", "ng"}


README = Path(__file__).resolve().parent.parent / "docs" / "inspection.md"
MARKER = "<!-- worked-example:"


def test_the_readmes_worked_example_for_a_line_loads_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The block after the marker, with only its model path moved to a model of its three classes;
    # the Pi camera's module, which cannot exist here, faked at the import boundary.
    monkeypatch.setitem(sys.modules, "picamera2", ModuleType("picamera2"))
    text = README.read_text()
    assert MARKER in text, "the README no longer marks the line's worked example"
    block = text.split(MARKER, 1)[1].split("```toml\n", 1)[1].split("\n```", 1)[0]
    model_path = '"/var/lib/edged/models/parts.onnx"'
    assert model_path in block
    fixed_scene(tmp_path / "parts.onnx", [])
    config = tmp_path / "edged.toml"
    config.write_text(block.replace(model_path, '"parts.onnx"'))
    settings = load_config(config)
    inspect, evidence = settings.inspect, settings.evidence
    assert inspect is not None and inspect.zones and inspect.class_conf and inspect.ng_classes and inspect.min_area
    assert settings.trigger.mode == "request"
    assert evidence is not None and evidence.save == "ng+near"
    # Every class it names is one of the model's, and the evidence finds near misses.
    path = frame_path(settings, load_model(settings.model, settings.runtime), settings.source[0])
    assert path.inspector is not None and path.inspector.thresholds == [0.40, 0.30, 0.25]
    assert path.near_margin == evidence.near_margin
