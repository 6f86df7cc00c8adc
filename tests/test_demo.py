"""The bundled demo: the trained defect model on the synthetic source, end to end against truth."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from daemon import RunningDaemon, free_port, run_cli, write_config

from edged.config import load_config
from edged.messages import DetectionsMessage
from edged.tools.metrics import box_iou
from edged.tools.scenes import CLASS_NAMES, SceneGenerator

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parent.parent
MODEL = ROOT / "models" / "demo.onnx"
SEED = 0  # held out from the demo model's training


def _matches_truth(msg: DetectionsMessage, generator: SceneGenerator) -> bool:
    """Every defect found with the right class at IoU >= 0.5, and nothing else reported."""
    truth = generator.render(msg.frame_id)
    boxes = np.array([d.box for d in msg.detections], np.float64).reshape(-1, 4)
    labels = [d.label for d in msg.detections]
    if len(boxes) != len(truth.boxes):
        return False
    if not len(boxes):
        return True
    ious = box_iou(truth.boxes.astype(np.float64), boxes)
    for i, class_id in enumerate(truth.class_ids):
        same_class = [j for j, label in enumerate(labels) if label == CLASS_NAMES[class_id]]
        if not same_class or ious[i, same_class].max() < 0.5:
            return False
    return True


def test_demo_config_is_valid_and_checks() -> None:
    settings = load_config(ROOT / "config" / "demo.toml")
    assert settings.model.path == MODEL.resolve()
    result = run_cli("check", "--config", str(ROOT / "config" / "demo.toml"))
    assert result.returncode == 0, result.stderr
    assert "3 classes: scratch, spot, crack" in result.stdout


def test_demo_model_finds_the_generated_defects_on_most_frames(tmp_path: Path) -> None:
    shutil.copy(MODEL, tmp_path / "demo.onnx")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "synthetic", "width": 1280, "height": 720, "fps": 8.0, "seed": SEED},
            "model": {"path": "demo.onnx"},
            "publish": {"endpoints": [endpoint]},
            "thermal": {"enabled": False},
        },
    )
    d = RunningDaemon(config, endpoint)
    try:
        messages = [m for m in d.collect("detections", 20, timeout=60) if isinstance(m, DetectionsMessage)]
    finally:
        d.close()
    generator = SceneGenerator(1280, 720, seed=SEED)
    matched = sum(_matches_truth(m, generator) for m in messages)
    assert matched >= 0.7 * len(messages), f"{matched} of {len(messages)} frames match the ground truth"
    assert any(m.detections for m in messages)
