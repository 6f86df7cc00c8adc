"""A frame's report as the outputs get it, for tests that hand an output its verdicts without a daemon."""

from __future__ import annotations

import time

import numpy as np

from edged.messages import Reason, VerdictMessage
from edged.model import LoadedModel
from edged.output import FrameReport
from edged.pipeline import FramePath, Processed
from edged.sources.base import Frame


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
