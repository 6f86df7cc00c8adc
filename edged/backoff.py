"""Capped exponential backoff with jitter: how the camera and the broker connection are retried."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

JITTER = 0.25  # a backoff delay is shortened by up to this fraction, so boards and cameras do not retry in step


@dataclass(frozen=True, slots=True)
class Backoff:
    """Capped exponential backoff: ``initial_s`` doubling per failure up to ``max_s``, less up to `JITTER`."""

    initial_s: float
    max_s: float
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"need 0 < backoff_initial_s <= backoff_max_s, got {self.initial_s} and {self.max_s}")

    def delay_s(self, failures: int) -> float:
        """The wait before the next attempt after ``failures`` (>= 1) failed ones in a row."""
        base = min(self.max_s, self.initial_s * 2.0 ** min(failures - 1, 30))
        return base * (1.0 - JITTER * self.rng.random())
