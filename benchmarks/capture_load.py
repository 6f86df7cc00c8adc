"""Whether capture steals cores from inference, measured rather than assumed.

The floor and the full path are timed with no capture thread, then beside edged's own `Capture`
decoding a camera-sized video in the background at each ``runtime.capture_priority``. The
video is 1280x720 MJPEG at 30 fps, what a USB camera delivers, written once from the bench
scenes and read through the `file` source looping in real time, so the decoding, colour
conversion and slot copies are the daemon's own. Nobody takes the frames, and the thread is told
to decode every one anyway, as it does for a model that takes every frame the camera delivers:
the worst case, a capture thread busy while inference runs back to back. One more condition,
``camera-fed``, is the daemon's own arrangement: the full path takes each frame from the capture
thread (default priority, decoding on demand) as the loop does. Its twin, ``clock-fed``, starts
the full path on the same 30 fps clock with no capture thread at all: a pipeline that idles
between frames runs each one slower than back to back, and the difference between the two is
what capture costs in the daemon's arrangement. The floor row does not apply to either. The
conditions take turns in several rounds, so that drift on a shared machine hits each alike.

    python benchmarks/capture_load.py --model PATH --frames 450 [--spinning off] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast, get_args

import cv2

from edged.capture import Capture
from edged.config import CapturePriority, RuntimeConfig, Spinning
from edged.errors import EdgedError
from edged.settings.sources import FileSourceConfig
from edged.sources.registry import open_source
from edged.sources.scenes import SceneGenerator
from edged.tools.bench_rows import FullPath, Row, TimedFrame, bench_frame, floor_row, interleave, load, resolve_model, timing

VIDEO_FPS = 30
VIDEO_FRAMES = 60
FIRST_FRAME_TIMEOUT_S = 10.0
ROUNDS = 3
CACHE_DIR = Path(tempfile.gettempdir()) / "edged-bench"
DEFAULT_CAPTURE_PRIORITY: CapturePriority = RuntimeConfig.model_fields["capture_priority"].default
DEFAULT_SPINNING: Spinning = RuntimeConfig.model_fields["spinning"].default
CAMERA_FED = "camera-fed"
CLOCK_FED = "clock-fed"


@dataclass(frozen=True, slots=True)
class ContentionRow:
    """The rows' latency under one capture condition ("none", a capture priority, clock-fed or camera-fed)."""

    capture: str
    floor: dict[str, float] | None  # median_ms, p99_ms; None when fed: the floor takes no frames
    full: dict[str, float]
    inference: dict[str, float]  # the full path's inference stage: what a capture thread can slow down
    decoded_fps: float  # frames the capture thread decoded per second meanwhile


def capture_contention(
    path: Path, *, frames: int, warmup: int, spinning: Spinning, threads: int, conf: float, cache_dir: Path
) -> list[ContentionRow]:
    bench_video(cache_dir)  # written before any timing
    conditions: list[str] = ["none", *get_args(CapturePriority), CLOCK_FED, CAMERA_FED]
    timed: dict[str, dict[str, list[TimedFrame]]] = {c: {"floor": [], "full": []} for c in conditions}
    rates: dict[str, list[float]] = {c: [] for c in conditions}
    model = load(path, spinning=spinning, threads=threads, conf=conf)
    with FullPath(model, bench_frame()) as full:
        floor = floor_row(model, full.plan.preprocess.tensor)
        for _ in range(ROUNDS):
            for name in conditions:
                got, rate = _block(floor, full, name, max(1, frames // ROUNDS), warmup, cache_dir)
                for row, values in got.items():
                    timed[name][row] += values
                rates[name].append(rate)
    return [_row(name, timed[name], sum(rates[name]) / ROUNDS) for name in conditions]


def _row(name: str, timed: dict[str, list[TimedFrame]], decoded_fps: float) -> ContentionRow:
    floor = timing([t.total_ms for t in timed["floor"]]) if timed["floor"] else None
    return ContentionRow(
        name,
        floor,
        timing([t.total_ms for t in timed["full"]]),
        timing([t.stages["inference"] for t in timed["full"]]),
        decoded_fps,
    )


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
def decoding_camera(priority: CapturePriority, cache_dir: Path, *, decode_all: bool = True) -> Iterator[Capture]:
    """A capture thread at ``priority`` on the bench clip, decoding every frame unless told to
    decode on demand, until the block ends."""
    video = bench_video(cache_dir)
    capture = Capture(lambda: open_source(FileSourceConfig(path=video)), "bench", priority=priority, decode_all=decode_all)
    capture.start()
    try:
        if capture.take(FIRST_FRAME_TIMEOUT_S) is None:
            raise RuntimeError(
                f"the capture thread delivered no frame in {FIRST_FRAME_TIMEOUT_S:g} s: {capture.stats().last_error}"
            )
        yield capture
    finally:
        capture.stop()


class CameraFed:
    """The full path on each frame taken from a capture thread, as the daemon's loop takes them.

    Only the path is timed, as in the other conditions; the wait for the next frame is not.
    """

    def __init__(self, full: FullPath, capture: Capture) -> None:
        self._full = full
        self._capture = capture

    def __call__(self) -> TimedFrame:
        frame = self._capture.take(FIRST_FRAME_TIMEOUT_S)
        if frame is None:
            raise RuntimeError(f"the capture thread stopped delivering: {self._capture.stats().last_error}")
        self._full.image = frame.image
        return self._full()


class ClockFed:
    """The full path started every ``1 / VIDEO_FPS`` s, on the bench frame, with no capture thread."""

    def __init__(self, full: FullPath) -> None:
        self._full = full
        self._due = time.monotonic()

    def __call__(self) -> TimedFrame:
        self._due = max(self._due + 1.0 / VIDEO_FPS, time.monotonic())
        time.sleep(max(0.0, self._due - time.monotonic()))
        return self._full()


def _block(
    floor: Row, full: FullPath, condition: str, frames: int, warmup: int, cache_dir: Path
) -> tuple[dict[str, list[TimedFrame]], float]:
    """The rows for ``frames`` frames under one condition; and the frames decoded per second meanwhile."""
    if condition == "none":
        return interleave({"floor": floor, "full": full}, frames, warmup), 0.0
    if condition == CLOCK_FED:
        return interleave({"full": ClockFed(full)}, frames, warmup), 0.0
    fed = condition == CAMERA_FED
    priority = DEFAULT_CAPTURE_PRIORITY if fed else cast(CapturePriority, condition)
    with decoding_camera(priority, cache_dir, decode_all=not fed) as capture:
        rows: dict[str, Row] = {"full": CameraFed(full, capture)} if fed else {"floor": floor, "full": full}
        bench_image = full.image
        start, decoded = time.monotonic(), capture.stats().frames_decoded
        try:
            timed = interleave(rows, frames, warmup)
        finally:
            full.image = bench_image  # camera-fed swapped in the capture's frames
        return timed, (capture.stats().frames_decoded - decoded) / (time.monotonic() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, metavar="PATH", help="ONNX model (default: the demo model)")
    parser.add_argument("--frames", type=int, default=300, help="timed frames per row and condition (default 300)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed frames first, per block (default 20)")
    parser.add_argument("--spinning", choices=get_args(Spinning), default=DEFAULT_SPINNING, help="runtime.spinning")
    parser.add_argument("--threads", type=int, default=0, help="runtime.intra_op_threads (default 0)")
    parser.add_argument("--conf", type=float, default=0.25, help="model.conf (default 0.25)")
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help=f"where the clip is kept (default {CACHE_DIR})")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    if args.frames < 1 or args.warmup < 0:
        parser.error("--frames must be >= 1 and --warmup >= 0")
    try:
        path = resolve_model(args.model)
    except EdgedError as e:
        parser.error(str(e))
    rows = capture_contention(
        path,
        frames=args.frames,
        warmup=args.warmup,
        spinning=args.spinning,
        threads=args.threads,
        conf=args.conf,
        cache_dir=args.cache_dir,
    )
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
        return 0
    print(
        f"capture beside inference on {path.name}: {args.frames} frames per row and condition, "
        "capture decoding 1280x720 MJPEG at 30 fps\n"
        "capture            floor median    p99 ms   full median    p99 ms  inference median   decoded fps"
    )
    for r in rows:
        floor = f"{r.floor['median_ms']:12.3f}{r.floor['p99_ms']:10.3f}" if r.floor else f"{'-':>12}{'-':>10}"
        print(
            f"{r.capture:<18}{floor}{r.full['median_ms']:13.3f}{r.full['p99_ms']:10.3f}{r.inference['median_ms']:18.3f}"
            f"{r.decoded_fps:14.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
