"""``edged eval`` on a YOLO-format folder, through the daemon's own pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest
from daemon import run_cli
from onnx_models import colour_probe

from edged.errors import EXIT_DATA
from edged.tools.evaluate import label_path, read_yolo_labels

pytestmark = pytest.mark.tools

RED, BLUE = (0, 0, 255), (255, 0, 0)
# The probe's box in a 128x96 frame is (48, 20)-(80, 44): as YOLO cx cy w h, normalised.
PROBE_LABEL = f"{64 / 128} {32 / 96} {32 / 128} {24 / 96}"


def _dataset(root: Path, images: dict[str, tuple[tuple[int, int, int], str | None]]) -> Path:
    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir()
    for name, (colour, label) in images.items():
        cv2.imwrite(str(root / "images" / f"{name}.png"), np.full((96, 128, 3), colour, np.uint8))
        if label is not None:
            (root / "labels" / f"{name}.txt").write_text(label + "\n")
    return root


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return colour_probe(tmp_path / "probe.onnx")


def test_perfect_labels_score_one(tmp_path: Path, model: Path) -> None:
    data = _dataset(
        tmp_path / "data",
        {
            "r1": (RED, f"0 {PROBE_LABEL}"),
            "r2": (RED, f"0 {PROBE_LABEL}"),
            "b1": (BLUE, f"1 {PROBE_LABEL}"),
            "b2": (BLUE, f"1 {PROBE_LABEL}"),
        },
    )
    report_file = tmp_path / "report.json"
    result = run_cli("eval", "--model", str(model), "--data", str(data), "--json", str(report_file))
    assert result.returncode == 0, result.stderr
    report = json.loads(report_file.read_text())
    assert report["n_images"] == 4
    assert report["map50"] == pytest.approx(1.0) and report["map50_95"] == pytest.approx(1.0)
    # The weak cross-colour scores (about 0.11) sit below the report threshold of 0.25.
    assert report["precision"] == pytest.approx(1.0) and report["recall"] == pytest.approx(1.0)
    assert [c["name"] for c in report["per_class"]] == ["red", "blue"]
    assert "all" in result.stdout and "mAP50" in result.stdout


def test_a_missed_object_and_a_background_image(tmp_path: Path, model: Path) -> None:
    # r2's label is in the wrong place (a miss plus a false positive); bg has no label file.
    data = _dataset(
        tmp_path / "data",
        {
            "r1": (RED, f"0 {PROBE_LABEL}"),
            "r2": (RED, "0 0.1 0.1 0.1 0.1"),
            "bg": (BLUE, None),
        },
    )
    report_file = tmp_path / "report.json"
    result = run_cli("eval", "--model", str(model), "--data", str(data), "--json", str(report_file))
    assert result.returncode == 0, result.stderr
    red = json.loads(report_file.read_text())["per_class"][0]
    assert red["n_gt"] == 2
    assert red["recall"] == pytest.approx(0.5)
    # Red predictions: r1 and r2 tie at ~0.86 and a stable sort keeps image order (r1 a hit
    # first, then r2 a miss), bg ~0.11 a miss. 101-point AP: precision 1 up to recall 0.5,
    # nothing beyond: 51 of the 101 points at 1.0.
    assert red["ap50"] == pytest.approx(51 / 101, abs=1e-6)


@pytest.mark.parametrize(
    ("label", "message"),
    [
        ("0 0.5 0.5", "expected 'class cx cy w h'"),  # too few fields
        ("7 0.5 0.5 0.1 0.1", "class 7 but the model has 2 classes"),
    ],
)
def test_bad_labels_fail_with_file_and_line(tmp_path: Path, model: Path, label: str, message: str) -> None:
    data = _dataset(tmp_path / "data", {"r1": (RED, label)})
    result = run_cli("eval", "--model", str(model), "--data", str(data))
    assert result.returncode == EXIT_DATA
    assert message in result.stderr and "r1.txt:1" in result.stderr


def test_empty_folder_is_a_clear_error(tmp_path: Path, model: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = run_cli("eval", "--model", str(model), "--data", str(tmp_path / "empty"))
    assert result.returncode == EXIT_DATA and "no images" in result.stderr


def test_label_path_follows_the_yolo_layout(tmp_path: Path) -> None:
    data = _dataset(tmp_path / "set", {"a": (RED, "0 0.5 0.5 0.2 0.2")})
    assert label_path(data / "images" / "a.png") == data / "labels" / "a.txt"
    assert label_path(tmp_path / "flat" / "b.jpg") == tmp_path / "flat" / "b.txt"
    boxes, classes = read_yolo_labels(data / "labels" / "a.txt", 100, 50, 1)
    np.testing.assert_allclose(boxes, [[40, 20, 60, 30]])
    assert classes.tolist() == [0]
