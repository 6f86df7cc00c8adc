"""A classification model on the running daemon: its classes and verdicts over ZeroMQ, its evidence by class."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest
from daemon import RunningDaemon, free_port, images_config, run_cli, write_config

from edged.messages import DetectionsMessage, VerdictMessage

pytestmark = pytest.mark.integration

DATA = Path(__file__).parent / "data" / "tasks"
REFERENCE = json.loads((DATA / "cls.json").read_text())


def test_a_classifier_publishes_its_top_classes_and_verdicts_and_files_its_evidence_by_class(tmp_path: Path) -> None:
    # wide.png: crack 0.80 (an NG class, above 0.5): ng; square.png: scratch 0.42, below min_confidence: uncertain.
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = images_config(
        tmp_path,
        DATA / "cls.onnx",
        [DATA / "square.png", DATA / "wide.png"],
        endpoint,
        source={"fps": 20},
        model={"top_k": 3},
        inspect={"ng_classes": ["crack"], "min_confidence": 0.5},
        evidence={"dir": "evidence", "save": "ng"},
    )
    d = RunningDaemon(config, endpoint)
    try:
        seen: dict[str, DetectionsMessage] = {}
        verdicts: set[str] = set()
        for msg in d.messages(30):
            if isinstance(msg, DetectionsMessage) and msg.source_file:
                seen[msg.source_file] = msg
            elif isinstance(msg, VerdictMessage):
                verdicts.add(msg.verdict)
            if len(seen) == 2 and verdicts == {"ng", "uncertain"}:
                break
        assert set(seen) == {"square.png", "wide.png"} and verdicts == {"ng", "uncertain"}, d.log()
        for name, verdict in (("wide", "ng"), ("square", "uncertain")):
            msg = seen[f"{name}.png"]
            expected = REFERENCE["frames"][name]
            assert (msg.task, msg.detections, msg.verdict) == ("classify", [], verdict)
            assert msg.top is not None and [t.class_id for t in msg.top] == expected["top5"][:3]
            assert [t.score for t in msg.top] == pytest.approx(
                [expected["probs"][c] for c in expected["top5"][:3]], abs=2e-4
            )
            assert [r.label for r in msg.reasons] == [msg.top[0].label]
        d.wait_status(lambda s: s.evidence is not None and s.evidence.saved >= 2)
        filed = {p.parent.name for p in (tmp_path / "evidence").rglob("images/*/*.jpg")}
        assert filed == {"crack", "scratch"}
        assert not list((tmp_path / "evidence").rglob("labels/*.txt"))
    finally:
        d.stop()


def test_an_uncertain_part_is_ng_on_the_triggers_exit_code(tmp_path: Path) -> None:
    # square.png: scratch 0.42, below min_confidence 0.5: uncertain, which the reject line takes as NG (exit 3).
    (tmp_path / "frames").mkdir()
    shutil.copy(DATA / "square.png", tmp_path / "frames" / "square.png")
    shutil.copy(DATA / "cls.onnx", tmp_path / "cls.onnx")
    endpoint, trigger = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "images", "path": "frames", "fps": 4},
            "model": {"path": "cls.onnx"},
            "inspect": {"ng_classes": ["crack"], "min_confidence": 0.5},
            "publish": {"endpoints": [endpoint], "status_interval_s": 0.25},
            "thermal": {"enabled": False},
            "trigger": {"mode": "request", "endpoint": trigger, "timeout_s": 2.0},
        },
    )
    d = RunningDaemon(config, endpoint)
    try:
        d.wait_status(lambda s: s.capture is not None and s.capture.frames_captured >= 1, timeout=30)
        result = run_cli("trigger", trigger, "--part-id", "U-1", "--timeout", "10")
        assert result.returncode == 3, result.stderr
        assert "UNCERTAIN: scratch 0.42" in result.stdout
    finally:
        d.stop()


def test_a_classifier_with_a_roi_saves_the_region_it_classified_as_its_evidence(tmp_path: Path) -> None:
    # wide.png is 320x240; the region [40, 30, 220, 200] classifies as crack 0.83 (NG): a 180x170 image under crack/.
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = images_config(
        tmp_path,
        DATA / "cls.onnx",
        [DATA / "wide.png"],
        endpoint,
        inspect={"ng_classes": ["crack"], "roi": REFERENCE["roi"]},
        evidence={"dir": "evidence", "save": "ng"},
    )
    d = RunningDaemon(config, endpoint)
    try:
        d.wait_status(lambda s: s.evidence is not None and s.evidence.saved >= 1, timeout=30)
    finally:
        d.stop()
    images = list((tmp_path / "evidence").rglob("images/crack/*.jpg"))
    assert images, d.log()
    image = cv2.imread(str(images[0]))
    expected = cv2.imread(str(DATA / "wide.png"))[30:200, 40:220]
    assert image.shape == expected.shape == (170, 180, 3)
    assert np.abs(image.astype(np.int16) - expected).mean() < 4  # the region, through JPEG
