"""A frame's report as the outputs get it, and a configuration to make outputs from, for tests that
hand outputs their verdicts without a daemon."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from onnx_models import fixed_scene
from test_trigger import SCENE

from edged.messages import Reason, VerdictMessage
from edged.model import LoadedModel
from edged.output import FrameReport
from edged.pipeline import FramePath, Processed
from edged.sources.base import Frame


def inspecting(tmp_path: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """Camera cam0 (synthetic, 128x96) inspected for cracks by the SCENE model, written to
    ``tmp_path``, its journal and ZeroMQ endpoint there, no live view; with ``sections`` added."""
    fixed_scene(tmp_path / "model.onnx", SCENE)
    return {
        "source": {"type": "synthetic", "camera_id": "cam0", "width": 128, "height": 96},
        "model": {"path": "model.onnx"},
        "inspect": {"ng_classes": ["crack"]},
        "journal": {"path": str(tmp_path / "journal.db")},
        "publish": {"endpoints": [f"ipc://{tmp_path / 'detections.sock'}"]},
        "http": {"listen": ""},
        **sections,
    }


def ng_report(model: LoadedModel, camera_id: str, seq: int) -> FrameReport:
    """Camera ``camera_id``'s frame ``seq`` run through ``model``, with an NG verdict (a crack) of that seq."""
    frame = Frame(np.zeros((96, 128, 3), np.uint8), seq, time.monotonic_ns(), time.time_ns(), "bgr")
    done = FramePath(model, camera_id, "bgr").run(frame)
    assert isinstance(done, Processed)
    verdict = VerdictMessage(
        camera_id=camera_id,
        seq=seq,
        frame_id=seq,
        capture_time_ns=frame.t_wall_ns,
        part_id=None,
        verdict="ng",
        reasons=[Reason(detection=0, class_id=1, label="crack", score=0.5, zone=None)],
        verdict_latency_ms=1,
    )
    return FrameReport(camera_id, done, True, verdict=verdict, verdict_payload=verdict.model_dump_json().encode())
