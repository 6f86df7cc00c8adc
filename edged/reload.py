"""SIGHUP: the configuration and model to switch to, or an error that keeps the running ones.

Nothing is switched here: the daemon applies what this returns, so a bad config or model leaves
the running daemon exactly as it was.
"""

from __future__ import annotations

import logging
from pathlib import Path

from edged.config import Settings, load_config
from edged.model import LoadedModel, load_model

log = logging.getLogger(__name__)


def load_replacement(config_path: Path | None, running: Settings) -> tuple[Settings, LoadedModel]:
    """The new settings and their loaded model; raises an EdgedError when either is unusable."""
    new = load_config(config_path)
    model = load_model(new.model, new.runtime)
    if new.publish != running.publish:
        # The bound socket keeps its endpoints and options, so the settings must say so too
        # (topics are built from them).
        log.warning("publish settings changed: restart edged to apply them")
        new = new.model_copy(update={"publish": running.publish})
    if new.trigger != running.trigger:
        # The request socket, like the PUB socket, stays bound as it is.
        log.warning("trigger settings changed: restart edged to apply them")
        new = new.model_copy(update={"trigger": running.trigger})
    return new, model
