"""The frame-rate cap: ``service.max_fps``, lowered by the thermal state's rate factor.

While the board is warm or throttled the cap is the thermal factor times the full rate: the
configured ``max_fps``, else the rate the camera delivers. The camera's rate is measured from the
capture thread's frame count, which keeps counting at the camera's pace however few frames the
loop processes, so it measures the full rate even while the loop is capped.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# The camera's rate is re-measured over at least this long. Counting frames over a window is off by
# the frames at its edges, and by one more where a looping file restarts: up to 3 frames, 30 % of a
# 20 fps camera's rate over half a second (a warm board's cap of 10 fps became 13), under 8 % here.
MEASURE_EVERY_NS = 2_000_000_000


class RateCap:
    """The current cap in frames per second (None: uncapped), updated between frames."""

    def __init__(self, max_fps: float, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self._max_fps = max_fps
        self._clock = clock
        self._mark = (clock(), 0)
        self.source_fps = 0.0
        self.fps: float | None = max_fps or None

    def update(self, frames_captured: int, rate_factor: float) -> float | None:
        """Re-measure the camera's rate and apply the thermal ``rate_factor`` (1.0: no throttling)."""
        now = self._clock()
        then, before = self._mark
        if now - then > MEASURE_EVERY_NS:
            self.source_fps = (frames_captured - before) * 1e9 / (now - then)
            self._mark = (now, frames_captured)
        full = self._max_fps or self.source_fps
        self.fps = full * rate_factor if rate_factor < 1.0 and full > 0 else self._max_fps or None
        return self.fps

    def wait_s(self, started_s: float, now_s: float) -> float:
        """How long to wait before the next frame, for a frame that started at ``started_s``."""
        return max(0.0, started_s + 1.0 / self.fps - now_s) if self.fps else 0.0
