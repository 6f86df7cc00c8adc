"""Whether capture steals cores from inference, measured rather than assumed.

The floor and the full path are timed with no capture thread, then beside edged's own `Capture`
decoding a camera-sized video in the background at each ``runtime.capture_priority``. The
video is 1280x720 MJPEG at 30 fps, what a USB camera delivers, written once from the bench
scenes and read through the `file` source looping in real time, so the decoding, colour
conversion and slot copies are the daemon's own. Nobody takes the frames, and the thread is told
to decode every one anyway, as it does for a model that takes every frame the camera delivers
(for a slower model it decodes only the frames taken). The conditions take turns in several
rounds, so that drift on a shared machine hits each alike.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import cv2

from edged.bench.rows import FloorPath, Row, Sample, interleave
from edged.bench.run import Timing, bench_frame, full_path_for
from edged.capture import Capture
from edged.config import CapturePriority, FileSource, Spinning
from edged.scenes import SceneGenerator
from edged.sources import open_source

VIDEO_FPS = 30
VIDEO_FRAMES = 60
FIRST_FRAME_TIMEOUT_S = 10.0
ROUNDS = 3


@dataclass(frozen=True, slots=True)
class ContentionRow:
    """The two rows' latency under one capture condition ("none" or a capture priority)."""

    capture: str
    floor: Timing
    full: Timing
    decoded_fps: float  # frames the capture thread decoded per second meanwhile


def capture_contention(path: Path, *, frames: int, warmup: int, spinning: Spinning, threads: int, conf: float,
                       cache_dir: Path) -> list[ContentionRow]:
    bench_video(cache_dir)  # written before any timing
    conditions: dict[str, CapturePriority | None] = {"none": None, **{p: p for p in get_args(CapturePriority)}}
    samples: dict[str, dict[str, list[Sample]]] = {c: {"floor": [], "full": []} for c in conditions}
    rates: dict[str, list[float]] = {c: [] for c in conditions}
    image = bench_frame()
    with full_path_for(path, spinning, threads, conf, image) as (model, full):
        full()  # fills the input tensor the floor row is fed a copy of
        rows: dict[str, Row] = {"floor": FloorPath(model, full.pipeline.preprocess.tensor), "full": full}
        for _ in range(ROUNDS):
            for name, priority in conditions.items():
                got, rate = _block(rows, priority, max(1, frames // ROUNDS), warmup, cache_dir)
                for row, values in got.items():
                    samples[name][row] += values
                rates[name].append(rate)
    return [ContentionRow(name, Timing.of([s.total_ms for s in samples[name]["floor"]]),
                          Timing.of([s.total_ms for s in samples[name]["full"]]), sum(rates[name]) / ROUNDS)
            for name in conditions]


def bench_video(folder: Path) -> Path:
    """The 1280x720 MJPEG clip, written on first use."""
    path = folder / f"capture-1280x720-mjpg-{VIDEO_FPS}fps-v1.avi"
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.avi")
    writer = cv2.VideoWriter(str(partial), cv2.VideoWriter.fourcc(*"MJPG"), VIDEO_FPS, (1280, 720))
    scenes = SceneGenerator(1280, 720, seed=0)
    for i in range(VIDEO_FRAMES):
        writer.write(scenes.render(i).image)
    writer.release()
    partial.replace(path)
    return path


@contextmanager
def decoding_camera(priority: CapturePriority, cache_dir: Path) -> Iterator[Capture]:
    """A capture thread at ``priority`` decoding every frame of the bench clip, until the block ends."""
    video = bench_video(cache_dir)
    capture = Capture(lambda: open_source(FileSource(path=video)), "bench", priority=priority, decode_all=True)
    capture.start()
    try:
        if capture.take(FIRST_FRAME_TIMEOUT_S) is None:
            raise RuntimeError(f"the capture thread delivered no frame in {FIRST_FRAME_TIMEOUT_S:g} s: "
                               f"{capture.stats().last_error}")
        yield capture
    finally:
        capture.stop()


def _block(rows: dict[str, Row], priority: CapturePriority | None, frames: int, warmup: int,
           cache_dir: Path) -> tuple[dict[str, list[Sample]], float]:
    """The rows interleaved for ``frames`` frames, beside a capture thread when asked; and its frame rate."""
    if priority is None:
        return interleave(rows, frames, warmup), 0.0
    with decoding_camera(priority, cache_dir) as capture:
        start, decoded = time.monotonic(), capture.stats().frames_decoded
        samples = interleave(rows, frames, warmup)
        return samples, (capture.stats().frames_decoded - decoded) / (time.monotonic() - start)
