"""Agreement of one model with another's boxes and verdicts, on real models through the daemon's pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest
from daemon import run_cli
from onnx_models import SCENE_LABELS, fixed_scene

from edged.config import ModelConfig, RuntimeConfig
from edged.model import LoadedModel, load_model
from edged.settings.inspect import InspectConfig
from edged.tools import quantize as q
from edged.tools.agreement import RANK_CONF, Flip, agreement, labelled
from edged.tools.evaluate import folder_samples, scene_samples

pytestmark = pytest.mark.tools

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo.onnx"
BOXES = [(20.0, 20.0, 12.0, 12.0, 0, 0.9), (44.0, 40.0, 10.0, 14.0, 1, 0.8)]


def _load(path: Path) -> LoadedModel:
    return load_model(ModelConfig(path=path, conf=RANK_CONF), RuntimeConfig(intra_op_threads=1))


def test_a_model_agrees_fully_with_itself_in_boxes_and_verdicts() -> None:
    model = _load(DEMO)
    _, frames = scene_samples(4, 0, 640, 360)
    result = agreement(model, model, frames, inspect=InspectConfig())
    assert result.images == 4 and result.reference_boxes > 0
    assert result.map50 >= 0.99 and result.map50_95 >= 0.99  # 0.995: yolo val's integration of a perfect ranking
    assert result.verdicts_agree == 1.0 and result.flipped == []


def test_swapped_classes_agree_in_no_box_and_flip_the_verdict(tmp_path: Path) -> None:
    reference = _load(fixed_scene(tmp_path / "ref.onnx", BOXES))
    swapped = _load(fixed_scene(tmp_path / "swapped.onnx", [(*b[:4], 2, b[5]) for b in BOXES]))
    _, frames = scene_samples(3, 0, 64, 64)
    ng_only = InspectConfig(ng_classes=[SCENE_LABELS[0], SCENE_LABELS[1]])
    result = agreement(reference, swapped, frames, inspect=ng_only)
    assert result.reference_boxes == 6
    assert result.map50 == 0.0 and result.verdicts_agree == 0.0
    assert result.flipped == [Flip(sample, "ng", "ok") for sample in ("scene 0:0", "scene 0:1", "scene 0:2")]
    assert result.to_dict()["flips"][0] == {"image": "scene 0:0", "reference": "ng", "candidate": "ok"}
    assert result.format().endswith("flipped on: scene 0:0 (ng -> ok), scene 0:1 (ng -> ok), scene 0:2 (ng -> ok)")
    _, frames = scene_samples(3, 0, 64, 64)
    assert agreement(reference, swapped, frames).verdicts_agree is None  # no [inspect]: no verdicts to compare


def test_the_quantize_comparison_on_a_folder_scores_agreement_and_labels(tmp_path: Path) -> None:
    total, frames = scene_samples(3, 0, 640, 360)
    (tmp_path / "images").mkdir()
    for sample in frames:
        name = sample.name.replace(" ", "_").replace(":", "_")
        cv2.imwrite(str(tmp_path / "images" / f"{name}.png"), sample.image)
    assert not labelled(tmp_path)
    model = _load(DEMO)
    unlabelled = q.compare({"fp32": model, "int8": model}, latency_frames=0, eval_scenes=0, eval_seed=0, data=tmp_path)
    assert unlabelled.agreement is not None and unlabelled.agreement.map50 >= 0.99 and unlabelled.accuracy == {}
    (tmp_path / "labels").mkdir()
    (tmp_path / "labels" / "scene_0_0.txt").write_text("0 0.5 0.5 0.1 0.1\n")
    assert labelled(tmp_path)
    c = q.compare(
        {"fp32": model, "int8": model},
        latency_frames=0,
        eval_scenes=0,
        eval_seed=0,
        data=tmp_path,
        inspect=InspectConfig(),
    )
    assert c.agreement is not None and c.agreement.verdicts_agree == 1.0
    assert set(c.accuracy) == {"fp32", "int8"} and c.accuracy["fp32"].n_images == total
    assert np.isclose(c.accuracy["fp32"].map50, c.accuracy["int8"].map50)
    assert "agreement with FP32's boxes on 3 image(s)" in q.format_comparison(c)
    assert folder_samples(tmp_path, model.num_classes)[0] == 3


def test_quantize_calibrates_and_compares_on_an_evidence_folder(tmp_path: Path) -> None:
    day = tmp_path / "evidence" / "cam0" / "2026-01-02"
    (day / "images").mkdir(parents=True)
    (day / "messages").mkdir()
    _, frames = scene_samples(4, 2, 640, 360)
    for i, sample in enumerate(frames):
        cv2.imwrite(str(day / "images" / f"cam0_{i}.jpg"), sample.image)
        (day / "messages" / f"cam0_{i}.json").write_text("{}")
    config = tmp_path / "edged.toml"
    config.write_text(f'[model]\npath = "{DEMO}"\n[inspect]\nng_classes = ["crack"]\n')
    report = tmp_path / "report.json"
    done = run_cli(
        "quantize",
        "--model", str(DEMO),
        "--out", str(tmp_path / "demo.int8.onnx"),
        "--calib-images", str(tmp_path / "evidence"),
        "--data", str(tmp_path / "evidence"),
        "--config", str(config),
        "--latency-frames", "0",
        "--report", str(report),
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "agreement with FP32's boxes on 4 image(s)" in done.stdout
    accuracy = json.loads(report.read_text())["accuracy"]
    assert accuracy["agreement"]["images"] == 4 and accuracy["agreement"]["verdicts_agree"] is not None
    assert accuracy["agreement"]["map50"] > 0.5  # INT8 keeps most of FP32's boxes
    assert "fp32" not in accuracy  # no label files: no labelled accuracy
