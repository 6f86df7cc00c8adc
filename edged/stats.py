"""Run statistics: stage latencies and counters behind the status message and STATUS= line.

Latencies go into fixed-size ring buffers allocated once, so recording a frame's timings costs
three float stores; percentiles are computed only when a status message is built.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np

from edged.messages import StageLatency

STAGES = ("preprocess", "inference", "decode", "age")


class LatencyWindow:
    """The last ``size`` samples of one stage, in milliseconds."""

    def __init__(self, size: int = 1024) -> None:
        self._samples = np.zeros(size, np.float64)
        self._next = 0
        self._count = 0

    def add(self, ms: float) -> None:
        self._samples[self._next] = ms
        self._next = (self._next + 1) % self._samples.shape[0]
        self._count = min(self._count + 1, self._samples.shape[0])

    def summary(self) -> StageLatency:
        if self._count == 0:
            return StageLatency(p50_ms=0.0, p99_ms=0.0)
        p50, p99 = np.percentile(self._samples[: self._count], (50, 99))
        return StageLatency(p50_ms=round(float(p50), 3), p99_ms=round(float(p99), 3))


class RunStats:
    """Counters and latency windows of one daemon run."""

    def __init__(self) -> None:
        self.started_ns = time.monotonic_ns()
        self.frames_processed = 0
        self.drops: Counter[str] = Counter()
        self.latency = {stage: LatencyWindow() for stage in STAGES}
        self._fps_mark = (self.started_ns, 0)
        self.fps = 0.0

    def record(self, preprocess_ms: float, inference_ms: float, decode_ms: float, age_ms: float) -> None:
        self.frames_processed += 1
        self.latency["preprocess"].add(preprocess_ms)
        self.latency["inference"].add(inference_ms)
        self.latency["decode"].add(decode_ms)
        self.latency["age"].add(age_ms)

    def drop(self, cause: str) -> None:
        self.drops[cause] += 1

    def update_fps(self) -> float:
        """Frames per second since the previous call (one status interval)."""
        now = time.monotonic_ns()
        then, frames = self._fps_mark
        if now > then:
            self.fps = (self.frames_processed - frames) * 1e9 / (now - then)
        self._fps_mark = (now, self.frames_processed)
        return self.fps

    def uptime_s(self) -> float:
        return (time.monotonic_ns() - self.started_ns) / 1e9

    def latencies(self) -> dict[str, StageLatency]:
        return {stage: window.summary() for stage, window in self.latency.items()}
