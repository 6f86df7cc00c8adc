"""SIGHUP: the configuration and model to switch to, tried on a real frame before they take over.

Nothing is switched here: the daemon applies what this returns once `Replacement.trial` has run
the new model and its plan on a frame from one of the new configuration's cameras, so a bad
config, a model that will not load, or one that loads but fails on the camera's frames leaves
the running daemon exactly as it was.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from edged.config import Settings, load_config
from edged.errors import ModelError
from edged.model import LoadedModel, load_model
from edged.pipeline import FramePath, Processed, Rejected, frame_path
from edged.sources import Frame

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Replacement:
    """A reloaded configuration, its model and a frame path per camera, on trial until a frame runs through it."""

    settings: Settings
    model: LoadedModel
    paths: dict[str, FramePath]  # by camera_id, one per camera of the new configuration

    def trial(self, camera_id: str, frame: Frame) -> Processed | Rejected | str:
        """``frame``, from camera ``camera_id``, through the new model: `Processed` when it works,
        the reason when the model fails on it (its warm-up or its run), `Rejected` when the frame
        itself is unfit and the next frame decides."""
        try:
            outcome = self.paths[camera_id].run(frame)
        except ModelError as e:
            return str(e)
        if isinstance(outcome, Rejected) and outcome.reason == "inference_error":
            return f"inference failed: {outcome.detail}"
        return outcome


def load_replacement(config_path: Path | None, running: Settings) -> Replacement:
    """The new settings with their loaded model; raises an EdgedError when either is unusable."""
    new = load_config(config_path)
    model = load_model(new.model, new.runtime, lanes=new.lanes())
    if new.publish != running.publish:
        # The bound socket keeps its endpoints and options, so the settings must say so too
        # (topics are built from them).
        log.warning("publish settings changed: restart edged to apply them")
        new = new.model_copy(update={"publish": running.publish})
    if new.trigger != running.trigger:
        # The request socket, like the PUB socket, stays bound as it is.
        log.warning("trigger settings changed: restart edged to apply them")
        new = new.model_copy(update={"trigger": running.trigger})
    return Replacement(new, model, {cfg.camera_id: frame_path(new, model, cfg) for cfg in new.source})
