"""``edged calibrate``: an anomaly model's score distribution over good parts, the proposed thresholds, the separation."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from daemon import run_cli, write_config
from images import black_png, truncated_jpeg

from edged.cli import SUBCOMMANDS
from edged.config import ModelConfig, RuntimeConfig
from edged.errors import EXIT_CONFIG, DataError
from edged.model import LoadedModel, load_model
from edged.tools.calibrate import (
    PixelAuroc,
    Scored,
    UpperQuantile,
    auroc,
    best_f1,
    f1_at,
    frames_of,
    images_in,
    ranked_auroc,
    report,
    scored_with_quantile,
)
from edged.tools.evaluate import evaluate_anomaly

pytestmark = pytest.mark.tools

DATA = Path(__file__).parent / "data" / "anomaly"
REFERENCE: dict[str, Any] = json.loads((DATA / "padim.json").read_text())
GOOD = ("good_320x240", "good_1280x720")
BAD = ("spot_320x240", "scratch_200x300", "spot_256x256")


@pytest.mark.unit
def test_auroc_and_f1_count_as_their_definitions_say() -> None:
    good, bad = np.array([0.1, 0.2, 0.6]), np.array([0.5, 0.7, 0.9])
    assert auroc(good, bad) == pytest.approx(8 / 9)
    assert auroc(np.array([0.5]), np.array([0.5])) == 0.5
    assert f1_at(good, bad, 0.65) == pytest.approx(2 * 2 / (2 * 2 + 0 + 1))
    threshold, f1 = best_f1(good, bad)
    assert f1 == pytest.approx(f1_at(good, bad, threshold)) and f1 >= f1_at(good, bad, 0.65)
    assert 0.2 < threshold < 0.5 or 0.6 <= threshold < 0.7


def folders(tmp_path: Path) -> tuple[Path, Path]:
    for kind, names in (("good", GOOD), ("bad", BAD)):
        (tmp_path / kind).mkdir()
        for name in names:
            shutil.copy(DATA / f"{name}.png", tmp_path / kind / f"{name}.png")
    return tmp_path / "good", tmp_path / "bad"


def test_calibrate_proposes_thresholds_from_good_parts_and_reports_the_separation(tmp_path: Path) -> None:
    good, bad = folders(tmp_path)
    config = write_config(
        tmp_path / "edged.toml", {"source": {"type": "synthetic"}, "model": {"path": str(DATA / "padim.onnx")}}
    )
    result = run_cli("calibrate", "--config", str(config), "--good", str(good), "--bad", str(bad))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    scores = sorted(REFERENCE[name]["pred_score"] for name in GOOD)
    assert f"good parts (2): min {scores[0]:.4f}" in out and f"max {scores[1]:.4f}" in out
    proposed = float(re.search(r"^anomaly_threshold = ([0-9.]+)", out, re.M).group(1))  # type: ignore[union-attr]
    assert proposed == pytest.approx(np.percentile(scores, 99.5) + 0.02, abs=1e-4)
    assert re.search(r"^pixel_threshold = 0\.[0-9]+", out, re.M)
    assert "image AUROC 1.0000" in out and "best F1 1.0000" in out and "0 of 3 bad part(s) missed" in out


def test_thresholds_proposed_from_too_few_good_parts_are_said_to_be_so() -> None:
    # From one good part the 99.5th percentile is its score: proposed as if it held for the line, unsaid.
    model = load_model(ModelConfig(path=DATA / "padim.onnx"), RuntimeConfig())
    for count, warned in ((1, True), (199, True), (200, False)):
        out = io.StringIO()
        report(model, Scored(np.linspace(0.1, 0.3, count), None), None, out)
        assert (f"warning: from {count} good part(s), fewer than 200" in out.getvalue()) == warned


def test_calibrate_refuses_a_detection_model_and_an_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    demo = Path(__file__).parent.parent / "models" / "demo.onnx"
    config = write_config(tmp_path / "edged.toml", {"source": {"type": "synthetic"}, "model": {"path": str(demo)}})
    result = run_cli("calibrate", "--config", str(config), "--good", str(tmp_path))
    # A model of another task is a model problem (exit 78), not a usage error: no option makes calibrate serve it.
    assert result.returncode == EXIT_CONFIG, result.stderr
    assert f"model.path {demo} is a detection model, and edged calibrate serves anomaly models only" in result.stderr
    assert "give model.path an anomaly model" in result.stderr
    help_text = next(text for name, _, text, _ in SUBCOMMANDS if name == "calibrate")
    assert "78 for a configuration or model problem, a model of another task included" in help_text
    config = write_config(
        tmp_path / "a.toml", {"source": {"type": "synthetic"}, "model": {"path": str(DATA / "padim.onnx")}}
    )
    result = run_cli("calibrate", "--config", str(config), "--good", str(tmp_path / "empty"))
    assert result.returncode == 65 and "holds no images" in result.stderr


def test_eval_of_an_anomaly_model_reports_the_image_auroc_and_f1_on_good_and_bad_folders(tmp_path: Path) -> None:
    folders(tmp_path)
    report = tmp_path / "report.json"
    result = run_cli("eval", "--model", str(DATA / "padim.onnx"), "--data", str(tmp_path), "--json", str(report))
    assert result.returncode == 0, result.stderr
    assert "2 good, 3 bad parts: image AUROC 1.0000" in result.stdout
    document = json.loads(report.read_text())
    assert (document["image_auroc"], document["missed"], document["false_alarms"], document["f1"]) == (1.0, 0, 0, 1.0)


@pytest.mark.unit
def test_the_ranked_auroc_is_the_pairwise_one() -> None:
    rng = np.random.default_rng(0)
    good, bad = rng.integers(0, 20, 50).astype(np.float64), rng.integers(5, 25, 40).astype(np.float64)  # many ties
    scores = np.concatenate([good, bad])
    positive = np.concatenate([np.zeros(50, np.bool_), np.ones(40, np.bool_)])
    pairwise = ((bad[:, None] > good[None, :]).sum() + 0.5 * (bad[:, None] == good[None, :]).sum()) / (50 * 40)
    assert ranked_auroc(scores, positive) == pytest.approx(pairwise)


@pytest.mark.unit
@pytest.mark.parametrize("q", [99.9, 99.5, 50.0, 100.0, 0.0])
def test_the_upper_quantile_of_maps_added_one_by_one_is_numpys_percentile_of_them_all(q: float) -> None:
    rng = np.random.default_rng(1)
    # The largest values come first: the ones kept early must still hold the percentile's neighbours.
    maps = [rng.random((24, 32), np.float32) * (40 - i) for i in range(40)]
    quantile = UpperQuantile(q, len(maps))
    for i, m in enumerate(maps):
        quantile.add(i, m)
    assert quantile.value() == pytest.approx(float(np.percentile(np.stack(maps), q)), rel=1e-6)
    assert UpperQuantile(q, 3).value() is None


@pytest.mark.unit
def test_the_pixel_auroc_binned_is_the_ranked_one() -> None:
    rng = np.random.default_rng(2)
    # Whole numbers (and their negatives) fall in bins of their own: the same figure, ties included.
    values = [rng.integers(-300, 300, (16, 16)).astype(np.float32) for _ in range(6)]
    truth = [rng.random((16, 16)) < 0.3 + 0.1 * i for i in range(6)]
    for i in range(6):
        values[i][truth[i]] += 40
    pixels = PixelAuroc()
    pixels.add(values[0], None)
    for v, t in zip(values[1:], truth[1:], strict=True):
        pixels.add(v, t)
    ranked = ranked_auroc(
        np.concatenate([v.ravel() for v in values]),
        np.concatenate([np.zeros(256, np.bool_), *(t.ravel() for t in truth[1:])]),
    )
    assert pixels.value() == pytest.approx(ranked, abs=1e-12)
    # Continuous values tie only within a relative 2^-11 of each other.
    floats = [rng.normal(0.5 * t, 1.0).astype(np.float32) for t in truth]
    pixels = PixelAuroc()
    for v, t in zip(floats, truth, strict=True):
        pixels.add(v, t)
    ranked = ranked_auroc(np.concatenate([v.ravel() for v in floats]), np.concatenate([t.ravel() for t in truth]))
    assert pixels.value() == pytest.approx(ranked, abs=1e-3)
    assert PixelAuroc().value() is None


def test_eval_reports_the_pixel_auroc_where_masks_of_the_defects_exist(tmp_path: Path) -> None:
    scenes = Path(__file__).parent / "reference" / "anomaly_scenes.py"
    made = subprocess.run(
        [sys.executable, str(scenes), "--out", str(tmp_path), "--count", "4", "--seed", "5"], capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in (tmp_path / "masks").iterdir()) == [f"{i:03d}.png" for i in range(4)]
    report = tmp_path / "report.json"
    result = run_cli("eval", "--model", str(DATA / "padim.onnx"), "--data", str(tmp_path), "--json", str(report))
    assert result.returncode == 0, result.stderr
    pixel = json.loads(report.read_text())["pixel_auroc"]
    assert 0.8 < pixel <= 1.0 and f"pixel AUROC {pixel:.4f}" in result.stdout
    (tmp_path / "masks" / "002.png").unlink()
    result = run_cli("eval", "--model", str(DATA / "padim.onnx"), "--data", str(tmp_path))
    assert result.returncode == 65 and "no readable mask for 002.png" in result.stderr


@pytest.mark.unit
def test_a_good_part_cut_short_is_a_data_error_saying_so(tmp_path: Path) -> None:
    # Its missing rows were decoded grey and scored as a good part looking so.
    good, _ = folders(tmp_path)
    truncated_jpeg(good / "late.jpg", cv2.imread(str(DATA / "good_320x240.png")))
    with pytest.raises(DataError, match=r"late\.jpg \(truncated JPEG: .*still being written"):
        list(frames_of(images_in(good)))


def test_eval_names_why_a_mask_cannot_be_read(tmp_path: Path) -> None:
    folders(tmp_path)
    (tmp_path / "masks").mkdir()
    for name in BAD:
        cv2.imwrite(str(tmp_path / "masks" / f"{name}.png"), np.zeros((8, 8), np.uint8))
    mask = tmp_path / "masks" / f"{BAD[1]}.png"
    png = mask.read_bytes()
    mask.write_bytes(png[: len(png) // 2])
    model = load_model(ModelConfig(path=DATA / "padim.onnx"), RuntimeConfig())
    with open(tmp_path / "out.txt", "w") as out, pytest.raises(DataError) as raised:
        evaluate_anomaly(model, tmp_path, None, out)
    assert f"{BAD[1]}.png is no readable mask for {BAD[1]}.png (truncated PNG:" in str(raised.value)
    black_png(mask, 8000, 4400)  # was decoded, 35 MB, then resized to the image
    with open(tmp_path / "out.txt", "w") as out, pytest.raises(DataError) as raised:
        evaluate_anomaly(model, tmp_path, None, out)
    assert f"{BAD[1]}.png (its PNG header claims 8000x4400 pixels, over the 33177600 pixels" in str(raised.value)


def test_eval_lists_the_masks_folder_once_whatever_the_number_of_bad_images(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was listed again for each bad image: at tens of thousands of images, a billion names read."""
    folders(tmp_path)
    (tmp_path / "masks").mkdir()
    for name in BAD:
        cv2.imwrite(str(tmp_path / "masks" / f"{name}.png"), np.full((8, 8), 255, np.uint8))
    listed: list[Path] = []
    iterdir = Path.iterdir

    def counted(self: Path) -> Iterator[Path]:
        listed.append(self)
        return iterdir(self)

    monkeypatch.setattr(Path, "iterdir", counted)
    model = load_model(ModelConfig(path=DATA / "padim.onnx"), RuntimeConfig())
    with open(tmp_path / "out.txt", "w") as out:
        assert evaluate_anomaly(model, tmp_path, None, out) == 0
    assert len(BAD) > 1 and listed.count(tmp_path / "masks") == 1, listed
    assert "pixel AUROC" in (tmp_path / "out.txt").read_text()


def test_a_mask_of_16_bits_marks_the_defect_its_values_mark(tmp_path: Path) -> None:
    # Labelling tools export 16-bit masks of instance ids 1, 2, ...: read as 8 bits, each value shifted
    # right by 8, every defect pixel of such a mask read as unmarked.
    folders(tmp_path)
    (tmp_path / "masks").mkdir()
    model = load_model(ModelConfig(path=DATA / "padim.onnx"), RuntimeConfig())

    def pixel_auroc(dtype: type[np.generic], value: int) -> float:
        for name in BAD:
            mask = np.zeros((64, 64), dtype)
            mask[16:48, 16:48] = value
            cv2.imwrite(str(tmp_path / "masks" / f"{name}.png"), mask)
        evaluate_anomaly(model, tmp_path, tmp_path / "report.json", io.StringIO())
        pixel: float = json.loads((tmp_path / "report.json").read_text())["pixel_auroc"]
        return pixel

    assert pixel_auroc(np.uint16, 1) == pixel_auroc(np.uint8, 255)


def test_eval_takes_the_defects_from_yolo_polygons_beside_the_bad_images_as_evidence_writes_them(tmp_path: Path) -> None:
    scenes = Path(__file__).parent / "reference" / "anomaly_scenes.py"
    made = subprocess.run(
        [sys.executable, str(scenes), "--out", str(tmp_path), "--count", "4", "--seed", "5"], capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    from_masks = tmp_path / "masks.json"
    assert (
        run_cli("eval", "--model", str(DATA / "padim.onnx"), "--data", str(tmp_path), "--json", str(from_masks)).returncode
        == 0
    )
    for mask_path in sorted((tmp_path / "masks").iterdir()):
        mask = cv2.imread(str(mask_path), cv2.IMREAD_GRAYSCALE)
        h, w = mask.shape
        contours, _ = cv2.findContours(mask, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_NONE)
        rows = ["0 " + " ".join(f"{x / w:.6f} {y / h:.6f}" for x, y in c.reshape(-1, 2)) for c in contours if len(c) >= 3]
        assert rows
        (tmp_path / "bad" / f"{mask_path.stem}.txt").write_text("\n".join(rows) + "\n")
    shutil.rmtree(tmp_path / "masks")
    report = tmp_path / "report.json"
    result = run_cli("eval", "--model", str(DATA / "padim.onnx"), "--data", str(tmp_path), "--json", str(report))
    assert result.returncode == 0, result.stderr
    pixel, expected = (json.loads(p.read_text())["pixel_auroc"] for p in (report, from_masks))
    assert pixel == pytest.approx(expected, abs=0.01) and f"pixel AUROC {pixel:.4f}" in result.stdout
    (tmp_path / "bad" / "001.txt").unlink()
    result = run_cli("eval", "--model", str(DATA / "padim.onnx"), "--data", str(tmp_path))
    assert result.returncode == 65 and "no readable mask for 001.png" in result.stderr


def test_calibrate_on_frames_of_the_configured_camera_scores_them_as_the_folder(tmp_path: Path) -> None:
    good, _ = folders(tmp_path)
    camera = {"type": "images", "path": str(good), "loop": True, "fps": 20}
    config = write_config(tmp_path / "edged.toml", {"source": camera, "model": {"path": str(DATA / "padim.onnx")}})
    result = run_cli("calibrate", "--config", str(config), "--frames", "4")
    assert result.returncode == 0, result.stderr
    # The camera drops frames as the daemon does, so which of the two images the four are depends on timing;
    # each score must be one of theirs.
    scores = {f"{REFERENCE[name]['pred_score']:.4f}" for name in GOOD}
    found = re.search(r"^good parts \(4\): min ([0-9.]+) .* max ([0-9.]+)", result.stdout, re.M)
    assert found is not None, result.stdout
    assert set(found.groups()) <= scores
    assert re.search(r"^anomaly_threshold = 0\.[0-9]+", result.stdout, re.M)
    # Read once and unpaced, each image waits until it is taken: the two are given whatever the timing.
    once = write_config(
        tmp_path / "once.toml",
        {"source": {**camera, "loop": False, "pace": False}, "model": {"path": str(DATA / "padim.onnx")}},
    )
    result = run_cli("calibrate", "--config", str(once), "--frames", "5")
    assert result.returncode == 1 and "gave 2 of 5 frames" in result.stderr
    result = run_cli("calibrate", "--config", str(config), "--frames", "4", "--good", str(good))
    assert result.returncode == 2 and "one of them" in result.stderr


def _peak_mb(model: LoadedModel, sizes: list[int]) -> float:
    frames = ((np.zeros((200 + extra, 300, 3), np.uint8), "bgr") for extra in sizes)
    tracemalloc.start()
    try:
        scored_with_quantile(model, frames, len(sizes))  # type: ignore[arg-type]  # "bgr" is a ChannelOrder
        return tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()


def test_images_of_many_sizes_do_not_each_keep_a_pipeline() -> None:
    # A folder of crops has as many sizes as images; a pipeline kept per size (~3 MB each here) grew
    # without bound: 1000 sizes took 3 GB. Then the anomaly decoder of each pipeline dropped lived
    # on in a reference cycle until the cyclic collector came round: 20 MB at 30 sizes, 57 at 200.
    # At 20 sizes the cycle, put back, still adds 8 MB and the pipelines kept 60.
    model = load_model(ModelConfig(path=DATA / "padim.onnx"), RuntimeConfig())
    same, distinct = _peak_mb(model, [0] * 20), _peak_mb(model, list(range(20)))
    assert distinct < same + 6, (same, distinct)


def test_calibrating_on_more_frames_keeps_no_map_of_each() -> None:
    # Each anomaly map kept for the pixel percentile took 256 KB a frame: gigabytes for a day of
    # evidence. Only the largest 0.1 % of the values are kept now; kept maps would add 7.7 MB here.
    model = load_model(ModelConfig(path=DATA / "padim.onnx"), RuntimeConfig())
    few, many = _peak_mb(model, [0] * 10), _peak_mb(model, [0] * 40)
    assert many < few + 3, (few, many)


def test_calibrate_checks_the_bad_folder_before_scoring_the_good_parts(tmp_path: Path) -> None:
    # Scoring a large --good folder takes minutes: a mistyped --bad is said first, not after them.
    good, _ = folders(tmp_path)
    (good / "unreadable.png").write_bytes(b"")  # scoring the good parts would fail here
    config = write_config(
        tmp_path / "edged.toml", {"source": {"type": "synthetic"}, "model": {"path": str(DATA / "padim.onnx")}}
    )
    result = run_cli("calibrate", "--config", str(config), "--good", str(good), "--bad", str(tmp_path / "nope"))
    assert result.returncode == 65 and "nope is not a folder of images" in result.stderr, result.stderr


@pytest.mark.unit
def test_the_image_auroc_of_large_sets_takes_memory_in_proportion_to_them() -> None:
    # Every pair compared at once took good x bad bytes twice over: 50,000 of each, 5 GB.
    rng = np.random.default_rng(0)
    good, bad = rng.random(12_000).round(3), (rng.random(12_000) + 0.2).round(3)  # rounded: ties too
    tracemalloc.start()
    try:
        value = auroc(good, bad)
        peak_mb = tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()
    assert peak_mb < 20, peak_mb
    pairs = sum(
        (part[:, None] > good[None, :]).sum() + 0.5 * (part[:, None] == good[None, :]).sum() for part in np.split(bad, 12)
    )
    assert value == pytest.approx(pairs / (good.size * bad.size), abs=1e-12)
    assert auroc(np.array([0.1, 0.5]), np.array([0.5, 0.9])) == pytest.approx((0.5 + 1 + 1 + 1) / 4)


@pytest.mark.unit
def test_images_in_subfolders_of_a_parts_folder_are_said_not_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # good/ and bad/ are read without their subfolders (an evidence day's maps/ are no parts); images
    # there were left out without a word, and a folder with images only there was said to hold none.
    (tmp_path / "good" / "day2").mkdir(parents=True)
    for name in ("good/a.png", "good/day2/b.png", "good/day2/c.png"):
        cv2.imwrite(str(tmp_path / name), np.zeros((8, 8, 3), np.uint8))
    assert images_in(tmp_path / "good") == [tmp_path / "good" / "a.png"]
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'good'}: 2 image(s) in its subfolders are not read (give each folder of parts itself)"
    ]
    (tmp_path / "good" / "a.png").unlink()
    with pytest.raises(DataError, match=r"holds no images .*2 in its subfolders"):
        images_in(tmp_path / "good")
