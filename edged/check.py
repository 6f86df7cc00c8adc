"""``edged check``: everything `run` would refuse, found before the service starts.

It loads the model exactly as the daemon does (same contract checks, same head detection),
opens the camera through the capture thread the daemon uses and waits for its first frames (the
size, rate and colour order the camera really gives), runs one inference on a grey frame of that
size through the real pipeline (scores above 1 there mean the normalisation or the head is
wrong), and prints where ONNX Runtime placed each node, from ORT's own assignment record.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np
import onnxruntime as ort

from edged.capture import Capture
from edged.config import Settings
from edged.errors import ContractError, InferenceError, ModelError, SourceError
from edged.model import LoadedModel, load_model
from edged.pipeline import FramePipeline, frame_path
from edged.preprocess import LETTERBOX_FILL
from edged.sources import open_source
from edged.sources.base import SourceBase, mask_credentials

FIRST_FRAME_TIMEOUT_S = 30.0  # longer than any camera's own open timeout: its error comes first
SETTLE_S = 0.5  # a network stream first hands over the frames buffered while it opened, all at once
RATE_WINDOW_S = 1.0  # then frames are counted this long to measure the rate


@dataclass(frozen=True, slots=True)
class SourceProbe:
    """What the camera delivered: the frame size, the rate measured over `RATE_WINDOW_S`, the channel order."""

    width: int
    height: int
    fps: float
    channel_order: str


def describe_source(cfg: SourceBase) -> str:
    """The kind and its own keys, credentials masked: how a source is named to the operator."""
    keys = " ".join(f"{key}={value}" for key, value in cfg.model_dump().items() if key not in SourceBase.model_fields)
    return mask_credentials(f"{cfg.type} {keys}".strip())


def probe_source(cfg: SourceBase, timeout_s: float = FIRST_FRAME_TIMEOUT_S) -> SourceProbe:
    """Open the camera as the daemon does and measure its first frames; ``SourceError`` with its reason when it cannot."""
    capture = Capture(lambda: open_source(cfg), cfg.camera_id, decode_all=True)
    capture.start()
    try:
        deadline = time.monotonic() + timeout_s
        while (frame := capture.take(0.05)) is None:
            if capture.fatal is not None:
                raise capture.fatal
            stats = capture.stats()
            if stats.state in ("lost", "ended") or time.monotonic() > deadline:
                reason = stats.last_error or ("it ended" if stats.state == "ended" else f"none in {timeout_s:g} s")
                raise SourceError(f"camera {describe_source(cfg)} gave no frame: {reason}")
        height, width, order = *frame.image.shape[:2], frame.channel_order
        _take_for(capture, SETTLE_S)
        first = capture.stats().frames_captured
        elapsed = _take_for(capture, RATE_WINDOW_S)
        return SourceProbe(width, height, (capture.stats().frames_captured - first) / elapsed, order)
    finally:
        capture.stop()


def _take_for(capture: Capture, seconds: float) -> float:
    """Take frames as the daemon would for ``seconds``; the time it really took."""
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < seconds:
        capture.take(seconds - elapsed)
    return elapsed


def _report(model: LoadedModel, settings: Settings, out: TextIO) -> None:
    engine = model.engine
    outputs = ", ".join(f"{o.name} {o.shape}" for o in engine.session.get_outputs())
    labels = ", ".join(model.labels) if model.labels else "(no names: class ids only)"
    print(f"model      {engine.model_path} ({engine.identity.short})", file=out)
    print(f"input      {model.contract.describe()}", file=out)
    print(f"output     {outputs} -> {model.head} head, {model.num_classes} classes: {labels}", file=out)
    requested = ", ".join(p.name for p in settings.runtime.providers)
    print(f"providers  requested: {requested}", file=out)
    print(f"           available in this build: {', '.join(ort.get_available_providers())}", file=out)
    print(f"           session uses: {', '.join(engine.session.get_providers())}", file=out)
    for warning in engine.provider_warnings:
        print(f"           warning: {warning}", file=out)
    print(f"threads    {engine.threads.summary}", file=out)
    if engine.threads.warning:
        print(f"           warning: {engine.threads.warning}", file=out)
    placement = engine.placement()
    total = sum(placement.values())
    for provider, count in sorted(placement.items(), key=lambda kv: -kv[1]):
        print(f"placement  {provider}: {count} of {total} nodes", file=out)


def run_check(config_path: Path | None, settings: Settings, out: TextIO = sys.stdout) -> int:
    print(f"config     {config_path}: valid", file=out)
    model = load_model(settings.model, settings.runtime, record_placement=True)
    frame_path(settings, model)  # [inspect] names classes the model must have
    probe = probe_source(settings.source)
    print(f"source     {describe_source(settings.source)}", file=out)
    print(f"           delivers {probe.width}x{probe.height} at {probe.fps:.1f} fps, {probe.channel_order}", file=out)
    plan = FramePipeline(model, probe.width, probe.height, settings.source.channel_order)
    try:
        detections, _ = plan.process(np.full((probe.height, probe.width, 3), LETTERBOX_FILL, np.uint8))
    except InferenceError as e:  # in the daemon one frame; here the model failing its first frame
        raise ModelError(f"the model fails on a frame: {e}") from None
    if detections.scores_above_one:
        # A probability never exceeds 1: on a plain grey frame this can only be the set-up.
        raise ContractError(
            f"a plain grey frame gave {detections.scores_above_one} score(s) above 1; "
            "scores must be probabilities: check model.scale, mean and std against how the model was "
            "trained, and that its head ends in a sigmoid"
        )
    _report(model, settings, out)
    print("ok", file=out)
    return 0
