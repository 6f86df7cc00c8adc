"""At most one log line per interval: a failure that repeats every frame, or as often as a peer
likes, is one line per interval, and its counter carries the rest."""

from __future__ import annotations

import time
from collections.abc import Callable


class LogRate:
    """Whether a line may be logged now: the first time, then once ``interval_s`` has passed since
    the last line that was. One owner thread (it holds no lock)."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._next: float | None = None  # when the next line may go out; None: at once

    def allows(self) -> bool:
        """True when a line may go out now, which then counts as logged."""
        now = self._clock()
        if self._next is not None and now < self._next:
            return False
        self._next = now + self._interval_s
        return True
