"""At most one log line per interval: a failure that repeats every frame, or as often as a peer
likes, is one line per interval, and its counter carries the rest. A writer thread's failures
(`Failures`) are said once per burst instead: when it starts, and when a write succeeds again."""

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


class Failures:
    """A writer thread's failures (evidence, the journal): counted, the last one kept, and a burst of
    them said twice, when it starts and when it ends; ``previous`` (a writer a reload replaces) carries
    its count and last error on."""

    def __init__(self, previous: Failures | None = None) -> None:
        self.count: int = previous.count if previous else 0
        self.last: str | None = previous.last if previous else None
        self._failing = False

    def failed(self, what: str) -> bool:
        """Count a failure described by ``what``; True when it starts a burst, for the caller to log."""
        self.count += 1
        self.last = what
        started, self._failing = not self._failing, True
        return started

    def noted(self, what: str) -> None:
        """Count a failure already over as it is found (a journal edged opened anew), starting no burst."""
        self.count += 1
        self.last = what

    @property
    def failing(self) -> bool:
        """Within a burst: the last attempt failed."""
        return self._failing

    def succeeded(self) -> bool:
        """True when this success ends a burst, for the caller to log."""
        ended, self._failing = self._failing, False
        return ended
