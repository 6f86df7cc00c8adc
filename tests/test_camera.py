"""One camera's bookkeeping (`edged.camera.Camera`): how its rejected frames are counted and said."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from onnx_models import colour_probe

import edged.camera
from edged.camera import Camera
from edged.capture import Capture
from edged.config import ModelConfig, RuntimeConfig
from edged.lograte import LogRate
from edged.model import load_model
from edged.pipeline import FramePath, Rejected
from edged.settings.sources import ImagesSourceConfig
from edged.sources.base import Frame
from edged.sources.registry import open_source


class Clock:
    """The monotonic clock the camera's log limiter reads, moved by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(edged.camera, "LogRate", lambda interval_s: LogRate(interval_s, clock))
    return clock


@pytest.fixture
def folder(tmp_path: Path, clock: Clock) -> Camera:
    """An image folder's camera, its capture never started: only its bookkeeping runs, on ``clock``."""
    model = load_model(ModelConfig(path=colour_probe(tmp_path / "probe.onnx")), RuntimeConfig())
    cfg = ImagesSourceConfig(path=str(tmp_path))
    path = FramePath(model, cfg.camera_id, "bgr", sizes_vary=True)
    return Camera(cfg, Capture(lambda: open_source(cfg), cfg.camera_id), path, 0.0)


def rejected(frame_id: int, name: str) -> Rejected:
    """Frame ``frame_id``, read from file ``name``, rejected: too large for a segmentation model's masks
    (the detail names the file, as `edged.pipeline` says it) or outside the region (it does not)."""
    frame = Frame(np.zeros((8, 8, 3), np.uint8), frame_id, 0, 0, "bgr", name)
    if name.startswith("large"):
        return Rejected(frame, "bad_frame_size", f"{name}: model.max_masks = 40 would need 1.2 GiB of mask buffers")
    return Rejected(frame, "bad_frame_size", "the region [0, 0, 64, 64] is not inside the 8x8 frame")


def test_each_rejected_file_of_a_folder_is_named_once_at_most_one_line_per_interval(
    folder: Camera, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    # Only a camera's first rejected frame was logged: a second image too large for the masks was counted unnamed.
    caplog.set_level(logging.WARNING, logger="edged.camera")
    errors = LogRate(0.0)

    def said(frame_id: int, name: str) -> list[str]:
        caplog.clear()
        assert folder.reject(rejected(frame_id, name), errors) == 0
        return [r.getMessage() for r in caplog.records]

    assert said(0, "large-a.png") == [
        "camera cam0: frame 0 rejected (size): large-a.png: model.max_masks = 40 would need 1.2 GiB of mask buffers"
    ]
    assert said(1, "small-b.png") == []  # within the interval: counted, named later
    assert said(2, "large-a.png") == []
    clock.now = 10.0  # REJECT_LOG_INTERVAL_S on
    assert said(3, "large-a.png") == []  # named once
    assert said(4, "small-b.png") == [
        "camera cam0: frame 4 rejected (size): small-b.png: the region [0, 0, 64, 64] is not inside the 8x8 frame"
    ]
    assert said(5, "large-c.png") == []
    clock.now *= 2
    again = Camera(folder.cfg, folder.capture, folder.path, 0.0, previous=folder)  # a reload keeps what was said
    caplog.clear()
    again.reject(rejected(6, "small-b.png"), errors)
    again.reject(rejected(7, "large-c.png"), errors)
    assert [r.getMessage() for r in caplog.records] == [
        "camera cam0: frame 7 rejected (size): large-c.png: model.max_masks = 40 would need 1.2 GiB of mask buffers"
    ]
    assert again.stats.drops["bad_frame_size"] == 8
