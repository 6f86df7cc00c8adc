"""``edged tune`` on the demo model: every variant through the full path, the gate, and the snippet it writes."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from daemon import run_cli

from edged.config import load_config
from edged.errors import EXIT_CONFIG, EXIT_DATA, EXIT_USAGE
from edged.tools.evaluate import scene_samples
from edged.tools.tune import Gate, _judge, format_table, snippet, to_move

pytestmark = pytest.mark.tools

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo.onnx"
CONFIG = f'[model]\npath = "{DEMO}"\nconf = 0.3\n\n[inspect]\nng_classes = ["crack"]\n'


def _row(engine: str, precision: str, p50: float, map50: float, flipped: int = 0) -> dict[str, Any]:
    return {
        "engine": engine,
        "precision": precision,
        "path": "m.onnx",
        "p50_ms": p50,
        "map50": map50,
        "agreement": {"verdicts_flipped": [f"image {i}" for i in range(flipped)]},
    }


@pytest.mark.unit
def test_the_gate_leaves_out_the_fastest_when_it_loses_accuracy_or_flips_a_verdict() -> None:
    rows = [_row("onnxruntime", "f32", 10, 0.90), _row("openvino", "int8", 4, 0.88), _row("openvino", "bf16", 6, 0.895)]
    choice = _judge(rows, Gate(max_map_drop=1.0, max_flips=0), inspecting=True)
    assert [r["passed"] for r in rows] == [True, False, True]  # int8 lost 2 points
    assert choice is rows[2]
    rows[2]["agreement"]["verdicts_flipped"] = ["scene 0:3"]
    assert _judge(rows, Gate(1.0, 0), inspecting=True) is rows[0]
    assert _judge(rows, Gate(1.0, 1), inspecting=True) is rows[2]
    assert _judge(rows, Gate(5.0, 1), inspecting=True) is rows[1]
    assert _judge(rows, Gate(1.0, 0), inspecting=False) is rows[2]  # no [inspect]: no verdict to flip


@pytest.mark.unit
def test_the_table_names_each_flipped_image_and_which_way_it_flipped() -> None:
    rows = [_row("onnxruntime", "f32", 10, 0.90), _row("openvino", "int8", 4, 0.90, flipped=1)]
    rows[1]["agreement"]["flips"] = [{"image": "scene029.png", "reference": "ng", "candidate": "ok"}]
    for row in rows:
        row.update(p99_ms=row["p50_ms"], cpu_ms_per_frame=1.0, rss_mb=100.0)
        row["agreement"].setdefault("flips", [])
    choice = _judge(rows, Gate(1.0, 0), inspecting=True)
    report = {
        "model": "m.onnx",
        "data": "images",
        "machine": {"cpu": "cpu", "loadavg_start": 0.0},
        "gate": {"max_map_drop": 1.0, "max_flips": 0},
        "accuracy_against": "FP32",
        "rows": rows,
        "skipped": [],
        "choice": choice,
    }
    lines = format_table(report).splitlines()
    assert lines[-3:] == ["openvino int8 flipped: scene029.png (ng -> ok)", "", "choice: onnxruntime f32 (m.onnx)"]


def test_tune_on_the_demo_model_writes_a_choice_that_passed_and_merges_into_the_config(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    _, frames = scene_samples(3, 0, 640, 360)
    for i, sample in enumerate(frames):
        cv2.imwrite(str(tmp_path / "images" / f"{i}.png"), sample.image)
    config = tmp_path / "edged.toml"
    config.write_text(CONFIG)
    snippet = tmp_path / "tuned.toml"
    done = run_cli(
        "tune", "--config", str(config), "--images", str(tmp_path / "images"), "--frames", "5", "--warmup", "2",
        "--engine", "onnxruntime", "--cache-dir", str(tmp_path / "cache"), "--json", "--out", str(snippet),
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [(r["engine"], r["precision"]) for r in report["rows"]] == [("onnxruntime", "f32"), ("onnxruntime", "int8")]
    for row in report["rows"]:
        assert row["p50_ms"] > 0 and row["p99_ms"] >= row["p50_ms"] and row["cpu_ms_per_frame"] > 0
        assert row["rss_mb"] > 0 and row["agreement"]["images"] == 3 and isinstance(row["passed"], bool)
    assert report["rows"][0]["map50"] >= 0.99 and report["rows"][0]["passed"]  # FP32 against itself
    choice = report["choice"]
    chosen = next(r for r in report["rows"] if (r["engine"], r["precision"]) == (choice["engine"], choice["precision"]))
    assert chosen["passed"] and chosen["p50_ms"] == min(r["p50_ms"] for r in report["rows"] if r["passed"])
    assert config.read_text() == CONFIG  # the configuration is never changed
    merged = tomllib.loads(CONFIG)
    merged["model"].update(tomllib.loads(snippet.read_text())["model"])
    combined = tmp_path / "combined.toml"
    combined.write_text(
        f'[model]\npath = "{merged["model"]["path"]}"\nconf = 0.3\nengine = "{merged["model"]["engine"]}"\n'
        f'precision = "{merged["model"]["precision"]}"\n\n[inspect]\nng_classes = ["crack"]\n'
    )
    settings = load_config(combined)
    assert (settings.model.engine, settings.model.precision) == (choice["engine"], choice["precision"])
    assert settings.model.path == Path(choice["path"]) and settings.model.path.is_file()


@pytest.mark.unit
def test_an_int8_choice_in_a_temporary_folder_says_to_move_it() -> None:
    # The snippet's path pointed into /tmp: the service, with PrivateTmp=, then could not find it.
    chosen = {"engine": "onnxruntime", "precision": "int8", "path": "/tmp/edged-tune.x/m.int8.onnx"}
    moved = to_move(chosen)
    assert moved.startswith("/tmp/edged-tune.x/m.int8.onnx is in a temporary folder") and "PrivateTmp" in moved
    assert to_move({**chosen, "precision": "bf16"}) == "" and to_move(None) == ""
    assert f"# {moved}\n[model]" in snippet(chosen, "reason\n# " + moved)


def test_tune_refuses_to_write_over_the_configuration(tmp_path: Path) -> None:
    config = tmp_path / "edged.toml"
    config.write_text(CONFIG)
    done = run_cli("tune", "--config", str(config), "--out", str(config))
    assert done.returncode == EXIT_USAGE and "changes no configuration" in done.stderr
    assert config.read_text() == CONFIG


@pytest.mark.parametrize(("model", "what"), [("anomaly/padim.onnx", "an anomaly model"), ("tasks/cls.onnx", "a classifier")])
def test_tune_refuses_a_model_whose_boxes_it_cannot_compare_before_quantising(tmp_path: Path, model: str, what: str) -> None:
    # An anomaly model went on to be quantised, and failed inside onnxruntime with a TypeError.
    config = tmp_path / "edged.toml"
    config.write_text(f'[model]\npath = "{Path(__file__).parent / "data" / model}"\n')
    done = run_cli("tune", "--config", str(config), "--frames", "1")
    assert done.returncode == EXIT_USAGE and f"detection or segmentation model, not {what}" in done.stderr
    assert "quantising" not in done.stderr


def test_tune_judges_verdicts_as_the_configured_camera_does(tmp_path: Path) -> None:
    # config/segment-demo.toml gives the scale in its camera's [source.inspect] and the limits in
    # [inspect]: tune judged with [inspect] alone, the reference row failed on the missing scale,
    # and tune ended in an IndexError.
    seg = DEMO.parent / "demo-seg.onnx"
    camera = '[source]\ntype = "synthetic"\ncamera_id = "line"\n\n[source.inspect]\nmm_per_px = 0.05\n\n'
    config = tmp_path / "edged.toml"
    config.write_text(f'{camera}[model]\npath = "{seg}"\n\n[inspect]\nmax_area_mm2 = {{ spot = 1.0 }}\n')
    args = ("tune", "--config", str(config), "--frames", "2", "--max-images", "2", "--precision", "f32", "--json")
    done = run_cli(*args, "--engine", "onnxruntime")
    assert done.returncode == 0, done.stderr
    assert [row["verdicts_flipped"] for row in json.loads(done.stdout)["rows"]] == [0]
    unknown = run_cli(*args, "--camera", "nope")
    assert unknown.returncode == EXIT_USAGE and "--camera 'nope': the configuration's cameras are line" in unknown.stderr


def test_tune_with_labels_scores_each_variant_against_them(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    (tmp_path / "labels").mkdir()
    total, frames = scene_samples(2, 0, 640, 360)
    for i, sample in enumerate(frames):
        cv2.imwrite(str(tmp_path / "images" / f"{i}.png"), sample.image)
        h, w = sample.image.shape[:2]
        lines = [
            f"{c} {(x1 + x2) / 2 / w} {(y1 + y2) / 2 / h} {(x2 - x1) / w} {(y2 - y1) / h}"
            for (x1, y1, x2, y2), c in zip(sample.boxes.tolist(), sample.class_ids.tolist(), strict=True)
        ]
        (tmp_path / "labels" / f"{i}.txt").write_text("\n".join(lines) + "\n")
    config = tmp_path / "edged.toml"
    config.write_text(CONFIG)
    done = run_cli(
        "tune", "--config", str(config), "--images", str(tmp_path / "images"), "--labels", str(tmp_path / "labels"),
        "--frames", "3", "--warmup", "1", "--engine", "onnxruntime", "--precision", "f32", "--json",
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["accuracy_against"].startswith("labels under")
    (row,) = report["rows"]
    assert row["labels"]["n_images"] == total and row["map50"] == row["labels"]["map50"] > 0.5
    assert report["choice"]["precision"] == "f32"


def test_tune_refuses_an_engine_or_precision_it_does_not_know(tmp_path: Path) -> None:
    config = tmp_path / "edged.toml"
    config.write_text(CONFIG)
    done = run_cli("tune", "--config", str(config), "--precision", "f32,int4", "--frames", "1")
    assert done.returncode == EXIT_USAGE and "no engine or precision named int4" in done.stderr


@pytest.mark.parametrize(("content", "message"), [(b"not a model", "cannot load"), (None, "is not quantised")])
def test_tune_refuses_an_int8_model_it_cannot_run_before_timing_anything(
    tmp_path: Path, content: bytes | None, message: str
) -> None:
    config = tmp_path / "edged.toml"
    config.write_text(CONFIG)
    int8 = tmp_path / "int8.onnx"
    int8.write_bytes(DEMO.read_bytes() if content is None else content)  # None: a float model
    done = run_cli("tune", "--config", str(config), "--int8", str(int8), "--frames", "1", "--max-images", "1")
    assert done.returncode == EXIT_CONFIG and f"--int8 {int8}: " in done.stderr and message in done.stderr
    assert "running" not in done.stderr  # no variant was timed first


@pytest.mark.parametrize("labels", ["missing", "elsewhere"])
def test_tune_refuses_labels_that_label_none_of_the_images(tmp_path: Path, labels: str) -> None:
    # A --labels folder that does not exist, or holds no NAME.txt for any image, scored every image
    # as having no objects: an mAP of 0 against nothing, and a gate judged on it.
    (tmp_path / "images").mkdir()
    cv2.imwrite(str(tmp_path / "images" / "a.png"), np.zeros((48, 64, 3), np.uint8))
    (tmp_path / "elsewhere" / "labels").mkdir(parents=True)
    (tmp_path / "elsewhere" / "labels" / "a.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    config = tmp_path / "edged.toml"
    config.write_text(CONFIG)
    done = run_cli(
        "tune", "--config", str(config), "--images", str(tmp_path / "images"), "--labels", str(tmp_path / labels),
        "--frames", "1", "--warmup", "0", "--engine", "onnxruntime", "--precision", "f32",
    )  # fmt: skip
    assert done.returncode == EXIT_DATA, done.stderr
    assert str(tmp_path / labels) in done.stderr and "a.txt" in done.stderr


def test_tune_times_images_of_several_sizes_on_those_of_the_first_size(tmp_path: Path) -> None:
    # The full path plans for one frame size, as a camera has; the second size was rejected as a bad frame.
    (tmp_path / "images").mkdir()
    cv2.imwrite(str(tmp_path / "images" / "a.png"), np.zeros((96, 128, 3), np.uint8))
    cv2.imwrite(str(tmp_path / "images" / "b.png"), np.zeros((200, 100, 3), np.uint8))
    config = tmp_path / "edged.toml"
    config.write_text(CONFIG)
    done = run_cli(
        "tune", "--config", str(config), "--images", str(tmp_path / "images"),
        "--frames", "4", "--warmup", "1", "--engine", "onnxruntime", "--precision", "f32", "--json",
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)["rows"]
    assert row["agreement"]["images"] == 2
