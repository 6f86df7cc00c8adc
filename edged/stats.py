"""Run statistics: stage latencies and counters behind the status message, STATUS= and /metrics.

Latencies go into fixed-size ring buffers allocated once, so recording a frame's timings costs
a few float stores; percentiles are computed only when a status message is built. Each stage also
counts its samples into cumulative histogram buckets since start, which Prometheus can aggregate
across boards where percentiles cannot. With ``[inspect]``, verdicts and NG reasons are counted
the same way, and the latest few kept whole for the status page: a frame's verdict costs a few
dictionary adds and one small record, handed to the HTTP server with each status.
"""

from __future__ import annotations

import bisect
import math
import time
from array import array
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import get_args

from edged.messages import Reason, StageLatency, Verdict

STAGES = ("preprocess", "inference", "decode", "age")
# Histogram bucket upper bounds in milliseconds: a stage on an edge board takes from well under a
# millisecond (decode) to seconds (a large model on a Pi, a frame held up by a thermal pause).
BUCKETS_MS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0)
VERDICTS_KEPT = 20  # the latest verdicts the status page lists


@dataclass(frozen=True, slots=True)
class HistogramCounts:
    """One stage's histogram at one moment: samples at or below each of ``BUCKETS_MS``, cumulative."""

    buckets: tuple[int, ...]
    count: int
    sum_ms: float


class StageHistogram:
    """Cumulative bucket counts of one stage since start; observing a sample is a bisect and two adds."""

    def __init__(self) -> None:
        self._counts = [0] * (len(BUCKETS_MS) + 1)  # the last one: above every bound
        self._sum_ms = 0.0

    def observe(self, ms: float) -> None:
        self._counts[bisect.bisect_left(BUCKETS_MS, ms)] += 1
        self._sum_ms += ms

    def counts(self) -> HistogramCounts:
        cumulative, total = [], 0
        for n in self._counts:
            total += n
            cumulative.append(total)
        return HistogramCounts(tuple(cumulative[:-1]), total, self._sum_ms)


@dataclass(frozen=True, slots=True)
class VerdictRecord:
    """One inspected frame, as the status page lists it."""

    capture_time_ns: int
    frame_id: int
    part_id: str | None
    verdict: Verdict
    reasons: tuple[Reason, ...]


@dataclass(frozen=True, slots=True)
class VerdictCounts:
    """Inspection since start: frames by verdict, NG detections by (class, zone; "" without zones),
    capture-to-verdict latency, and the latest verdicts, newest first."""

    verdicts: Mapping[Verdict, int]
    ng_reasons: Mapping[tuple[str, str], int]
    latency: HistogramCounts
    latest: tuple[VerdictRecord, ...]


class LatencyWindow:
    """The last ``size`` samples of one stage, in milliseconds.

    Kept as C doubles in the standard library's `array`, without numpy: the reject line's process,
    which keeps two, then loads no numpy (12 MB of memory per camera).
    """

    def __init__(self, size: int = 1024) -> None:
        self._samples = array("d", bytes(8 * size))
        self._next = 0
        self._count = 0

    def add(self, ms: float) -> None:
        self._samples[self._next] = ms
        self._next = (self._next + 1) % len(self._samples)
        self._count = min(self._count + 1, len(self._samples))

    def percentiles(self, *qs: float) -> list[float] | None:
        """The samples' percentiles ``qs`` (100: the worst), rounded to µs; None before the first sample."""
        if self._count == 0:
            return None
        ordered = sorted(self._samples[: self._count])
        return [round(percentile(ordered, q), 3) for q in qs]

    def summary(self) -> StageLatency:
        p50, p99 = self.percentiles(50, 99) or (0.0, 0.0)
        return StageLatency(p50_ms=p50, p99_ms=p99)


def percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of the sorted samples, interpolated between the two nearest as
    numpy's default (``linear``) does, to the last bit: from the upper one when nearer to it."""
    at = q / 100 * (len(ordered) - 1)
    below = math.floor(at)
    t = at - below
    a, b = ordered[below], ordered[min(below + 1, len(ordered) - 1)]
    return b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t


class RunStats:
    """Counters and latency windows of one daemon run."""

    def __init__(self) -> None:
        self.started_ns = time.monotonic_ns()
        self.frames_processed = 0
        self.drops: Counter[str] = Counter()
        self.latency = {stage: LatencyWindow() for stage in STAGES}
        self.histogram = {stage: StageHistogram() for stage in STAGES}
        self._fps_mark = (self.started_ns, 0)
        self.fps = 0.0
        self._verdicts: Counter[Verdict] = Counter()
        self._ng_reasons: Counter[tuple[str, str]] = Counter()
        self._verdict_latency = StageHistogram()
        self._latest_verdicts: deque[VerdictRecord] = deque(maxlen=VERDICTS_KEPT)

    def record(self, preprocess_ms: float, inference_ms: float, decode_ms: float, age_ms: float) -> None:
        self.frames_processed += 1
        for stage, ms in (
            ("preprocess", preprocess_ms),
            ("inference", inference_ms),
            ("decode", decode_ms),
            ("age", age_ms),
        ):
            self.latency[stage].add(ms)
            self.histogram[stage].observe(ms)

    def record_verdict(self, record: VerdictRecord, latency_ms: float) -> None:
        """An inspected frame: its verdict and each detection that made it NG counted, the record kept."""
        self._verdicts[record.verdict] += 1
        for reason in record.reasons:
            self._ng_reasons[(reason.label, reason.zone or "")] += 1
        self._verdict_latency.observe(latency_ms)
        self._latest_verdicts.appendleft(record)

    def verdict_counts(self) -> VerdictCounts:
        return VerdictCounts(
            {verdict: self._verdicts[verdict] for verdict in get_args(Verdict)},
            dict(self._ng_reasons),
            self._verdict_latency.counts(),
            tuple(self._latest_verdicts),
        )

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

    def histograms(self) -> dict[str, HistogramCounts]:
        return {stage: histogram.counts() for stage, histogram in self.histogram.items()}
