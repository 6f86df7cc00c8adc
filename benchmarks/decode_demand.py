"""What decoding on demand saves: the capture thread's CPU under a consumer slower than the camera.

The camera is a stand-in for a USB camera delivering 1280x720 MJPEG at 30 fps, as OpenCV's V4L2
backend reads one: ``grab`` takes the next compressed frame (the bench scenes, JPEG-encoded once
and kept in memory), ``retrieve`` decodes it with ``cv2.imdecode``. A consumer takes frames at a
fixed rate and otherwise sleeps, as the daemon's loop does around a model of that speed, so the
process's CPU time is the capture thread's. Each consumer rate runs once decoding every frame
(``decode_all``) and once decoding on demand, in alternating order over several rounds.

    python benchmarks/decode_demand.py --frames 300 [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from typing import Literal

import cv2
import numpy as np

from edged.capture import Capture
from edged.demand import DEMAND_CYCLES
from edged.errors import SourceError
from edged.sources.scenes import SceneGenerator

CAMERA_FPS = 30.0
CONSUMER_FPS = (5.0, 15.0, 30.0)
ROUNDS = 3
SCENES = 30
FIRST_FRAME_TIMEOUT_S = 5.0


class MjpegCamera:
    """Compressed frames in memory, decoded only in ``retrieve``, paced at ``CAMERA_FPS``."""

    channel_order: Literal["bgr", "rgb"] = "bgr"

    def __init__(self, jpegs: list[np.ndarray]) -> None:
        self._jpegs = jpegs
        self._index = -1

    def open(self) -> None:
        """Nothing to acquire: the frames are already in memory."""

    def grab(self) -> bool:
        self._index = (self._index + 1) % len(self._jpegs)
        return True

    def retrieve(self, out: np.ndarray | None) -> np.ndarray:
        image = cv2.imdecode(self._jpegs[self._index], cv2.IMREAD_COLOR)
        if image is None:
            raise SourceError(f"stand-in camera frame {self._index} does not decode")
        return image  # the capture thread copies it into its slot, as OpenCV's backend copies out

    def read(self, out: np.ndarray | None) -> np.ndarray:
        self.grab()
        return self.retrieve(out)

    def pace(self) -> float:
        return 1.0 / CAMERA_FPS

    def close(self) -> None:
        """Nothing to release."""


@dataclass(frozen=True, slots=True)
class DemandRow:
    consumer_fps: float
    decode: Literal["every frame", "on demand"]
    cores: float  # the process's CPU time over wall time: the capture thread's share of a core
    decoded_fps: float
    taken_fps: float
    age_ms: float  # median age of the frames taken, capture to take
    newest: float  # share of takes that got the newest frame grabbed before the take


def camera_frames() -> list[np.ndarray]:
    scenes = SceneGenerator(1280, 720, seed=0)
    return [cv2.imencode(".jpg", scenes.render(i).image, [cv2.IMWRITE_JPEG_QUALITY, 90])[1] for i in range(SCENES)]


def decode_on_demand(*, frames: int) -> list[DemandRow]:
    """Each consumer rate under both decoding modes, ``frames`` camera frames per mode and rate."""
    jpegs = camera_frames()
    seconds = max(1, frames // ROUNDS) / CAMERA_FPS
    blocks: dict[tuple[float, bool], list[_Block]] = {}
    for turn in range(ROUNDS):
        for fps in CONSUMER_FPS:
            for decode_all in (True, False) if turn % 2 == 0 else (False, True):
                blocks.setdefault((fps, decode_all), []).append(_block(jpegs, fps, decode_all, seconds))
    rows = []
    for (fps, decode_all), runs in blocks.items():
        wall = sum(b.wall_s for b in runs)
        ages = [age for b in runs for age in b.takes.ages_ms]
        newest = sum(b.takes.newest for b in runs)
        rows.append(
            DemandRow(
                fps,
                "every frame" if decode_all else "on demand",
                sum(b.cpu_s for b in runs) / wall,
                sum(b.decoded for b in runs) / wall,
                len(ages) / wall,
                float(np.median(ages)) if ages else float("nan"),
                newest / max(1, len(ages)),
            )
        )
    return sorted(rows, key=lambda r: (r.consumer_fps, r.decode != "every frame"))


@dataclass(slots=True)
class _Takes:
    ages_ms: list[float]
    newest: int = 0  # takes that got the newest frame grabbed before the take


@dataclass(frozen=True, slots=True)
class _Block:
    cpu_s: float
    wall_s: float
    decoded: int
    takes: _Takes


def _block(jpegs: list[np.ndarray], fps: float, decode_all: bool, seconds: float) -> _Block:
    """One consumer taking frames at ``fps`` for ``seconds``; on demand, after as many frames as the
    capture thread needs to learn its pace."""
    capture = Capture(lambda: MjpegCamera(jpegs), "bench", decode_all=decode_all)
    capture.start()
    rng = random.Random(0)
    try:
        if capture.take(FIRST_FRAME_TIMEOUT_S) is None:
            raise RuntimeError(f"the stand-in camera delivered no frame: {capture.stats().last_error}")
        if not decode_all:
            _consume(capture, fps, (DEMAND_CYCLES + 2) / fps, rng)
        decoded, cpu, start = capture.stats().frames_decoded, time.process_time(), time.monotonic()
        takes = _consume(capture, fps, seconds, rng)
        return _Block(time.process_time() - cpu, time.monotonic() - start, capture.stats().frames_decoded - decoded, takes)
    finally:
        capture.stop()


def _consume(capture: Capture, fps: float, seconds: float, rng: random.Random) -> _Takes:
    """Take a frame every ``1 / fps`` (+-10 %), sleeping between."""
    takes = _Takes([])
    start = tick = time.monotonic()
    while (now := time.monotonic()) < start + seconds:
        # A model's time per frame varies; a jitter-free consumer would also lock to the camera's
        # phase and make the frames' age a matter of that phase.
        tick = max(tick + rng.uniform(0.9, 1.1) / fps, now)
        newest = capture.stats().frames_captured - 1
        frame = capture.take(1.0)
        if frame is not None:
            takes.ages_ms.append((time.monotonic_ns() - frame.t_capture_ns) / 1e6)
            takes.newest += frame.frame_id >= newest
        time.sleep(max(0.0, tick - time.monotonic()))
    return takes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--frames", type=int, default=300, help="camera frames per mode and consumer rate (default 300)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    if args.frames < 1:
        parser.error("--frames must be >= 1")
    rows = decode_on_demand(frames=args.frames)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
        return 0
    print(
        f"capture thread under a slower consumer: {CAMERA_FPS:g} fps 1280x720 MJPEG camera (decoded in "
        f"retrieve, as OpenCV's V4L2 backend does), {args.frames} camera frames per row\n"
        "consumer fps  decoding       cores  decoded fps  taken fps  frame age median ms  newest"
    )
    for r in rows:
        print(
            f"{r.consumer_fps:12g}  {r.decode:<12}{r.cores:8.3f}{r.decoded_fps:13.1f}{r.taken_fps:11.1f}"
            f"{r.age_ms:21.1f}{r.newest:8.0%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
