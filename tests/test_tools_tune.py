"""``edged tune`` on the demo model: every variant through the full path, the gate, and the snippet it writes."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import onnx
import pytest
from daemon import edged_command, run_cli
from onnx import TensorProto, helper, numpy_helper

from edged.cli import SUBCOMMANDS
from edged.config import load_config
from edged.errors import EXIT_CONFIG, EXIT_DATA, EXIT_USAGE
from edged.tools import tune
from edged.tools.evaluate import EvalSample, scene_samples
from edged.tools.tune import Gate, _images, _judge, _split, _unused, format_table, snippet, to_move

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
        "accuracy_on": {"summary": "all 2 images: tune calibrated no INT8 model"},
        "rows": rows,
        "skipped": [],
        "choice": choice,
    }
    lines = format_table(report).splitlines()
    assert lines[2] == "accuracy judged on all 2 images: tune calibrated no INT8 model"
    assert lines[-3:] == ["openvino int8 flipped: scene029.png (ng -> ok)", "", "choice: onnxruntime f32 (m.onnx)"]


def test_tune_on_the_demo_model_writes_a_choice_that_passed_and_merges_into_the_config(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    _, frames = scene_samples(3, 0, 640, 360)
    for i, sample in enumerate(frames):
        cv2.imwrite(str(tmp_path / "images" / f"{i}.png"), sample.image)
    config = tmp_path / "edged.toml"
    config.write_text(CONFIG)
    snippet = tmp_path / "tuned.toml"
    # Someone's INT8 model where tune would write its own, which tune left as it was.
    (tmp_path / "cache").mkdir()
    theirs = tmp_path / "cache" / "demo.int8.onnx"
    theirs.write_bytes(b"an INT8 model, signed and calibrated on other images")
    done = subprocess.run(
        edged_command(
            "tune", "--config", str(config), "--images", "images", "--frames", "5", "--warmup", "2",
            "--engine", "onnxruntime", "--cache-dir", "cache", "--json", "--out", str(snippet),
        ),
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert theirs.read_bytes() == b"an INT8 model, signed and calibrated on other images"
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
    # The path is absolute: a relative --cache-dir, merged into a configuration elsewhere, named a file that was not there.
    assert Path(choice["path"]).is_absolute() and tomllib.loads(snippet.read_text())["model"]["path"] == choice["path"]
    made = tmp_path / "cache" / "demo.int8.2.onnx"
    assert made.exists() == (choice["precision"] == "int8")  # its own, removed unless chosen


@pytest.mark.unit
def test_an_int8_choice_in_a_temporary_folder_says_to_move_it() -> None:
    # The snippet's path pointed into /tmp: the service, with PrivateTmp=, then could not find it.
    chosen = {"engine": "onnxruntime", "precision": "int8", "path": "/tmp/edged-tune.x/m.int8.onnx"}
    made = Path(chosen["path"])
    moved = to_move(chosen, made)
    assert moved.startswith("/tmp/edged-tune.x/m.int8.onnx is in a temporary folder") and "PrivateTmp" in moved
    assert to_move({**chosen, "precision": "bf16", "path": str(DEMO)}, made) == "" and to_move(None, made) == ""
    assert f"# {moved}\n[model]" in snippet(chosen, "reason\n# " + moved)


@pytest.mark.unit
def test_an_int8_model_given_is_not_said_to_be_in_a_temporary_folder() -> None:
    # With --int8 and no cache folder, the user's own model was said to be in a temporary folder, to be moved.
    given = {"engine": "onnxruntime", "precision": "int8", "path": "/srv/models/demo.int8.onnx"}
    assert to_move(given, None) == ""
    assert to_move(given, Path("/tmp/edged-tune.x/demo.int8.onnx")) == ""


@pytest.mark.unit
def test_two_tunes_on_one_cache_folder_make_their_int8_models_under_two_names(tmp_path: Path) -> None:
    # Both took demo.int8.onnx: the one that did not choose it removed it under the one that did.
    first, second = _unused(tmp_path, "demo.int8"), _unused(tmp_path, "demo.int8")
    assert (first.name, second.name) == ("demo.int8.onnx", "demo.int8.2.onnx")
    assert first.is_file() and second.is_file()


def test_tune_refuses_to_write_over_the_configuration(tmp_path: Path) -> None:
    config = tmp_path / "edged.toml"
    config.write_text(CONFIG)
    done = run_cli("tune", "--config", str(config), "--out", str(config))
    assert done.returncode == EXIT_USAGE and "changes no configuration" in done.stderr
    assert config.read_text() == CONFIG


@pytest.mark.parametrize(("model", "what"), [("anomaly/padim.onnx", "an anomaly"), ("tasks/cls.onnx", "a classification")])
def test_tune_refuses_a_model_whose_boxes_it_cannot_compare_before_quantising(tmp_path: Path, model: str, what: str) -> None:
    # An anomaly model went on to be quantised, and failed inside onnxruntime with a TypeError. Then
    # it was refused as a usage error (exit 2), though no option makes tune serve it: the model must change.
    config = tmp_path / "edged.toml"
    path = Path(__file__).parent / "data" / model
    config.write_text(f'[model]\npath = "{path}"\n')
    done = run_cli("tune", "--config", str(config), "--frames", "1")
    assert done.returncode == EXIT_CONFIG, done.stderr
    assert f"model.path {path} is {what} model, and edged tune serves detection and segmentation models only" in done.stderr
    assert "give model.path a detection or segmentation model" in done.stderr and "quantising" not in done.stderr
    help_text = next(text for name, _, text, _ in SUBCOMMANDS if name == "tune")
    assert "a model other than a detection or segmentation model included" in help_text


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


@pytest.mark.parametrize(("option", "value", "named"), [("--precision", "f32,int4", "'int4'"), ("--engine", "", "''")])
def test_tune_refuses_an_engine_or_precision_it_does_not_know(tmp_path: Path, option: str, value: str, named: str) -> None:
    """Saying which are known: an empty name (``--engine ''``, a trailing comma) was said as nothing at all."""
    config = tmp_path / "edged.toml"
    config.write_text(CONFIG)
    done = run_cli("tune", "--config", str(config), option, value, "--frames", "1")
    assert done.returncode == EXIT_USAGE, done.stderr
    assert (
        f"no engine or precision named {named}: --engine takes onnxruntime,openvino or some of them, "
        "--precision f32,int8,bf16,f16 or some of them"
    ) in done.stderr, done.stderr


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
    assert "model.precision" not in done.stderr  # tune sets it, not the user: no advice to change it


def _with_quantised_input(src: Path, dst: Path) -> Path:
    """``src`` with its input through QuantizeLinear and DequantizeLinear: an INT8 model of its interface."""
    model = onnx.load(str(src))
    name = model.graph.input[0].name
    for node in model.graph.node:
        node.input[:] = ["dequantised" if t == name else t for t in node.input]
    model.graph.initializer.extend(
        [numpy_helper.from_array(np.array(1 / 255, np.float32), "qs"), numpy_helper.from_array(np.array(0, np.uint8), "qz")]
    )
    model.graph.node.insert(0, helper.make_node("DequantizeLinear", ["quantised", "qs", "qz"], ["dequantised"]))
    model.graph.node.insert(0, helper.make_node("QuantizeLinear", [name, "qs", "qz"], ["quantised"]))
    onnx.save(model, str(dst))
    return dst


@pytest.mark.parametrize(("source", "refused"), [("demo-seg.onnx", True), ("demo.onnx", False)])
def test_tune_refuses_an_int8_copy_of_another_model(tmp_path: Path, source: str, refused: bool) -> None:
    # The segmentation model's INT8 copy, given for the detector, was timed, judged and chosen.
    config = tmp_path / "edged.toml"
    config.write_text(CONFIG)
    int8 = _with_quantised_input(DEMO.parent / source, tmp_path / "int8.onnx")
    done = run_cli(
        "tune", "--config", str(config), "--int8", str(int8), "--frames", "1", "--warmup", "0", "--max-images", "1",
        "--engine", "onnxruntime", "--precision", "int8", timeout=300,
    )  # fmt: skip
    if refused:
        assert done.returncode == EXIT_CONFIG, done.stderr
        assert f"--int8 {int8} is not an INT8 copy of model.path {DEMO}: its task segment against detect" in done.stderr
        assert "running" not in done.stderr
    else:
        assert done.returncode == 0, done.stderr


def test_tune_warns_when_it_calibrates_on_a_few_images(tmp_path: Path) -> None:
    config = tmp_path / "edged.toml"
    config.write_text(CONFIG)
    done = run_cli(
        "tune", "--config", str(config), "--max-images", "2", "--frames", "1", "--warmup", "0",
        "--engine", "onnxruntime", "--precision", "int8", "--cache-dir", str(tmp_path / "cache"), timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "warning: calibrating on 2 frame(s), fewer than 8" in done.stderr


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


def test_tune_warns_when_fp32_finds_no_box_to_compare(tmp_path: Path) -> None:
    # Every variant scored mAP 1.000 for finding nothing too, and the fastest was chosen on no evidence.
    (tmp_path / "images").mkdir()
    cv2.imwrite(str(tmp_path / "images" / "a.png"), np.zeros((96, 128, 3), np.uint8))
    config = tmp_path / "edged.toml"
    config.write_text(CONFIG)
    done = run_cli(
        "tune", "--config", str(config), "--images", str(tmp_path / "images"), "--frames", "1", "--warmup", "0",
        "--engine", "onnxruntime", "--precision", "f32", timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "warning: FP32 found no box on 1 images under" in done.stderr and "the gate compared no box" in done.stderr


@pytest.mark.unit
def test_tune_holds_no_more_images_than_its_memory_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # --max-images over a folder of camera frames held every one of them in memory, gigabytes on a 4 GB board.
    for i in range(4):
        cv2.imwrite(str(tmp_path / f"{i}.png"), np.full((48, 64, 3), i, np.uint8))
    monkeypatch.setattr(tune, "HELD_BYTES", 2 * 48 * 64 * 3)
    log = io.StringIO()
    data, samples = _images(tmp_path, None, 10, 3, log)
    assert [s.name for s in samples] == ["0.png", "1.png"] and data == f"2 images under {tmp_path}"
    assert "the first 2 of 4 fill 0 MiB: the other 2 are left out (--max-images 2)" in log.getvalue()


def _qdq_model(path: Path) -> Path:
    """A quantised model: a tensor through QuantizeLinear and back."""
    scale, zero = (
        numpy_helper.from_array(np.array(0.1, np.float32), "s"),
        numpy_helper.from_array(np.array(0, np.uint8), "z"),
    )
    graph = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
        ],
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 32, 32])],
        [scale, zero],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return path


def test_tune_refuses_a_quantised_model_as_the_fp32_reference(tmp_path: Path) -> None:
    # Its row was called f32, its boxes "FP32's own", and it was quantised again into a model that did not load.
    model = _qdq_model(tmp_path / "demo.int8.onnx")
    config = tmp_path / "edged.toml"
    config.write_text(f'[model]\npath = "{model}"\nprecision = "int8"\n')
    done = run_cli("tune", "--config", str(config), "--frames", "1")
    assert done.returncode == EXIT_USAGE and "is quantised" in done.stderr and "give this one as --int8" in done.stderr


@pytest.mark.parametrize("target", ["model", "labels"])
def test_tune_refuses_to_write_its_snippet_over_the_model_or_its_labels(tmp_path: Path, target: str) -> None:
    # --out over the configured model turned a 3.4 MB model into a snippet naming itself.
    model, labels = tmp_path / "demo.onnx", tmp_path / "demo.labels"
    model.write_bytes(DEMO.read_bytes())
    labels.write_text("scratch\nspot\ncrack\n")
    config = tmp_path / "edged.toml"
    config.write_text(f'[model]\npath = "{model}"\nlabels = "{labels}"\n')
    target_path = model if target == "model" else labels
    before = target_path.read_bytes()
    done = run_cli("tune", "--config", str(config), "--out", str(target_path), "--frames", "1")
    assert done.returncode == EXIT_USAGE and "writing it would destroy it" in done.stderr, done.stderr
    assert target_path.read_bytes() == before


def test_tune_refuses_an_inspection_naming_a_class_the_model_lacks_before_quantising(tmp_path: Path) -> None:
    config = tmp_path / "edged.toml"
    config.write_text(f'[model]\npath = "{DEMO}"\n\n[inspect]\nng_classes = ["dent"]\n')
    done = run_cli("tune", "--config", str(config), "--frames", "1")
    assert done.returncode == EXIT_CONFIG and "'dent'" in done.stderr, done.stderr
    assert "quantising" not in done.stderr


def test_tune_refuses_generated_scenes_for_a_model_of_other_classes(tmp_path: Path) -> None:
    # Its FP32 rows found nothing of their own classes there, so every variant "agreed" with them.
    config = tmp_path / "edged.toml"
    config.write_text(f'[model]\npath = "{Path(__file__).parent / "data" / "tasks" / "seg.onnx"}"\n')
    done = run_cli("tune", "--config", str(config), "--frames", "1")
    assert done.returncode == EXIT_USAGE and "scratch, dent, stain" in done.stderr and "--images DIR" in done.stderr


def test_a_tune_that_fails_leaves_no_temporary_folder(tmp_path: Path) -> None:
    # The folder tune quantises into when told nowhere was made, then left, whatever stopped it.
    (tmp_path / "images").mkdir()
    cv2.imwrite(str(tmp_path / "images" / "a.png"), np.zeros((48, 64, 3), np.uint8))
    (tmp_path / "images" / "a.txt").write_text("0 nan 0.5 0.2 0.2\n")
    (tmp_path / "tmp").mkdir()
    config = tmp_path / "edged.toml"
    config.write_text(CONFIG)
    done = run_cli(
        "tune", "--config", str(config), "--images", str(tmp_path / "images"), "--labels", str(tmp_path / "images"),
        "--frames", "1", env={"TMPDIR": str(tmp_path / "tmp")},
    )  # fmt: skip
    assert done.returncode == EXIT_DATA and "coordinates are fractions" in done.stderr, done.stderr
    assert {path.name for path in (tmp_path / "tmp").iterdir()} - {".ses"} == set()


def test_a_tune_stopped_while_it_quantises_leaves_no_temporary_folder(tmp_path: Path) -> None:
    (tmp_path / "tmp").mkdir()
    config = tmp_path / "edged.toml"
    config.write_text(CONFIG)
    command = edged_command("tune", "--config", str(config), "--max-images", "50", "--engine", "onnxruntime")
    with subprocess.Popen(command, stderr=subprocess.PIPE, env={**os.environ, "TMPDIR": str(tmp_path / "tmp")}) as proc:
        assert proc.stderr is not None
        said = b""
        while b"/50 images" not in said:  # calibrating into the temporary folder
            chunk = proc.stderr.read1(4096)
            assert chunk, said.decode()
            said += chunk
        proc.send_signal(signal.SIGTERM)
        said += proc.stderr.read()
        assert proc.wait(timeout=60) == 143, said.decode()
    assert {path.name for path in (tmp_path / "tmp").iterdir()} - {".ses"} == set()  # onnxruntime's own session id


def _folder(folder: Path, count: int) -> Path:
    """``count`` small images, named so that their sorted order is their number."""
    folder.mkdir()
    for i in range(count):
        cv2.imwrite(str(folder / f"{i:02}.png"), np.full((48, 64, 3), 10 * i, np.uint8))
    return folder


def _tune_json(tmp_path: Path, images: Path, *more: str) -> tuple[dict[str, Any], str]:
    """tune's report on ``images``, its INT8 model made in the test's folder (the choice stays there)."""
    config = tmp_path / "edged.toml"
    config.write_text(CONFIG)
    done = run_cli(
        "tune", "--config", str(config), "--images", str(images), "--frames", "1", "--warmup", "0",
        "--engine", "onnxruntime", "--precision", "int8", "--max-images", "40", "--json",
        "--cache-dir", str(tmp_path / "cache"), *more, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report, done.stderr


@pytest.mark.unit
def test_tune_splits_the_images_it_quantises_on_into_calibrated_and_judged() -> None:
    samples = [EvalSample(f"{i:02}.png", np.zeros((1, 1, 3), np.uint8), np.zeros((0, 4)), np.zeros(0)) for i in range(17)]
    split = _split(samples, quantising=True, scenes=False)
    assert [s.name for s in split.calibration or []] == [f"{i:02}.png" for i in range(0, 17, 2)]
    assert [s.name for s in split.judged] == [f"{i:02}.png" for i in range(1, 17, 2)] and split.held_out
    few = _split(samples[:15], quantising=True, scenes=False)  # halves of 7 and 8: below quantize's warning
    assert few.judged == few.calibration == samples[:15] and few.held_out is False
    assert _split(samples, quantising=False, scenes=False) == tune.Split(samples, None, None)  # --int8, or no int8 row
    assert _split(samples, quantising=True, scenes=True) == tune.Split(samples, None, True)  # calibrated on seed 1


def test_tune_judges_the_int8_model_it_makes_on_images_it_was_not_calibrated_on(tmp_path: Path) -> None:
    # Calibrated on the very images it was then judged on, INT8 passed a gate that new parts would fail.
    report, said = _tune_json(tmp_path, _folder(tmp_path / "images", 16))
    assert [row["agreement"]["images"] for row in report["rows"]] == [8, 8]  # every row on the same judged 8
    accuracy = report["accuracy_on"]
    calibrated, judged = accuracy["calibrated_on"]["names"], accuracy["names"]
    assert calibrated == [f"{i:02}.png" for i in range(0, 16, 2)] and judged == [f"{i:02}.png" for i in range(1, 16, 2)]
    assert accuracy["held_out"] is True and (accuracy["images"], accuracy["calibrated_on"]["images"]) == (8, 8)
    assert accuracy["summary"].startswith(f"8 of the 16 images under {tmp_path / 'images'}, every other one by name")
    assert "calibrated on 8 frames, the other 8 held out to judge accuracy" in said and "too few" not in said


def test_tune_says_when_too_few_images_leave_it_judging_on_its_calibration_images(tmp_path: Path) -> None:
    report, said = _tune_json(tmp_path, _folder(tmp_path / "images", 4))
    accuracy = report["accuracy_on"]
    names = [f"{i:02}.png" for i in range(4)]
    assert accuracy["held_out"] is False and accuracy["names"] == accuracy["calibrated_on"]["names"] == names
    assert [row["agreement"]["images"] for row in report["rows"]] == [4, 4]
    assert "the very ones the INT8 model calibrated on: too few to hold some out (16 or more" in accuracy["summary"]
    assert "warning: 4 image(s) are too few to calibrate the INT8 model on some and judge it on others" in said


def test_tune_judges_a_given_int8_model_on_every_image(tmp_path: Path) -> None:
    int8 = _with_quantised_input(DEMO, tmp_path / "int8.onnx")  # calibrated elsewhere: nothing to hold out
    report, said = _tune_json(tmp_path, _folder(tmp_path / "images", 16), "--int8", str(int8))
    accuracy = report["accuracy_on"]
    assert accuracy["names"] == [f"{i:02}.png" for i in range(16)] and accuracy["images"] == 16
    assert accuracy["held_out"] is None and accuracy["calibrated_on"] is None and "quantising" not in said
    assert [row["agreement"]["images"] for row in report["rows"]] == [16, 16]
    assert accuracy["summary"] == f"all 16 images under {tmp_path / 'images'}: tune calibrated no INT8 model"
