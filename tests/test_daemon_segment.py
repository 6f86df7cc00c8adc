"""A segmentation model on the running daemon: outlines and sizes over ZeroMQ, evidence as segmentation labels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from daemon import RunningDaemon, free_port, images_config

from edged.messages import DetectionsMessage

pytestmark = pytest.mark.integration

DATA = Path(__file__).parent / "data" / "tasks"
REFERENCE = np.load(DATA / "seg.npz")


def test_a_segmentation_model_publishes_outlines_in_mm_and_saves_polygon_labels(tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = images_config(
        tmp_path,
        DATA / "seg.onnx",
        [DATA / "tall.png"],
        endpoint,
        model={"iou": 0.7, "max_det": 300},
        inspect={"mm_per_px": 0.5},
        evidence={"dir": "evidence", "save": "ng"},
    )
    d = RunningDaemon(config, endpoint)
    try:
        msg = next(m for m in d.collect("detections", 1) if isinstance(m, DetectionsMessage))
        assert msg.task == "segment" and msg.verdict == "ng"
        assert [x.class_id for x in msg.detections] == REFERENCE["tall/cls"].tolist()
        for i, found in enumerate(msg.detections):
            expected = REFERENCE[f"tall/polygon{i}"]
            assert found.polygon is not None and np.allclose(found.polygon, expected, atol=0.5)
            assert found.area_px is not None and found.area_mm2 == pytest.approx(found.area_px * 0.25, abs=1e-2)
        d.wait_status(lambda s: s.evidence is not None and s.evidence.saved >= 1)
        label = next((tmp_path / "evidence").rglob("labels/*.txt")).read_text().splitlines()
        assert len(label) == len(msg.detections)
        first = [float(v) for v in label[0].split()]
        assert first[0] == msg.detections[0].class_id and len(first) == 1 + 2 * len(msg.detections[0].polygon or [])
    finally:
        d.stop()
