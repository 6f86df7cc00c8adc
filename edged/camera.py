"""One camera of the board: everything the daemon keeps per camera, in one object.

A `Camera` holds its ``[[source]]`` settings, its capture thread, its `FramePath` on the model
all cameras share, its counters, its message sequence numbers, its rate cap and its trigger mode.
The daemon keeps one per camera and hands those with a frame ready to the inference lanes in
turn; the outputs and the requests in hand are kept by camera id (`edged.outputs`, `edged.requests`).

Plans are per camera: two cameras of the same frame size each have their own. Their frames run
through the model at the same time on two lanes (`edged.lanes`), each writing its own input
tensor and outputs; a `FramePath`'s rules are about one stream (a camera re-planned after a
lasting size change, an image folder's least recently used sizes); and a `Processed` result is a
view into its plan valid until that plan's next frame. A plan shared by two cameras would let one
camera's size change or frame evict or overwrite the other's. A plan costs its input tensor,
output buffers and decode scratch (about 16 MB at 640x640 with 80 classes); the session and the
weights, the large part, are shared.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal, get_args

from edged.capture import Capture
from edged.config import CapturePriority, Settings
from edged.lograte import LogRate
from edged.pipeline import OUTPUT_PROBLEMS, FramePath, Processed, Rejected
from edged.ratecap import RateCap
from edged.settings.sources import SourceBase, TriggerMode
from edged.sources.base import Frame
from edged.sources.registry import open_source
from edged.stats import RunStats
from edged.wake import Waker

log = logging.getLogger(__name__)

Topic = Literal["detections", "verdict", "status"]  # a camera's topics, each with a seq of its own
Sequences = dict[str, Iterator[int]]  # a camera's next seq of each topic
REJECT_LOG_INTERVAL_S = 10.0  # a folder's rejected images: one named per interval at most, the counter has the rest
FILES_REMEMBERED = 10_000  # the files whose rejection was said, each said once; the oldest forgotten past this


def start_capture(cfg: SourceBase, priority: CapturePriority, wake: Waker) -> Capture:
    """The camera's capture thread, started: it opens the camera while the model loads."""
    capture = Capture(lambda: open_source(cfg), cfg.camera_id, priority=priority, wake=wake)
    capture.start()
    return capture


def stop_captures(captures: Iterable[Capture], timeout_s: float) -> None:
    """Stop several capture threads within ``timeout_s`` in all: each is told first, then each is waited for."""
    captures = list(captures)
    for capture in captures:
        capture.signal_stop()
    deadline = time.monotonic() + timeout_s
    for capture in captures:
        capture.stop(max(0.0, deadline - time.monotonic()))


def camera_for(
    settings: Settings,
    cfg: SourceBase,
    capture: Capture,
    path: FramePath,
    previous: Camera | None = None,
    sequences: Sequences | None = None,
) -> Camera:
    """Camera ``cfg`` as ``settings`` run it: in its trigger mode, with its rate cap in free mode
    (in request mode the requests set the pace)."""
    mode = settings.trigger_mode(cfg)
    return Camera(cfg, capture, path, settings.max_fps(cfg) if mode == "free" else 0.0, mode, previous, sequences)


class Camera:
    """A camera's capture, frame path, counters, sequence numbers and rate cap.

    ``previous``: the running camera of the same id that this one replaces on a reload; its
    counters and sequence numbers carry on, so its topics stay gapless.
    """

    def __init__(
        self,
        cfg: SourceBase,
        capture: Capture,
        path: FramePath,
        max_fps: float,
        mode: TriggerMode = "free",
        previous: Camera | None = None,
        sequences: Sequences | None = None,
    ) -> None:
        """``previous``: this camera as it ran until now, whose counters and sequence numbers go on here;
        ``sequences``: without it, the sequence numbers of a camera of this id that a reload removed."""
        self.cfg = cfg
        self.id = cfg.camera_id
        self.capture = capture
        self.path = path
        self.mode = mode
        self.rate_cap = RateCap(max_fps)
        self.stats: RunStats = previous.stats if previous else RunStats()
        fresh: Sequences = sequences if sequences is not None else {t: itertools.count() for t in get_args(Topic)}
        self._seq: Sequences = previous._seq if previous else fresh
        self.served_s: float = previous.served_s if previous else 0.0  # when its last frame was taken
        self._due_s = 0.0  # the rate cap lets its next frame be taken from then on
        self._rejections: LogRate = previous._rejections if previous else LogRate(REJECT_LOG_INTERVAL_S)
        self._rejected_files: dict[str, None] = previous._rejected_files if previous else {}  # in the order said

    def due(self, now_s: float) -> bool:
        """The rate cap lets this camera's next frame be taken now."""
        return now_s >= self._due_s

    def wait_s(self, now_s: float) -> float:
        """How long until the rate cap lets this camera's next frame be taken."""
        return max(0.0, self._due_s - now_s)

    def take(self) -> Frame | None:
        """Its newest frame, starting its rate-cap interval, or None when none is ready.

        Asking without getting a frame still tells the capture thread that a frame is wanted,
        so that it decodes the next one (`edged.demand`).
        """
        frame = self.capture.take(0.0)
        if frame is not None:
            now = time.monotonic()
            self.served_s = now
            self._due_s = now + self.rate_cap.wait_s(now, now)
        return frame

    def update_rate_cap(self, rate_factor: float) -> None:
        """Re-measure the camera's rate and apply the thermal ``rate_factor`` (`edged.ratecap`)."""
        self.rate_cap.update(self.capture.stats().frames_captured, rate_factor)

    def record(self, done: Processed, part_id: str | None, errors: LogRate) -> None:
        """Count a processed frame: its timings, its verdict, and each of its model output's problems
        (`edged.pipeline.OUTPUT_PROBLEMS`), logged as ``errors`` allows; the counters carry the rest."""
        frame_id = done.frame.frame_id
        for problem, count in done.result.problems():
            self.stats.drop(problem)
            if errors.allows():
                args = (self.id, count, frame_id, self.stats.drops[problem])
                log.error(OUTPUT_PROBLEMS[problem], *args, extra={"CAMERA": self.id, "FRAME": frame_id, "STAGE": "decode"})
        times = done.times
        self.stats.record(times.preprocess_ms, times.inference_ms, times.decode_ms, done.age_ms)
        if (record := self.path.verdict_record(done, part_id)) is not None:
            self.stats.record_verdict(record, done.verdict_ms)

    def reject(self, rejected: Rejected, errors: LogRate) -> int:
        """Count a frame that was not processed and say why: an inference failure as ``errors``
        allows, an unfit frame as `_says_rejected` decides; returns 1 for an inference failure, else 0."""
        self.stats.drop(rejected.reason)
        count, frame_id = self.stats.drops[rejected.reason], rejected.frame.frame_id
        if rejected.reason == "inference_error":
            if errors.allows():
                log.error(
                    "camera %s: inference failed, frame %d skipped (%d failed so far): %s",
                    *(self.id, frame_id, count, rejected.detail),
                    extra={"CAMERA": self.id, "FRAME": frame_id, "STAGE": "inference"},
                )
            return 1
        if self._says_rejected(rejected.frame.source_file, count):
            name, detail = rejected.frame.source_file, rejected.detail
            if name is not None and not detail.startswith(f"{name}: "):
                detail = f"{name}: {detail}"
            log.warning(
                "camera %s: frame %d rejected (%s): %s",
                *(self.id, frame_id, rejected.reason.removeprefix("bad_frame_"), detail),
                extra={"CAMERA": self.id, "FRAME": frame_id, "STAGE": "contract"},
            )
        return 0

    def _says_rejected(self, name: str | None, count: int) -> bool:
        """Whether an unfit frame is logged. A camera's frames are all alike: its first says it, the
        counter the rest. A frame read from file ``name`` (an image folder) is that file's: each
        file is named the first time, so that a second image too large for the model is not
        counted unnamed, but at most one line per `REJECT_LOG_INTERVAL_S` (a folder of thousands is
        no flood); a file passed over then is named on a later pass."""
        if name is None:
            return count == 1
        if name in self._rejected_files or not self._rejections.allows():
            return False
        self._rejected_files[name] = None
        if len(self._rejected_files) > FILES_REMEMBERED:
            del self._rejected_files[next(iter(self._rejected_files))]
        return True

    @property
    def sequences(self) -> Sequences:
        """Its topics' sequence numbers, for a camera of its id that a later reload adds back."""
        return self._seq

    def next_seq(self, kind: Topic) -> int:
        """The next ``seq`` on this camera's topic of ``kind``: gapless per camera and topic."""
        return next(self._seq[kind])


def say_ended(cameras: Sequence[Camera]) -> None:
    """Every source has ended, said with the frames each camera processed: a warning where one
    processed none, since edged then exits 0 having published nothing of it."""
    if len(cameras) == 1:
        what = f"source ended: stopping ({cameras[0].stats.frames_processed} frames processed)"
    else:
        counts = ", ".join(f"{camera.id} {camera.stats.frames_processed}" for camera in cameras)
        what = f"every source ended: stopping ({counts} frames processed)"
    if any(camera.stats.frames_processed == 0 for camera in cameras):
        log.warning(
            "%s; a camera that processed none gave every frame to a model not yet free (a short video file "
            "paced like a camera; source.realtime = false processes every frame) or, in request mode, was asked nothing",
            what,
        )
    else:
        log.info("%s", what)
