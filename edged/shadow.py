"""The shadow trial: a candidate model (``[model.candidate]``) beside the live one, on live frames.

Every ``sample_every``-th frame a camera publishes is copied, with what the live model found in
it, into that camera's `Sample` (a buffer of its own: the live frame's slot is reused by the
capture). The candidate runs on the loop's thread, and only when the loop would otherwise wait:
nothing on the lanes, no request in hand, and the time until each camera's next frame is due
longer than the candidate's measured p99 latency (`spare_s`), so the live frame rate and frame
age are not touched. A loop kept busy by the live model never gives the candidate a turn; the
samples it never ran on are counted (``skipped_busy``). The candidate publishes nothing and
drives no output: its results are only compared with the live model's (`Tally`).

What the trial costs the live frames is measured rather than assumed: the loop time it takes (each
candidate run, each sample copy) is kept as busy intervals (`BusyTimes`), and every live frame is
charged the part of them after its capture (`Tally.delayed`), so the status says how much frame age
the trial added, whatever other load the machine carries.

A candidate that fails to load, fails on a frame or outputs NaN is reported in the status and
never reaches the live path. `Shadow.promote` and `Shadow.rollback` hand the daemon the model
and frame paths to swap in between frames (`edged.control` carries the commands).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from edged.anomaly import Anomaly
from edged.camera import Camera
from edged.classify import Classes
from edged.config import CandidateConfig, ModelConfig, RuntimeConfig, Settings
from edged.decode import Detections
from edged.errors import EdgedError
from edged.evidence import EvidenceWriter
from edged.messages import CandidateReport, CandidateState, ClassAgreement, StageLatency, Task
from edged.model import LoadedModel, load_model
from edged.pipeline import FramePath, Processed, Rejected, frame_path
from edged.requests import RequestDesk
from edged.settings.evidence import EvidenceConfig
from edged.sources.base import Frame
from edged.stats import LatencyWindow
from edged.task import SPOILING, TaskResult

log = logging.getLogger(__name__)

LATENCY_WINDOW = 256  # the candidate's latest runs its p50 and p99 are taken over
HEADROOM_FACTOR = 1.2  # the spare time must exceed the candidate's p99 by this much
MATCH_IOU = 0.5  # two boxes of one class at this IoU or more are the same object
EVIDENCE_STOP_WAIT_S = 1.0  # at stop, time left to save the disagreeing frames queued
INTERVAL_SMOOTHING = 0.2  # weight of the newest frame interval in a camera's running estimate
BUSY_KEPT = 64  # the trial's busy intervals kept for charging the live frames captured before they ended


BOX_TASKS = frozenset({"detect", "segment"})  # tasks whose results the trial pairs box by box


def incomparable(live: LoadedModel, candidate: LoadedModel) -> str | None:
    """Why the trial cannot compare ``candidate`` with ``live``, or None: their results are compared
    as one task's (boxes by class id, a classifier's or an anomaly model's verdicts), so a model of
    another task, or one whose class ids name other classes, would be a silent mis-comparison (and,
    promoted, would change what every output receives)."""
    if live.task != candidate.task and not {live.task, candidate.task} <= BOX_TASKS:
        return (
            f"the candidate is a {candidate.task} model and the live model a {live.task} model: a trial compares "
            "models of one task; try a model of another task on its own daemon (edged eval, edged check)"
        )
    for class_id, (mine, theirs) in enumerate(zip(live.labels, candidate.labels, strict=False)):
        if mine != theirs:
            return (
                f"the candidate's class {class_id} is {theirs!r} where the live model's is {mine!r}: the trial "
                "compares classes by id; export the candidate with the live model's class order"
            )
    return None


def candidate_runtime(live: RuntimeConfig) -> RuntimeConfig:
    """The candidate's runtime settings: the live model's without the optimised-model cache, which is
    the live model's. Two models given one cache each found the other's graph in it and wrote their
    own: at every start both were optimised again, the cache written twice (an SD card's wear), and
    the live model never started from it."""
    return live.model_copy(update={"optimized_model_path": None})


def candidate_model_config(live: ModelConfig, candidate: CandidateConfig) -> ModelConfig:
    """The candidate's model settings: the live model's, its own file, labels, thresholds and signature."""
    return live.model_copy(
        update={
            "path": candidate.path,
            "labels": candidate.labels,
            "conf": candidate.conf if candidate.conf is not None else live.conf,
            "iou": candidate.iou if candidate.iou is not None else live.iou,
            "anomaly_threshold": candidate.anomaly_threshold
            if candidate.anomaly_threshold is not None
            else live.anomaly_threshold,
            "pixel_threshold": candidate.pixel_threshold if candidate.pixel_threshold is not None else live.pixel_threshold,
            "signature": candidate.signature,
            "candidate": None,
        }
    )


class Sample:
    """One camera's frame waiting for the candidate: a copy of the image and of the live model's
    detections, in buffers allocated once (again only when the frame size changes)."""

    def __init__(self, max_det: int) -> None:
        self.image: np.ndarray | None = None
        self.frame: Frame | None = None
        self.xyxy = np.empty((max_det, 4), np.float32)
        self.scores = np.empty(max_det, np.float32)
        self.class_ids = np.empty(max_det, np.int32)
        self.found = 0
        self.top: tuple[int, float] | None = None  # a classifier's best class and score
        self.verdict = "none"
        self.live_s = 0.0  # the live model's own time on it: the candidate's estimate before it has run
        self.pending = False

    def keep(self, done: Processed) -> None:
        frame, image = done.frame, done.frame.image
        if self.image is None or self.image.shape != image.shape or self.image.dtype != image.dtype:
            self.image = np.empty_like(image)
        np.copyto(self.image, image)
        self.frame = Frame(
            self.image, frame.frame_id, frame.t_capture_ns, frame.t_wall_ns, frame.channel_order, frame.source_file
        )
        result = boxes_of(done.result)
        n = self.found = min(len(result), self.scores.shape[0])
        self.xyxy[:n] = result.xyxy[:n]
        self.scores[:n] = result.scores[:n]
        self.class_ids[:n] = result.class_ids[:n]
        self.top = done.result.top if isinstance(done.result, Classes) else None
        self.verdict = trial_verdict(done)
        times = done.times
        self.live_s = (times.preprocess_ms + times.inference_ms + times.decode_ms) / 1e3
        self.pending = True


@dataclass(slots=True)
class Matches:
    """One frame's boxes paired by class at `MATCH_IOU`: counts by class id, and the score shift."""

    matched: dict[int, int] = field(default_factory=dict)
    live_only: dict[int, int] = field(default_factory=dict)
    candidate_only: dict[int, int] = field(default_factory=dict)
    shift_sum: float = 0.0

    @property
    def agree(self) -> bool:
        return not any(self.live_only.values()) and not any(self.candidate_only.values())


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box of ``a`` (n, 4) with every box of ``b`` (m, 4), x1 y1 x2 y2: (n, m)."""
    x1 = np.maximum(a[:, None, 0], b[None, :, 0])
    y1 = np.maximum(a[:, None, 1], b[None, :, 1])
    x2 = np.minimum(a[:, None, 2], b[None, :, 2])
    y2 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


NO_BOXES = Detections(np.empty((0, 4), np.float32), np.empty(0, np.float32), np.empty(0, np.int32))


def trial_verdict(done: Processed) -> str:
    """What the trial compares a frame by besides its boxes: its verdict with ``[inspect]``; without
    one, a classifier's best class and whether an anomaly model found the part anomalous (their
    results have no boxes, so every frame would agree), and 'none' for a detector's, whose boxes
    are compared instead."""
    if done.inspected is not None:
        return done.inspected.verdict
    result = done.result
    if isinstance(result, Classes):
        top = result.top
        return done.plan.model.label(top[0]) if top is not None else "no class"
    if isinstance(result, Anomaly):
        return "anomalous" if result.anomalous else "normal"
    return "none"


def boxes_of(result: TaskResult) -> Detections:
    """A result's boxes; none for a classifier's or an anomaly model's, compared by their verdicts alone."""
    return result if isinstance(result, Detections) else NO_BOXES


def match(live: Detections, candidate: Detections) -> Matches:
    """Pair the two models' boxes class by class, best IoU first, at `MATCH_IOU` or more."""
    found = Matches()
    for cls in sorted(set(live.class_ids.tolist()) | set(candidate.class_ids.tolist())):
        li, ci = np.flatnonzero(live.class_ids == cls), np.flatnonzero(candidate.class_ids == cls)
        overlap = iou(live.xyxy[li], candidate.xyxy[ci]) if len(li) and len(ci) else np.zeros((len(li), len(ci)))
        pairs = 0
        while overlap.size and overlap.max() >= MATCH_IOU:
            i, j = np.unravel_index(int(overlap.argmax()), overlap.shape)
            found.shift_sum += float(candidate.scores[ci[j]]) - float(live.scores[li[i]])
            overlap[i, :] = overlap[:, j] = -1.0
            pairs += 1
        found.matched[cls] = pairs
        found.live_only[cls] = len(li) - pairs
        found.candidate_only[cls] = len(ci) - pairs
    return found


class BusyTimes:
    """The loop time the trial took lately, as (start, end) intervals on the monotonic clock of
    ``Frame.t_capture_ns``, oldest first, in a ring of ``size`` allocated once.

    `settle` drops the intervals no frame still to come can have waited for; a camera gone quiet
    holds them back, and then the oldest go once ``size`` are kept (its next frame is captured
    after them).
    """

    def __init__(self, size: int = BUSY_KEPT) -> None:
        self._starts = [0] * size
        self._ends = [0] * size
        self._first = self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, start_ns: int, end_ns: int) -> None:
        if end_ns <= start_ns:
            return
        size = len(self._starts)
        if self._count == size:
            self._first, self._count = (self._first + 1) % size, self._count - 1
        i = (self._first + self._count) % size
        self._starts[i], self._ends[i] = start_ns, end_ns
        self._count += 1

    def delay_ns(self, capture_ns: int) -> int:
        """How long a frame captured at ``capture_ns`` and taken after the intervals kept may have
        waited for them: the part of each after the capture."""
        total, size = 0, len(self._starts)
        for k in range(self._count):
            i = (self._first + k) % size
            if self._ends[i] > capture_ns:
                total += self._ends[i] - max(capture_ns, self._starts[i])
        return total

    def settle(self, captured_ns: int) -> None:
        """Every camera has a frame captured at ``captured_ns`` or later: the intervals ended by then are charged."""
        size = len(self._starts)
        while self._count and self._ends[self._first] <= captured_ns:
            self._first, self._count = (self._first + 1) % size, self._count - 1


class Tally:
    """What the trial has found so far, board-wide."""

    def __init__(self) -> None:
        self.frames = self.agreed = self.skipped_busy = self.failed_frames = 0
        self.verdicts: dict[str, int] = {}
        self.matched: dict[int, int] = {}
        self.live_only: dict[int, int] = {}
        self.candidate_only: dict[int, int] = {}
        self.shift_sum = 0.0
        self.latency = LatencyWindow(LATENCY_WINDOW)  # the candidate's runs, failed ones too, in ms
        self.live_frames = self.live_delayed = self.live_delay_ns = 0
        self.live_delays = LatencyWindow(LATENCY_WINDOW)  # the delayed live frames' delays, in ms

    def timed(self, seconds: float) -> None:
        self.latency.add(seconds * 1e3)

    def p99_s(self) -> float | None:
        p99 = self.latency.percentiles(99)
        return p99[0] / 1e3 if p99 is not None else None

    def delayed(self, delay_ns: int) -> None:
        """Count one live frame that may have waited ``delay_ns`` for the trial (0: not at all)."""
        self.live_frames += 1
        if delay_ns > 0:
            self.live_delayed += 1
            self.live_delay_ns += delay_ns
            self.live_delays.add(delay_ns / 1e6)

    def add(self, live_verdict: str, candidate_verdict: str, found: Matches) -> bool:
        """Count one compared frame; returns whether the models agree on it."""
        self.frames += 1
        key = f"{live_verdict}/{candidate_verdict}"
        self.verdicts[key] = self.verdicts.get(key, 0) + 1
        agree = live_verdict == candidate_verdict if live_verdict != "none" else found.agree
        self.agreed += agree
        for mine, theirs in (
            (self.matched, found.matched),
            (self.live_only, found.live_only),
            (self.candidate_only, found.candidate_only),
        ):
            for cls, count in theirs.items():
                mine[cls] = mine.get(cls, 0) + count
        self.shift_sum += found.shift_sum
        return agree

    def agreement(self) -> float | None:
        return self.agreed / self.frames if self.frames else None

    def missing(self) -> dict[int, float]:
        """By class, the share of the live model's boxes the candidate missed."""
        return {
            cls: self.live_only.get(cls, 0) / total
            for cls in self.live_only
            if (total := self.live_only.get(cls, 0) + self.matched.get(cls, 0))
        }


@dataclass(frozen=True, slots=True)
class Swap:
    """What the daemon swaps in between frames: the model and each camera's frame path."""

    model: LoadedModel
    paths: dict[str, FramePath]


@dataclass(frozen=True, slots=True)
class Followed:
    """The candidate's side of a provider fallback, loaded on the fallback's thread beside its model
    (`Shadow.follower`): a candidate on trial, a fresh ``trial`` beside it; a promoted one, the model
    kept for rollback loaded again on the providers left (``kept``), or why it did not load."""

    trial: Shadow | None = None
    kept: Swap | str | None = None


# What a fallback loads for the candidate (`Shadow.follower`), given its settings and its model with their paths.
FollowFor = Callable[[Settings, Swap], Followed]


def kept_on(kept: LoadedModel, settings: Settings, live: Swap) -> Followed:
    """The model kept for rollback, ``kept``, loaded again with ``settings``' runtime (the providers a
    fallback left), with a path for each of the cameras ``live`` serves; why not, if it cannot be."""
    try:
        model = load_model(kept.cfg, settings.runtime, lanes=settings.lanes())  # it runs on the lanes once rolled back to
        paths = {
            source.camera_id: frame_path(settings, model, source)
            for source in settings.source
            if source.camera_id in live.paths
        }
    except EdgedError as e:
        return Followed(kept=str(e))
    return Followed(kept=Swap(model, paths))


class Shadow:
    """The candidate of ``[model.candidate]``, its frame paths per camera, the samples and the tally.

    It loads the candidate at once (through `edged.model.load_model`, so a signature is checked
    as the live model's is); one that does not load, or that `incomparable` refuses beside the
    ``live`` model, is reported (``error``), and the trial stays off.
    ``clock`` (monotonic ns, the frames' capture clock) times the loop time the trial takes.
    """

    def __init__(
        self,
        settings: Settings,
        cfg: CandidateConfig,
        live: LoadedModel,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.cfg = cfg
        self._clock = clock
        self.busy = BusyTimes()
        self.settings = settings
        self.state: CandidateState = "on_trial"
        self.error: str | None = None
        self.model: LoadedModel | None = None
        self.paths: dict[str, FramePath] = {}
        self.tally = Tally()
        self._samples = {source.camera_id: Sample(settings.model.max_det) for source in settings.source}
        self._seen: dict[str, int] = {}
        self._last: dict[str, tuple[int, int]] = {}  # camera id -> its last frame's (frame_id, t_capture_ns)
        self._interval_ns: dict[str, float] = {}  # camera id -> its capture interval, estimated
        self._previous: Swap | None = None  # the model a promotion replaced, for rollback
        self._writers: dict[str, EvidenceWriter] = {}  # by camera id: where disagreeing frames are saved
        # A disagreement is labelled by the live model (its boxes, or its class): its dataset is the
        # live model's names, and a detection dataset for either box task, as only the boxes are kept.
        self._labels: tuple[Task, tuple[str, ...]] = (
            "detect" if live.task in BOX_TASKS else live.task,
            live.class_names,
        )
        try:
            model = load_model(candidate_model_config(settings.model, cfg), candidate_runtime(settings.runtime))
            if (why := incomparable(live, model)) is not None:
                self._fail(f"the candidate cannot be tried: {why}")
                return
            self.model = model
            self.paths = {source.camera_id: frame_path(settings, self.model, source) for source in settings.source}
        except EdgedError as e:
            self._fail(f"the candidate did not load: {e}")

    def _fail(self, why: str) -> None:
        """Off, and why: said when the trial would start (`edged.candidate`), since a reload's may never."""
        self.state, self.error, self.model, self.paths = "failed", why, None, {}

    def observe(self, camera_id: str, done: Processed) -> None:
        """A frame the live model published: learn the camera's frame interval, charge the frame
        the trial's loop time after its capture, and keep every ``sample_every``-th for the
        candidate (a sample it never ran on counts as skipped).

        The charge is an upper bound of what the trial added to the frame's age: the frame waited
        at most until the end of each busy interval, and the loop might have been busy anyway.
        """
        frame = done.frame
        last = self._last.get(camera_id)
        self._last[camera_id] = (frame.frame_id, frame.t_capture_ns)
        if last is not None and frame.frame_id > last[0]:
            interval = (frame.t_capture_ns - last[1]) / (frame.frame_id - last[0])
            previous = self._interval_ns.get(camera_id)
            smoothed = interval if previous is None else previous + INTERVAL_SMOOTHING * (interval - previous)
            self._interval_ns[camera_id] = smoothed
        if self.state != "on_trial" or camera_id not in self.paths:
            return
        self.tally.delayed(self.busy.delay_ns(frame.t_capture_ns))
        self.busy.settle(min(captured for _, captured in self._last.values()))
        seen = self._seen[camera_id] = self._seen.get(camera_id, 0) + 1
        if seen % self.cfg.sample_every:
            return
        sample = self._samples.setdefault(camera_id, Sample(self.settings.model.max_det))
        self.tally.skipped_busy += sample.pending
        start = self._clock()
        sample.keep(done)
        self.busy.add(start, self._clock())

    def spare_s(self, cameras: Sequence[Camera], desk: RequestDesk | None) -> float:
        """How long the loop can give the candidate now: until the first camera's next frame is
        due (or its rate cap lets one be taken); nothing while a request is in hand, and no bound
        from a camera in request mode between requests."""
        now_s, now_ns = time.monotonic(), self._clock()
        spare = float("inf")
        for camera in cameras:
            if desk is not None and desk.request(camera) is not None:
                return 0.0
            if camera.mode != "free":
                continue  # a request may come at any time; it waits at most one candidate run
            last, interval = self._last.get(camera.id), self._interval_ns.get(camera.id)
            if last is None or interval is None:
                return 0.0  # its pace is not known yet
            spare = min(spare, max(camera.wait_s(now_s), (last[1] + interval - now_ns) / 1e9))
        return spare  # with only cameras in request mode, between requests: as long as it takes

    def run(self, spare_s: float) -> bool:
        """Run the candidate on one waiting sample if it fits in ``spare_s``; returns whether it ran."""
        if self.state != "on_trial":
            return False
        for camera_id, sample in self._samples.items():
            if not sample.pending or sample.frame is None:
                continue
            estimate = self.tally.p99_s()
            if spare_s <= (estimate if estimate is not None else sample.live_s) * HEADROOM_FACTOR:
                return False
            sample.pending = False
            self._try(camera_id, sample, sample.frame)
            return True
        return False

    def _try(self, camera_id: str, sample: Sample, frame: Frame) -> None:
        """One candidate run and its comparison; the loop time all of it took is charged to the live frames."""
        start = self._clock()
        try:
            self._compare(camera_id, sample, frame, start)
        finally:
            self.busy.add(start, self._clock())

    def _compare(self, camera_id: str, sample: Sample, frame: Frame, start: int) -> None:
        try:
            outcome = self.paths[camera_id].run(frame)
        except EdgedError as e:
            outcome = Rejected(frame, "inference_error", str(e))
        self.tally.timed((self._clock() - start) / 1e9)
        if isinstance(outcome, Rejected):
            if outcome.reason == "inference_error":
                self._failed_frame(camera_id, frame, outcome.detail)
            return
        problems = [(problem, count) for problem, count in outcome.result.problems() if problem in SPOILING]
        if problems:  # a thinned outline alone leaves the boxes to compare
            self._failed_frame(camera_id, frame, ", ".join(f"{problem} ({count})" for problem, count in problems))
            return
        n = sample.found
        live = Detections(sample.xyxy[:n], sample.scores[:n], sample.class_ids[:n])
        found = match(live, boxes_of(outcome.result))
        if not self.tally.add(sample.verdict, trial_verdict(outcome), found):
            self._save(camera_id, sample, live, outcome)

    def _failed_frame(self, camera_id: str, frame: Frame, why: str) -> None:
        self.tally.failed_frames += 1
        self.error = f"camera {camera_id} frame {frame.frame_id}: {why}"
        if self.tally.failed_frames == 1:
            log.error("the candidate failed on a frame (the live path is not affected): %s", self.error)

    def _save(self, camera_id: str, sample: Sample, live: Detections, outcome: Processed) -> None:
        """The frame the models disagree on, to ``evidence_dir`` through an evidence writer of its own
        (saved on its thread, rate-limited and pruned as `[evidence]` is): the image, the live
        model's boxes as its label, and a JSON of both models' verdicts and boxes."""
        folder, frame = self.cfg.evidence_dir, sample.frame
        if folder is None or frame is None or self.model is None:
            return
        writer = self._writers.get(camera_id)
        if writer is None:
            others = {cfg.camera_id: folder / cfg.camera_id for cfg in self.settings.source if cfg.camera_id != camera_id}
            writer = EvidenceWriter(EvidenceConfig(dir=folder, save="all"), camera_id, others=others)
            self._writers[camera_id] = writer
            writer.start()
        record = {
            "camera_id": camera_id,
            "frame_id": frame.frame_id,
            "capture_time_ns": frame.t_wall_ns,
            "live": {"verdict": sample.verdict, "detections": _boxes(live)},
            "candidate": {
                "model": self.model.info.model_dump(),
                "verdict": trial_verdict(outcome),
                "detections": _boxes(boxes_of(outcome.result)),
            },
        }
        task, names = self._labels
        record_bytes = json.dumps(record).encode()
        labelled: TaskResult = live
        if isinstance(outcome.result, Classes):  # filed under the live model's class, as boxes are labelled with its
            class_ids, scores = ([sample.top[0]], [sample.top[1]]) if sample.top is not None else ([], [])
            labelled = Classes(np.array(class_ids, np.int64), np.array(scores, np.float32))
        writer.offer(
            frame,
            outcome.result,
            None,
            record_bytes,
            names=names,
            task=task,
            labelled=labelled,
            region=outcome.plan.region,
        )

    def close(self) -> None:
        """Finish saving the disagreeing frames queued."""
        for writer in self._writers.values():
            writer.stop(EVIDENCE_STOP_WAIT_S)

    def gate(self) -> str | None:
        """Why the candidate may not be promoted now; None when it passed the gate."""
        cfg, tally = self.cfg, self.tally
        if self.state != "on_trial" or self.model is None:
            return "the candidate is live already" if self.state == "live" else f"no candidate on trial: {self.error}"
        if tally.frames < cfg.min_frames:
            return f"compared on {tally.frames} frame(s) of the {cfg.min_frames} the gate asks for"
        agreement = tally.agreement() or 0.0
        if agreement < cfg.min_agreement:
            return f"the models agree on {agreement:.1%} of the frames, below the gate's {cfg.min_agreement:.1%}"
        for cls, share in sorted(tally.missing().items()):
            if share > cfg.max_missing:
                label = self.model.label(cls)
                return f"the candidate misses {share:.1%} of the live model's {label} boxes, above {cfg.max_missing:.1%}"
        return None

    def promote(self, live: Swap) -> Swap:
        """The candidate and its frame paths, to go live; ``live`` is kept for `rollback`."""
        assert self.model is not None  # promoted only on trial, with its model loaded
        self._previous, self.state = live, "live"
        for sample in self._samples.values():
            sample.pending = False
        return Swap(self.model, dict(self.paths))

    def rollback(self) -> Swap | None:
        """The model a promotion replaced, to go live again, and the candidate back on trial from
        zero; None when nothing was promoted."""
        previous = self._previous
        if previous is None or self.state != "live":
            return None
        self._previous, self.state, self.tally, self._seen = None, "on_trial", Tally(), {}
        return previous

    @property
    def previous(self) -> LoadedModel | None:
        return self._previous.model if self._previous is not None else None

    def follower(self) -> FollowFor | None:
        """What a provider fallback starting now loads for the candidate, on its own thread: the
        accelerator broke, and the candidate moves to the providers left with the live model.

        On trial, a fresh trial beside the fallback's model, from zero: the runs on the dropped
        provider, failed or not, and the latency there (which sets how much of the loop's spare time
        the candidate takes, `spare_s`) say nothing of the candidate where it would now run, and the
        live model it is compared with moved too; kept, its frames failed there would hold it below
        the gate however good it is. Promoted, the model kept for rollback loaded again on the
        providers left (`kept_on`), so that an urgent rollback is instant and brings back no provider
        that fails: loaded at once rather than at rollback, which would load on the loop's thread or
        keep the operator waiting; the memory it takes is the kept model's, freed once it is replaced.
        None for a trial that is off, which stays off until a reload.

        Asked on the loop's thread as the fallback starts: the candidate's state changes only with
        the live model (a promotion, a rollback, a reload), and a fallback switches in only over
        the model it was loaded for (`edged.reload.Fallback.takes_over`), so what it loads here
        still fits the candidate then."""
        if self.model is None:
            return None
        if self.state == "live" and self._previous is not None:
            return functools.partial(kept_on, self._previous.model)
        cfg = self.cfg
        return lambda settings, live: Followed(trial=Shadow(settings, cfg, live.model))

    def fell_back(self, live: Swap, kept: Swap | None) -> None:
        """A provider fallback switched in ``live`` for the promoted candidate: the same model on the
        providers left, the candidate's own from now on (a rollback puts it back on trial there), and
        ``kept``, the model kept for rollback on them too, in place of the one on the provider
        dropped (None where it did not load: that one stays kept)."""
        self.model, self.paths = live.model, dict(live.paths)
        if kept is not None:
            self._previous = kept

    def report(self) -> CandidateReport:
        tally = self.tally
        names = self.model.label if self.model is not None else str
        matched = sum(tally.matched.values())
        shown = self.previous if self.state == "live" else self.model
        agreement = tally.agreement()
        return CandidateReport(
            state=self.state,
            model=shown.info if shown is not None else None,
            error=self.error,
            frames=tally.frames,
            skipped_busy=tally.skipped_busy,
            failed_frames=tally.failed_frames,
            agreement=round(agreement, 4) if agreement is not None else None,
            verdicts=dict(tally.verdicts),
            classes={
                names(cls): ClassAgreement(
                    matched=tally.matched.get(cls, 0),
                    live_only=tally.live_only.get(cls, 0),
                    candidate_only=tally.candidate_only.get(cls, 0),
                )
                for cls in sorted(tally.matched.keys() | tally.live_only.keys() | tally.candidate_only.keys())
            },
            score_shift=round(tally.shift_sum / matched, 4) if matched else None,
            latency=_summary(tally.latency),
            disagreements_saved=sum(writer.saved for writer in self._writers.values()),
            gate=self.gate(),
            live_frames=tally.live_frames,
            live_delayed=tally.live_delayed,
            live_delay_ms=round(tally.live_delay_ns / 1e6 / tally.live_frames, 4) if tally.live_frames else None,
            live_delay=_summary(tally.live_delays),
        )


def _summary(window: LatencyWindow) -> StageLatency | None:
    """The window's p50 and p99; None before its first sample."""
    got = window.percentiles(50, 99)
    return StageLatency(p50_ms=got[0], p99_ms=got[1]) if got is not None else None


def _boxes(detections: Detections) -> list[dict[str, object]]:
    return [
        {"class_id": int(cls), "score": round(float(score), 4), "box": [round(float(v), 1) for v in box]}
        for box, score, cls in zip(
            detections.xyxy.tolist(), detections.scores.tolist(), detections.class_ids.tolist(), strict=True
        )
    ]
