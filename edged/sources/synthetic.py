"""Synthetic camera: rendered defect scenes with known ground truth, for tests and demos without hardware.

The stream is deterministic per (seed, frame index), so two runs with the same seed see the same
frames, and the scene generator gives the ground truth of any frame from its index alone.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Literal

import numpy as np

from edged.errors import SourceError
from edged.settings.sources import SyntheticSourceConfig

if TYPE_CHECKING:
    from edged.sources.scenes import SceneGenerator

log = logging.getLogger(__name__)


class SyntheticSource:
    """Renders scene ``index`` 0, 1, 2, ... at ``cfg.width`` x ``cfg.height``, paced at ``cfg.fps``."""

    def __init__(self, cfg: SyntheticSourceConfig) -> None:
        self._cfg = cfg
        self.channel_order: Literal["bgr", "rgb"] = cfg.channel_order
        self._generator: SceneGenerator | None = None
        self._index = 0  # the scene the next grab moves to
        self._grabbed: int | None = None

    def open(self) -> None:
        # Imported here: the scene painter is a demo and test tool that a real camera never loads.
        from edged.sources.scenes import SceneGenerator

        self._generator = SceneGenerator(width=self._cfg.width, height=self._cfg.height, seed=self._cfg.seed)
        log.info(
            "synthetic source %dx%d at %.1f fps, seed %d",
            self._cfg.width,
            self._cfg.height,
            self._cfg.fps,
            self._cfg.seed,
            extra={"CAMERA": self._cfg.camera_id},
        )

    def read(self, out: np.ndarray | None) -> np.ndarray:
        self.grab()
        return self.retrieve(out)

    def grab(self) -> bool:
        """Move to the next scene; rendering waits for `retrieve`, so a skipped scene costs nothing."""
        if self._generator is None:
            raise SourceError("synthetic source read before open()")
        self._grabbed = self._index
        self._index += 1
        return True

    def retrieve(self, out: np.ndarray | None) -> np.ndarray:
        if self._generator is None or self._grabbed is None:
            raise SourceError("synthetic source retrieved before open() and grab()")
        shape = (self._cfg.height, self._cfg.width, 3)
        fits = out is not None and out.shape == shape and out.dtype == np.uint8
        # Rendering straight into the caller's slot keeps the steady state allocation-free.
        return self._generator.render(self._grabbed, out=out if fits else None).image

    def pace(self) -> float:
        return 1.0 / self._cfg.fps

    def close(self) -> None:
        self._generator = None
