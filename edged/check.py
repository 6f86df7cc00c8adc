"""``edged check``: everything `run` would refuse, found before the service starts.

It loads the model exactly as the daemon does (same contract checks, same head detection),
runs one inference on a grey frame through the real pipeline (scores above 1 there mean the
normalisation or the head is wrong), and prints where ONNX Runtime placed each node, from ORT's
own assignment record.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

import numpy as np
import onnxruntime as ort

from edged.config import Settings
from edged.errors import ContractError, InferenceError, ModelError
from edged.model import LoadedModel, load_model
from edged.pipeline import FramePipeline
from edged.preprocess import LETTERBOX_FILL


def _frame_size(settings: Settings) -> tuple[int, int]:
    src = settings.source
    width, height = getattr(src, "width", 1280), getattr(src, "height", 720)
    return int(width), int(height)


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
    width, height = _frame_size(settings)
    plan = FramePipeline(model, width, height, settings.source.channel_order)
    try:
        detections, _ = plan.process(np.full((height, width, 3), LETTERBOX_FILL, np.uint8))
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
