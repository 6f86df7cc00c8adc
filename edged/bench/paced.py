"""The full path at a camera's pace rather than back to back, where ORT's thread spinning shows
its real cost: a spinning pool burns CPU between frames too, not only during a run.

Frames start on a fixed clock (``1 / fps`` apart, as a camera delivers them); a frame that
overruns its slot starts the next one at once. Reported per spinning setting: latency of the
full path, CPU time of the whole process per frame (every thread), and the share of one core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from edged.bench.run import Timing, bench_frame, full_path_for
from edged.config import Spinning


@dataclass(frozen=True, slots=True)
class PacedRun:
    spinning: Spinning
    fps: float
    latency: Timing
    cpu_ms_per_frame: float
    core_share: float  # CPU time over wall time: 1.0 is one core kept busy


def paced(path: Path, *, fps: float, frames: int, warmup: int, spinning: tuple[Spinning, ...], threads: int,
          conf: float) -> list[PacedRun]:
    image = bench_frame()
    runs = []
    for spin in spinning:
        with full_path_for(path, spin, threads, conf, image) as (_, full):
            for _ in range(warmup):
                full()
            period, latency = 1.0 / fps, []
            cpu0, t0 = time.process_time_ns(), time.perf_counter_ns()
            tick = time.monotonic()
            for _ in range(frames):
                tick = max(tick + period, time.monotonic())
                latency.append(full().total_ms)
                full.drain()
                time.sleep(max(0.0, tick - time.monotonic()))
            cpu_ms, wall_ms = (time.process_time_ns() - cpu0) / 1e6, (time.perf_counter_ns() - t0) / 1e6
        runs.append(PacedRun(spin, fps, Timing.of(latency), cpu_ms / frames, cpu_ms / wall_ms))
    return runs
