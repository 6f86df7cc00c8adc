"""``edged eval`` on a YOLO-format folder, through the daemon's own pipeline, scored as yolo val or pycocotools."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import cv2
import numpy as np
import pytest
from daemon import run_cli
from images import black_png, lying_jpeg, oversized_png, truncated_jpeg
from onnx_models import colour_probe

from edged.cli import main
from edged.config import ModelConfig, RuntimeConfig
from edged.errors import EXIT_CONFIG, EXIT_DATA, EXIT_USAGE, DataError
from edged.geometry import BoxMap
from edged.model import load_model
from edged.sources.scenes import SceneGenerator
from edged.tools.evaluate import (
    MAX_LABEL_OBJECTS,
    class_samples,
    evaluate,
    folder_samples,
    label_path,
    read_yolo_labels,
    read_yolo_outlines,
    scene_samples,
    truth_masks,
)

pytestmark = pytest.mark.tools

RED, BLUE = (0, 0, 255), (255, 0, 0)
# Red and blue at once: the probe scores red about 0.86 and blue about 0.70 (letterboxed means).
PURPLE = (200, 0, 255)
# The probe's box in a 128x96 frame is (48, 20)-(80, 44): as YOLO cx cy w h, normalised.
PROBE_LABEL = f"{64 / 128} {32 / 96} {32 / 128} {24 / 96}"


def _dataset(root: Path, images: Mapping[str, tuple[tuple[int, int, int], str | None]]) -> Path:
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


PERFECT = {
    "r1": (RED, f"0 {PROBE_LABEL}"),
    "r2": (RED, f"0 {PROBE_LABEL}"),
    "b1": (BLUE, f"1 {PROBE_LABEL}"),
    "b2": (BLUE, f"1 {PROBE_LABEL}"),
}


def test_perfect_labels_score_one_as_pycocotools(tmp_path: Path, model: Path) -> None:
    data = _dataset(tmp_path / "data", PERFECT)
    report_file = tmp_path / "report.json"
    result = run_cli("eval", "--model", str(model), "--data", str(data), "--coco", "--json", str(report_file))
    assert result.returncode == 0, result.stderr
    report = json.loads(report_file.read_text())
    assert report["convention"] == "coco" and report["n_images"] == 4
    assert report["map50"] == pytest.approx(1.0) and report["map50_95"] == pytest.approx(1.0)
    # The weak cross-colour scores (about 0.11) sit below the report threshold of 0.25.
    assert report["precision"] == pytest.approx(1.0) and report["recall"] == pytest.approx(1.0)
    assert [c["name"] for c in report["per_class"]] == ["red", "blue"]
    assert "all" in result.stdout and "mAP50" in result.stdout and "pycocotools" in result.stdout


def test_perfect_labels_score_0995_as_yolo_val(tmp_path: Path, model: Path) -> None:
    # yolo val's trapezoid over its 101-point curve gives a perfect class 0.995, never 1.
    data = _dataset(tmp_path / "data", PERFECT)
    report_file = tmp_path / "report.json"
    result = run_cli("eval", "--model", str(model), "--data", str(data), "--json", str(report_file))
    assert result.returncode == 0, result.stderr
    report = json.loads(report_file.read_text())
    assert report["convention"] == "ultralytics"
    assert (report["conf"], report["iou"], report["max_det"]) == (0.001, 0.7, 300)  # yolo val's defaults
    assert report["map50"] == pytest.approx(0.995) and report["map50_95"] == pytest.approx(0.995)
    assert report["precision"] == pytest.approx(1.0) and report["recall"] == pytest.approx(1.0)
    assert "AP as yolo val" in result.stdout


@pytest.mark.parametrize(("coco", "ap50"), [(True, 51 / 101), (False, 0.495)])
def test_a_missed_object_and_a_background_image(tmp_path: Path, model: Path, coco: bool, ap50: float) -> None:
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
    result = run_cli(
        "eval", "--model", str(model), "--data", str(data), "--json", str(report_file), *(["--coco"] if coco else [])
    )
    assert result.returncode == 0, result.stderr
    red = json.loads(report_file.read_text())["per_class"][0]
    assert red["n_gt"] == 2
    assert red["recall"] == pytest.approx(0.5)
    # Red predictions: r1 and r2 tie at ~0.86 and a stable sort keeps image order (r1 a hit
    # first, then r2 a miss), bg's red ~0.11 a miss. Precision 1 up to recall 0.5, nothing
    # beyond: 51 of COCO's 101 points at 1.0; yolo val's curve is 1 over 0.00..0.49 and drops
    # to 0 at 0.50 (0.49 + 0.005).
    assert red["ap50"] == pytest.approx(ap50, abs=1e-6)


@pytest.mark.parametrize(("head", "blue_ap50"), [("yolov8", 0.995), ("yolov5", 0.995), ("end2end", 0.0)])
def test_every_class_of_a_box_is_ranked_as_yolo_val_ranks_it(tmp_path: Path, head: str, blue_ap50: float) -> None:
    # A purple frame with a red and a blue object at the probe's box. The daemon publishes the
    # box once, as red; yolo val ranks it under blue too. The end2end probe reports red only.
    data = _dataset(tmp_path / "data", {"p": (PURPLE, f"0 {PROBE_LABEL}\n1 {PROBE_LABEL}")})
    model = load_model(ModelConfig(path=colour_probe(tmp_path / "m.onnx", head=head), conf=0.001, iou=0.7), RuntimeConfig())
    total, samples = folder_samples(data, model.num_classes)
    red, blue = evaluate(model, samples, total, report_conf=0.25).per_class
    assert red.ap50 == pytest.approx(0.995) and (red.n_pred, red.recall) == (1, 1.0)
    assert blue.ap50 == pytest.approx(blue_ap50)
    assert (blue.n_pred, blue.recall) == (0, 0.0)  # precision and recall count what is published


def test_coco_without_pycocotools_fails_before_evaluating(
    tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "pycocotools", None)
    monkeypatch.setitem(sys.modules, "pycocotools.cocoeval", None)
    data = _dataset(tmp_path / "data", {"r1": (RED, f"0 {PROBE_LABEL}")})
    assert main(["eval", "--model", str(model), "--data", str(data), "--coco"]) == EXIT_CONFIG
    captured = capsys.readouterr()
    assert "pip install pycocotools" in captured.err and "images" not in captured.err and captured.out == ""


@pytest.mark.parametrize(
    ("label", "message"),
    [
        ("0 0.5 0.5", "expected 'class cx cy w h'"),  # too few fields
        ("7 0.5 0.5 0.1 0.1", "class 7 but the model has 2 classes"),
        # As written: it was said as 99999999999999991611392, and 1e300 as its 301 digits.
        ("99999999999999999999 0.5 0.5 0.1 0.1", "class 99999999999999999999 but the model has 2 classes"),
        ("1e300 0.5 0.5 0.1 0.1", "class 1e300 but the model has 2 classes"),
    ],
)
def test_bad_labels_fail_with_file_and_line(tmp_path: Path, model: Path, label: str, message: str) -> None:
    data = _dataset(tmp_path / "data", {"r1": (RED, label)})
    result = run_cli("eval", "--model", str(model), "--data", str(data))
    assert result.returncode == EXIT_DATA
    assert message in result.stderr and "r1.txt:1" in result.stderr
    assert len(result.stderr) < 400


def test_a_folder_without_any_label_file_is_refused(tmp_path: Path, model: Path) -> None:
    # It was scored against no label at all: every class 0.000, exit 0, as if the model found nothing.
    data = _dataset(tmp_path / "data", {"r1": (RED, None), "b1": (BLUE, None)})
    result = run_cli("eval", "--model", str(model), "--data", str(data))
    assert result.returncode == EXIT_DATA, result.stderr
    assert f"none of the 2 image(s) under {data} has a YOLO label file" in result.stderr


def test_labels_without_a_box_are_warned_of(tmp_path: Path, model: Path) -> None:
    data = _dataset(tmp_path / "data", {"r1": (RED, ""), "b1": (BLUE, "")})
    result = run_cli("eval", "--model", str(model), "--data", str(data))
    assert result.returncode == 0, result.stderr
    assert f"the labels under {data} hold no box: every figure is 0 for want of one" in result.stderr


@pytest.mark.parametrize(("given", "said"), [("r1.png", "is a file"), ("gone", "does not exist"), ("*.png", "a glob")])
def test_data_that_is_no_folder_is_said_to_be_none(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str], given: str, said: str
) -> None:
    # A file, a missing folder and an unexpanded glob were each "no images under" them.
    data = _dataset(tmp_path / "data", {"r1": (RED, None)})
    path = data / "images" / given
    assert main(["eval", "--model", str(model), "--data", str(path)]) == EXIT_DATA
    err = capsys.readouterr().err
    assert f"{path} " in err and said in err and "give the folder that holds the images" in err


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


TASKS = Path(__file__).parent / "data" / "tasks"


def test_a_classifier_is_scored_top1_and_top5_as_yolo_val_on_a_folder_per_class(tmp_path: Path) -> None:
    # ultralytics' predict (tests/data/tasks/cls.json) ranks crack first on wide, dent on tall, stain on strip,
    # and scratch on square, labelled good here: three of four right; five classes, so every class is in the top 5.
    for name, label in (("wide", "crack"), ("tall", "dent"), ("strip", "stain"), ("square", "good")):
        folder = tmp_path / "data" / "val" / label
        folder.mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(folder / f"{name}.png"), cv2.imread(str(TASKS / f"{name}.png")))
    (tmp_path / "data" / "train").mkdir()  # yolo val reads val/ only
    report_file = tmp_path / "report.json"
    result = run_cli(
        "eval", "--model", str(TASKS / "cls.onnx"), "--data", str(tmp_path / "data"), "--json", str(report_file)
    )
    assert result.returncode == 0, result.stderr
    assert "top1_acc 0.7500  top5_acc 1.0000  (4 images)" in result.stdout
    report = json.loads(report_file.read_text())
    assert (report["top1"], report["top5"], report["images"]) == (0.75, 1.0, 4)


def test_a_classifier_refuses_a_folder_named_for_no_class_and_scenes(tmp_path: Path) -> None:
    (tmp_path / "val" / "rust").mkdir(parents=True)
    cv2.imwrite(str(tmp_path / "val" / "rust" / "a.png"), np.zeros((8, 8, 3), np.uint8))
    assert main(["eval", "--model", str(TASKS / "cls.onnx"), "--data", str(tmp_path)]) == EXIT_DATA
    result = run_cli("eval", "--model", str(TASKS / "cls.onnx"), "--scenes", "2")
    assert result.returncode != 0 and "a classification model is evaluated on --data" in result.stderr


def test_a_segmentation_model_has_mask_map_as_yolo_val(tmp_path: Path) -> None:
    # tests/data/tasks/segval: eight frames with outline labels and what yolo val reported for seg.onnx
    # there (tests/reference/build_segment_val.py). Its box figures match boxes in the input, unclipped,
    # where edged matches them clipped to the frame, so only the masks are held to its figures.
    reference = json.loads((TASKS / "segval" / "val.json").read_text())
    report_file = tmp_path / "report.json"
    result = run_cli("eval", "--model", str(TASKS / "seg.onnx"), "--data", str(TASKS / "segval"), "--json", str(report_file))
    assert result.returncode == 0, result.stderr
    mask = json.loads(report_file.read_text())["mask"]
    assert mask["map50"] == pytest.approx(reference["mask_map50"], abs=0.001)
    assert mask["map50_95"] == pytest.approx(reference["mask_map50_95"], abs=0.001)
    assert 0 < mask["map50_95"] < mask["map50"] < 1
    assert "Mask" in result.stdout and "masks at the prototypes' size" in result.stdout


@pytest.mark.unit
def test_outline_labels_give_their_extent_as_box() -> None:
    folder = Path(__file__).parent / "data" / "tasks" / "segval" / "labels"
    boxes, classes, outlines = read_yolo_outlines(folder / "val0.txt", 160, 160, 3)
    assert len(boxes) == len(classes) == len(outlines) > 1
    for box, outline in zip(boxes, outlines, strict=True):
        np.testing.assert_allclose(box, [*outline.min(axis=0), *outline.max(axis=0)])


@pytest.mark.unit
def test_overlapping_truth_masks_give_the_overlap_to_the_smaller() -> None:
    # A 16x16 input, prototypes 4x4: a big square over the whole input and a small one in its corner.
    m = BoxMap.letterbox(16, 16, 16, 16)
    big = np.float32([[0, 0], [16, 0], [16, 16], [0, 16]])
    small = np.float32([[0, 0], [8, 0], [8, 8], [0, 8]])
    masks = truth_masks([big, small], m, (4, 4)).reshape(2, 4, 4)
    assert masks[1].sum() == 4 and masks[1][:2, :2].all()
    assert masks[0].sum() == 12 and not (masks[0] & masks[1]).any()


def test_scene_outlines_trace_each_defects_painted_pixels() -> None:
    _, samples = scene_samples(12, seed=7, width=640, height=480, outlines=True)
    generator = SceneGenerator(640, 480, seed=7)
    traced = 0
    for index, sample in enumerate(samples):
        masks = generator.render(index, masks=True).masks
        assert masks is not None and len(sample.outlines) == len(masks) == len(sample.boxes)
        for outline, mask, (x1, y1, x2, y2) in zip(sample.outlines, masks, sample.boxes, strict=True):
            assert outline.dtype == np.float32 and outline.shape[1] == 2
            assert np.all((outline >= (x1, y1)) & (outline < (x2, y2))), "an outline lies in its box"
            filled = np.zeros(mask.shape, np.uint8)
            cv2.drawContours(filled, [outline.astype(np.int32)[:, None]], -1, 1, cv2.FILLED)
            assert (filled.astype(bool) & mask).sum() >= 0.5 * mask.sum(), "not the box's rectangle: the painted pixels"
            traced += 1
    assert traced > 5
    _, plain = scene_samples(2, seed=7, width=640, height=480)
    assert all(sample.outlines == () for sample in plain)  # without outlines, no mask is traced


def test_a_model_of_other_classes_than_the_scenes_is_not_scored_on_them(tmp_path: Path) -> None:
    # seg.onnx knows scratch, dent and stain; the scenes hold scratch, spot and crack. Scored on them,
    # a model finds nothing of its own and seemed to lose nothing (quantize said "+0.0 points").
    report_file = tmp_path / "report.json"
    result = run_cli(
        "eval", "--model", str(TASKS / "seg.onnx"), "--scenes", "2", "--size", "320x240", "--json", str(report_file)
    )
    assert result.returncode == EXIT_USAGE, result.stderr
    assert "the model's classes are scratch, dent, stain" in result.stderr and "with --data DIR" in result.stderr
    assert not report_file.exists()


def test_the_segmentation_demo_on_scenes_is_scored_against_outlines_not_box_rectangles(tmp_path: Path) -> None:
    # The demo's masks follow the painted defects: against them its mask mAP@0.5 is about 0.85;
    # against the boxes' rectangles (what a scene without outlines would give) about 0.15.
    report_file = tmp_path / "report.json"
    demo = Path(__file__).parents[1] / "models" / "demo-seg.onnx"
    result = run_cli("eval", "--model", str(demo), "--scenes", "4", "--json", str(report_file))
    assert result.returncode == 0, result.stderr
    assert json.loads(report_file.read_text())["mask"]["map50"] > 0.6


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--size", "0x0"], "--size must be from 32x32 to 7680x4320; got 0x0"),
        (["--size", "99999x99999"], "--size must be from 32x32 to 7680x4320"),  # not a 112 GiB allocation
        (["--size", "wide"], "--size must be WIDTHxHEIGHT"),
        (["--iou", "5"], "--iou: Input should be less than or equal to 1"),
        (["--max-det", "0", "--conf", "2"], "--conf: Input should be less than or equal to 1; --max-det: Input"),
    ],
)
def test_eval_options_out_of_range_are_named_and_exit_2(args: list[str], message: str) -> None:
    demo = Path(__file__).parents[1] / "models" / "demo.onnx"
    result = run_cli("eval", "--model", str(demo), "--scenes", "1", *args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.unit
@pytest.mark.parametrize("content", [b"0 0.5 0.5 0.2 0.2 \xe9\n", b"\x85\xff\x00garbage"])
def test_a_label_file_that_is_not_text_is_refused_with_its_name(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "a.txt").write_bytes(content)
    with pytest.raises(DataError, match=r"a\.txt.*not UTF-8 text"):
        read_yolo_labels(tmp_path / "a.txt", 100, 50, 1)


@pytest.mark.unit
def test_a_label_file_with_a_byte_order_mark_or_crlf_reads_as_without(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbf0 0.5 0.5 0.2 0.2\r\n0 0.5 0.5 0.4 0.4\r\n")
    boxes, classes = read_yolo_labels(tmp_path / "a.txt", 100, 50, 1)
    np.testing.assert_allclose(boxes, [[40, 20, 60, 30], [30, 15, 70, 35]])
    assert classes.tolist() == [0, 0]


@pytest.mark.unit
@pytest.mark.parametrize(
    "label",
    [
        "0 nan 0.5 0.2 0.2",
        "0 0.5 inf 0.2 0.2",
        "0 -0.5 0.5 0.2 0.2",
        "0 5 0.5 0.2 0.2",
        "0 0.5 0.5 -0.2 0.2",
        "0 0.1 0.1 0.9 0.1 1e9 0.9",
    ],
)
def test_a_coordinate_that_is_no_fraction_of_the_image_is_refused_with_file_and_line(tmp_path: Path, label: str) -> None:
    (tmp_path / "a.txt").write_text(f"0 0.5 0.5 0.2 0.2\n{label}\n")
    with pytest.raises(DataError, match=r"a\.txt:2: .*from 0 to 1"):
        read_yolo_labels(tmp_path / "a.txt", 100, 50, 1)


@pytest.mark.unit
@pytest.mark.parametrize("label", ["1.5 0.5 0.5 0.2 0.2", "x 0.5 0.5 0.2 0.2", "nan 0.5 0.5 0.2 0.2"])
def test_a_class_that_is_no_whole_number_is_named_as_such(tmp_path: Path, label: str) -> None:
    (tmp_path / "a.txt").write_text(label + "\n")
    with pytest.raises(DataError, match=r"a\.txt:1: the class .* is no whole number from 0 to 1"):
        read_yolo_labels(tmp_path / "a.txt", 100, 50, 2)


@pytest.mark.unit
def test_a_label_that_is_a_folder_is_refused_not_read_as_no_objects(tmp_path: Path) -> None:
    data = _dataset(tmp_path / "set", {"a": (RED, None)})
    (data / "labels" / "a.txt").mkdir()
    _, samples = folder_samples(data, 1)
    with pytest.raises(DataError, match=r"labels/a\.txt is a folder"):
        list(samples)


@pytest.mark.unit
def test_a_label_that_is_a_link_to_nothing_or_a_pipe_is_refused_not_read_as_no_objects(tmp_path: Path) -> None:
    # A DVC or git-annex label never fetched (a link to nothing), or a pipe, was an image without
    # objects: its boxes silently missing from the figures, its detections scored as false alarms.
    data = _dataset(tmp_path / "set", {"a": (RED, f"0 {PROBE_LABEL}"), "b": (BLUE, None)})
    label = data / "labels" / "b.txt"
    label.symlink_to(tmp_path / "annex" / "b.txt")
    assert label_path(data / "images" / "b.png") == label
    with pytest.raises(DataError, match=r"labels/b\.txt: cannot read the label file: a link to nothing"):
        list(folder_samples(data, 2)[1])
    label.unlink()
    os.mkfifo(label)
    with pytest.raises(DataError, match=r"labels/b\.txt: not a regular file"):
        list(folder_samples(data, 2)[1])


@pytest.mark.unit
def test_a_label_file_of_more_objects_than_edged_scores_at_once_is_refused(tmp_path: Path) -> None:
    # 570,000 boxes fit in the 16 MiB a label file may hold: matched against 300 predictions, 11 GB.
    rows = [f"0 {0.1 + i * 1e-4:.4f} 0.5 0.01 0.01" for i in range(MAX_LABEL_OBJECTS + 1)]
    (tmp_path / "a.txt").write_text("\n".join(rows[:-1]) + "\n")
    boxes, _ = read_yolo_labels(tmp_path / "a.txt", 100, 50, 1)
    assert len(boxes) == MAX_LABEL_OBJECTS
    (tmp_path / "a.txt").write_text("\n".join(rows) + "\n")
    with pytest.raises(DataError, match=rf"a\.txt:{MAX_LABEL_OBJECTS + 1}: more than {MAX_LABEL_OBJECTS} objects"):
        read_yolo_labels(tmp_path / "a.txt", 100, 50, 1)


@pytest.mark.unit
def test_a_class_folder_counts_the_images_in_its_subfolders_as_yolo_val(tmp_path: Path) -> None:
    # torchvision's ImageFolder, which yolo val reads a classification folder with, walks each class's tree.
    (tmp_path / "crack" / "day2").mkdir(parents=True)
    for path in (tmp_path / "crack" / "a.png", tmp_path / "crack" / "day2" / "b.png"):
        cv2.imwrite(str(path), np.zeros((8, 8, 3), np.uint8))
    samples = class_samples(tmp_path, ("good", "crack"))
    assert samples == [(tmp_path / "crack" / "a.png", 1), (tmp_path / "crack" / "day2" / "b.png", 1)]


@pytest.mark.unit
def test_an_image_over_what_opencv_decodes_is_a_data_error_naming_it(tmp_path: Path) -> None:
    data = _dataset(tmp_path / "set", {"a": (RED, None)})
    oversized_png(data / "images" / "b.png")
    _, samples = folder_samples(data, 1)
    with pytest.raises(DataError, match=r"images/b\.png"):
        list(samples)


@pytest.mark.unit
@pytest.mark.parametrize(("make", "kind"), [(black_png, "PNG"), (lying_jpeg, "JPEG")])
def test_an_image_claiming_more_pixels_than_a_camera_gives_is_a_data_error_naming_the_limit(
    tmp_path: Path, make: Callable[[Path, int, int], Path], kind: str
) -> None:
    # 8000x4400 in a few kilobytes was decoded into 106 MB; 30000x30000 would take 2.7 GB, all of a 4 GB board.
    data = _dataset(tmp_path / "set", {"a": (RED, None)})
    make(data / "images" / f"b.{kind.lower()}", 8000, 4400)
    _, samples = folder_samples(data, 1)
    limit = r"over the 33177600 pixels \(7680x4320\) edged decodes"
    with pytest.raises(DataError, match=rf"images/b\.{kind.lower()} \(its {kind} header claims 8000x4400 pixels, {limit}"):
        list(samples)


@pytest.mark.unit
def test_a_jpeg_cut_short_is_a_data_error_saying_so(tmp_path: Path) -> None:
    # Its missing rows were decoded grey and scored as if the part looked so.
    data = _dataset(tmp_path / "set", {"a": (RED, None)})
    truncated_jpeg(data / "images" / "b.jpg", np.full((96, 128, 3), RED, np.uint8))
    _, samples = folder_samples(data, 1)
    with pytest.raises(DataError, match=r"images/b\.jpg \(truncated JPEG: .* still being written"):
        list(samples)


@pytest.mark.unit
@pytest.mark.parametrize(
    "line", ["0 0.5 0.5 0.2 0.2 " + "0.5 " * 100_001, "x" * 1_000_000, "0 " + "7 " * 500_000, "0 0.5 0.5 0.2 x" * 50_000]
)
def test_a_refused_label_line_is_shown_cut_short(tmp_path: Path, line: str) -> None:
    # A megabyte line was echoed whole into the error, a megabyte on the terminal and in the journal.
    (tmp_path / "a.txt").write_text(line + "\n")
    with pytest.raises(DataError, match=r"a\.txt:1: ") as raised:
        read_yolo_labels(tmp_path / "a.txt", 100, 50, 1)
    assert len(str(raised.value)) < 400 + len(str(tmp_path))


@pytest.mark.unit
def test_a_label_file_larger_than_any_image_needs_is_refused_before_it_is_read(tmp_path: Path) -> None:
    # 1,000,000 boxes in 18 MB: read whole, it took some 200 MB; a gigabyte one took gigabytes.
    (tmp_path / "a.txt").write_text("0 0.5 0.5 0.2 0.2\n" * 1_000_000)
    with pytest.raises(DataError, match=r"a\.txt holds 18\.0 MB"):
        read_yolo_labels(tmp_path / "a.txt", 100, 50, 1)


@pytest.mark.unit
def test_an_image_that_is_a_link_to_nothing_is_named_not_left_out(tmp_path: Path) -> None:
    # A git-annex or DVC data set whose content was never fetched is links to nothing: they were left
    # out without a word, for figures on fewer images than the folder shows.
    data = _dataset(tmp_path / "set", {"a": (RED, None)})
    (data / "images" / "b.png").symlink_to(tmp_path / "annex" / "b.png")
    total, samples = folder_samples(data, 1)
    assert total == 2
    with pytest.raises(DataError, match=r"images/b\.png .*link to nothing"):
        list(samples)
    (data / "images" / "b.png").unlink()
    (data / "images" / "b.png").symlink_to("b.png")  # a loop of links is not one to fetch
    with pytest.raises(DataError, match=r"images/b\.png .*Too many levels of symbolic links"):
        list(folder_samples(data, 1)[1])


def test_an_image_whose_name_is_not_utf8_is_read(tmp_path: Path) -> None:
    # OpenCV's Python binding crashed (SIGSEGV) on a file name of other bytes (a Latin-1 name copied
    # from an old share), which Python holds as lone surrogates; run as a process, so a crash is a failure.
    data = _dataset(tmp_path / "set", {"a": (RED, f"0 {PROBE_LABEL}")})
    os.rename(data / "images" / "a.png", os.fsencode(data / "images") + b"/\xe9t\xe9.png")
    os.rename(data / "labels" / "a.txt", os.fsencode(data / "labels") + b"/\xe9t\xe9.txt")
    result = run_cli("eval", "--model", str(colour_probe(tmp_path / "probe.onnx")), "--data", str(data))
    assert result.returncode == 0, result.stderr
    assert "all" in result.stdout and "1/1 images" in result.stderr


@pytest.mark.unit
def test_an_outline_may_stray_outside_the_image_where_its_box_does_not_as_ultralytics_checks_it(tmp_path: Path) -> None:
    # ultralytics checks an outline's box (centre and size, from its extent), not each point: a
    # labelling tool's point a hair outside the image is kept, with the box it spans.
    (tmp_path / "a.txt").write_text("0 -0.01 0.2 0.4 0.2 0.4 0.6\n0 0.2 0.2 0.4 0.2 0.4 nan\n")
    with pytest.raises(DataError, match=r"a\.txt:2: "):
        read_yolo_labels(tmp_path / "a.txt", 100, 50, 1)
    (tmp_path / "a.txt").write_text("0 -0.01 0.2 0.4 0.2 0.4 0.6\n")
    boxes, _ = read_yolo_labels(tmp_path / "a.txt", 100, 50, 1)
    np.testing.assert_allclose(boxes, [[-1, 10, 40, 30]])


@pytest.mark.unit
def test_duplicate_label_rows_are_dropped_and_logged_as_yolo_val_drops_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A row labelled twice (a merge of two exports) was two objects here and one in yolo val: a
    # recall and mAP below the figures ultralytics gives for the same data.
    (tmp_path / "a.txt").write_text("0 0.5 0.5 0.2 0.2\n1 0.5 0.5 0.2 0.2\n0 0.5 0.5 0.2 0.2\n0 0.5 0.5 0.2 0.2\n")
    boxes, classes = read_yolo_labels(tmp_path / "a.txt", 100, 50, 2)
    np.testing.assert_allclose(boxes, [[40, 20, 60, 30]] * 2)
    assert classes.tolist() == [0, 1]
    assert [r.getMessage() for r in caplog.records if "a.txt" in r.getMessage()] == [
        f"{tmp_path / 'a.txt'}: 2 duplicate label(s) removed, as yolo val removes them"
    ]


@pytest.mark.unit
def test_a_class_written_as_a_whole_float_reads_as_yolo_val_reads_it(tmp_path: Path) -> None:
    # ultralytics reads a label file as floats: "1.0" is class 1 there, and was refused here.
    (tmp_path / "a.txt").write_text("1.0 0.5 0.5 0.2 0.2\n")
    _, classes = read_yolo_labels(tmp_path / "a.txt", 100, 50, 2)
    assert classes.tolist() == [1]
