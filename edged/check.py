"""``edged check``: everything `run` would refuse, found before the service starts.

It loads the model exactly as the daemon does (same contract checks, same head detection),
opens every camera through the capture thread the daemon uses and waits for its first frames
(the size, rate and colour order the camera really gives), runs a grey frame of that size and the
camera's first frame through the real pipeline (NaN or infinite outputs there mean a broken
model, scores above 1 a wrong normalisation or head), connects once to the MQTT broker when
``[mqtt]`` is set (refused, untrusted or absent is reported with its reason), and prints where
ONNX Runtime placed each node (`Engine.placement`).
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
from edged.mqtt import probe_broker
from edged.pipeline import FramePipeline, frame_path
from edged.preprocess import LETTERBOX_FILL
from edged.settings.sources import SourceBase, mask_credentials
from edged.sources.registry import open_source

FIRST_FRAME_TIMEOUT_S = 30.0  # longer than any camera's own open timeout: its error comes first
SETTLE_S = 0.5  # a network stream first hands over the frames buffered while it opened, all at once
RATE_WINDOW_S = 1.0  # then frames are counted this long to measure the rate


@dataclass(frozen=True, slots=True)
class SourceProbe:
    """What the camera delivered: the frame size, the rate measured over `RATE_WINDOW_S`, the channel order
    its source declares (frames carry no order of their own to measure), and a copy of its first frame."""

    width: int
    height: int
    fps: float
    channel_order: str
    frame: np.ndarray


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
        height, width, order, image = *frame.image.shape[:2], frame.channel_order, frame.image.copy()
        _take_for(capture, SETTLE_S)
        first = capture.stats().frames_captured
        elapsed = _take_for(capture, RATE_WINDOW_S)
        return SourceProbe(width, height, (capture.stats().frames_captured - first) / elapsed, order, image)
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
    print(
        f"colours    the model takes {model.contract.channel_order} (declared: its metadata or model.channel_order); "
        "each camera's frames are converted to it",
        file=out,
    )
    print(f"output     {outputs} -> {model.head} head, {model.num_classes} classes: {labels}", file=out)
    requested = ", ".join(p.name for p in settings.runtime.providers)
    print(f"providers  requested: {requested}", file=out)
    available = ", ".join(ort.get_available_providers())
    print(f"           available in this build (onnxruntime {ort.__version__}): {available}", file=out)
    print(f"           session uses: {', '.join(engine.session.get_providers())}", file=out)
    for warning in engine.provider_warnings:
        print(f"           warning: {warning}", file=out)
    print(f"threads    {engine.threads.summary}", file=out)
    if engine.threads.warning:
        print(f"           warning: {engine.threads.warning}", file=out)
    placement = engine.placement()
    total = sum(placement.nodes.values())
    for provider, count in sorted(placement.nodes.items(), key=lambda kv: -kv[1]):
        print(f"placement  {provider}: {count} of {total} nodes", file=out)
    print(f"           {placement.basis}", file=out)


def _first_run(plan: FramePipeline, what: str, image: np.ndarray) -> None:
    """Run ``image`` (named by ``what``) through the model; raise what the daemon would only count per frame."""
    try:
        detections, _ = plan.process(image)
    except InferenceError as e:  # in the daemon one frame; here the model failing its first frame
        raise ModelError(f"the model fails on {what}: {e}") from None
    if detections.nonfinite:
        raise ModelError(
            f"{what} gave {detections.nonfinite} NaN or infinite output value(s); a NaN score never passes "
            "the threshold, so edged would publish no detection at all: the model is broken, or overflows on "
            "this input (check an fp16 export, and model.scale, mean and std against how it was trained)"
        )
    if detections.scores_above_one:
        # A probability never exceeds 1: on the first frames this can only be the set-up.
        raise ContractError(
            f"{what} gave {detections.scores_above_one} score(s) above 1; "
            "scores must be probabilities: check model.scale, mean and std against how the model was "
            "trained, and that its head ends in a sigmoid"
        )


def _check_source(settings: Settings, model: LoadedModel, cfg: SourceBase, named: bool, out: TextIO) -> SourceError | None:
    """Open one camera and run its frames through the model; the camera's error, if it gave no frame."""
    frame_path(settings, model, cfg)  # [inspect] names classes the model must have
    name = f"{cfg.camera_id}: " if named else ""
    try:
        probe = probe_source(cfg)
    except SourceError as e:
        if not named:
            raise
        print(f"source     {name}{describe_source(cfg)}", file=out)
        print(f"           {e}", file=out)
        return e
    print(f"source     {name}{describe_source(cfg)}", file=out)
    print(
        f"           delivers {probe.width}x{probe.height} at {probe.fps:.1f} fps (measured), "
        f"channel order {probe.channel_order} (declared: source.channel_order)",
        file=out,
    )
    plan = FramePipeline(model, probe.width, probe.height, cfg.channel_order)
    grey = np.full((probe.height, probe.width, 3), LETTERBOX_FILL, np.uint8)
    first = f"the first frame of camera {cfg.camera_id}" if named else "the camera's first frame"
    for what, image in (("a plain grey frame", grey), (first, probe.frame)):
        _first_run(plan, what, image)
    return None


def run_check(config_path: Path | None, settings: Settings, out: TextIO = sys.stdout) -> int:
    """Every camera is opened and tried, one after the other, so that one missing camera does
    not hide another's problem; a model or contract problem stops at once (exit 78)."""
    print(f"config     {config_path}: valid", file=out)
    model = load_model(settings.model, settings.runtime, record_placement=True, lanes=settings.lanes())
    named = len(settings.source) > 1
    failed = [
        (cfg.camera_id, e) for cfg in settings.source if (e := _check_source(settings, model, cfg, named, out)) is not None
    ]
    if settings.mqtt is not None:
        print(f"mqtt       {probe_broker(settings.mqtt, settings.source[0].camera_id)}", file=out)
    _report(model, settings, out)
    if failed:
        names = ", ".join(name for name, _ in failed)
        raise SourceError(f"{len(failed)} of {len(settings.source)} cameras gave no frame ({names}): {failed[0][1]}")
    print("ok", file=out)
    return 0
