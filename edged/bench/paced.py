"""The full path at a camera's pace rather than back to back, where ORT's thread spinning shows
its real cost: a spinning pool burns CPU between frames too, not only during a run.

Frames start on a fixed clock (``1 / fps`` apart, as a camera delivers them); a frame that
overruns its slot starts the next one at once. Reported per spinning setting: latency of the
full path, CPU time of the whole process per frame (every thread), and the share of one core.
The settings take turns in several rounds (each loads its own session, one at a time), so that
drift on a shared machine hits each alike. With ``capture``, a real capture thread at that
priority decodes the bench's 1280x720 MJPEG clip at 30 fps throughout, as a camera would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edged.bench.contention import decoding_camera
from edged.bench.run import Timing, bench_frame, full_path_for
from edged.config import CapturePriority, Spinning

ROUNDS = 3


@dataclass(frozen=True, slots=True)
class PacedRun:
    spinning: Spinning
    fps: float
    latency: Timing
    cpu_ms_per_frame: float
    core_share: float  # CPU time over wall time: 1.0 is one core kept busy


def paced(
    path: Path,
    *,
    fps: float,
    frames: int,
    warmup: int,
    spinning: tuple[Spinning, ...],
    threads: int,
    conf: float,
    capture: CapturePriority | None,
    cache_dir: Path,
) -> list[PacedRun]:
    if capture is None:
        return _paced(path, fps, frames, warmup, spinning, threads, conf)
    with decoding_camera(capture, cache_dir):
        return _paced(path, fps, frames, warmup, spinning, threads, conf)


def _paced(
    path: Path, fps: float, frames: int, warmup: int, spinning: tuple[Spinning, ...], threads: int, conf: float
) -> list[PacedRun]:
    image = bench_frame()
    latency: dict[Spinning, list[float]] = {spin: [] for spin in spinning}
    cpu_ms = dict.fromkeys(spinning, 0.0)
    wall_ms = dict.fromkeys(spinning, 0.0)
    per_round = max(1, frames // ROUNDS)
    for turn in range(ROUNDS):
        for spin in spinning if turn % 2 == 0 else spinning[::-1]:
            with full_path_for(path, spin, threads, conf, image) as (_, full):
                for _ in range(warmup):
                    full()
                period = 1.0 / fps
                cpu0, t0 = time.process_time_ns(), time.perf_counter_ns()
                tick = time.monotonic()
                for _ in range(per_round):
                    tick = max(tick + period, time.monotonic())
                    latency[spin].append(full().total_ms)
                    full.drain()
                    time.sleep(max(0.0, tick - time.monotonic()))
                cpu_ms[spin] += (time.process_time_ns() - cpu0) / 1e6
                wall_ms[spin] += (time.perf_counter_ns() - t0) / 1e6
    count = per_round * ROUNDS
    return [
        PacedRun(spin, fps, Timing.of(np.asarray(latency[spin])), cpu_ms[spin] / count, cpu_ms[spin] / wall_ms[spin])
        for spin in spinning
    ]
