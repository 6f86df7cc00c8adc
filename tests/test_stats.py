"""Run statistics: the verdicts counted since start, the latest few kept for the status page, the latency windows."""

from __future__ import annotations

import numpy as np

from edged.messages import Reason, StageLatency
from edged.stats import VERDICTS_KEPT, LatencyWindow, RunStats, VerdictRecord


def test_verdicts_are_counted_and_only_the_latest_are_kept_newest_first() -> None:
    stats = RunStats()
    scratch = Reason(detection=1, class_id=0, label="scratch", score=0.8, zone=None)
    for frame_id in range(VERDICTS_KEPT + 5):
        ng = frame_id % 5 == 0
        stats.record_verdict(VerdictRecord(frame_id, frame_id, None, "ng" if ng else "ok", (scratch,) if ng else ()), 3.0)
    counts = stats.verdict_counts()
    assert counts.verdicts == {"ok": 20, "ng": 5, "uncertain": 0}
    assert counts.ng_reasons == {("scratch", ""): 5}  # no zones: the zone label is empty
    assert counts.latency.count == VERDICTS_KEPT + 5
    assert [r.frame_id for r in counts.latest] == list(range(VERDICTS_KEPT + 4, 4, -1))
    assert RunStats().verdict_counts().verdicts == {"ok": 0, "ng": 0, "uncertain": 0}


def test_latency_percentiles_are_numpys_before_and_after_the_window_wraps() -> None:
    rng = np.random.default_rng(0)
    window = LatencyWindow(size=100)
    assert window.percentiles(50) is None
    assert window.summary() == StageLatency(p50_ms=0.0, p99_ms=0.0)
    samples = rng.exponential(3.0, 250).round(3)  # spread, as latencies have
    samples[::7] = samples[0]  # and ties
    for n, ms in enumerate(samples, 1):
        window.add(float(ms))
        if n in (1, 2, 7, 99, 100, 101, 250):
            kept = samples[max(0, n - 100) : n]
            qs = (0, 1, 12.5, 50, 99, 99.9, 100)
            assert window.percentiles(*qs) == [round(float(v), 3) for v in np.percentile(kept, qs)]
    p50, p99 = np.percentile(samples[-100:], (50, 99))
    assert window.summary() == StageLatency(p50_ms=round(float(p50), 3), p99_ms=round(float(p99), 3))
