"""Prometheus metrics: edged's counters, histograms and gauges in the text exposition format.

Nothing is counted here. The families are built at scrape time from the last status message and
the stage histograms the loop handed over with it (`edged.stats`), so ``/metrics``, the status
message and ``systemctl status`` report the same numbers; they are as fresh as
``publish.status_interval_s``. The registry is edged's own, not prometheus-client's process-wide
default, so nothing else in the process leaks into the exposition.

Names follow Prometheus' conventions: the ``edged_`` prefix, base units (seconds, celsius),
``_total`` on counters, ``_info`` for build metadata, low-cardinality labels only. With
``[inspect]`` the verdicts come too, counted since start by `edged.stats` and handed over with the
status: NG reasons are labelled by class and zone, so their cardinality is at most the classes
times the zones of the configuration. With ``[evidence]``, the writer's counters from the status.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from edged import __version__
from edged.messages import StatusMessage
from edged.stats import BUCKETS_MS, HistogramCounts, VerdictCounts
from edged.thermal_readers import THROTTLED_BITS

STAGE_NAMES = ("preprocess", "inference", "decode")
THERMAL_STATES = ("unknown", "ok", "warm", "throttled", "critical")


class Metrics:
    """The registry behind ``/metrics`` and the latest figures it exposes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._lock = threading.Lock()
        self._status: StatusMessage | None = None
        self._histograms: Mapping[str, HistogramCounts] = {}
        self._verdicts: VerdictCounts | None = None
        self.registry.register(self)

    def update(
        self, status: StatusMessage, histograms: Mapping[str, HistogramCounts], verdicts: VerdictCounts | None = None
    ) -> None:
        with self._lock:
            self._status, self._histograms, self._verdicts = status, histograms, verdicts

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            status, histograms, verdicts = self._status, self._histograms, self._verdicts
        if status is None:
            return
        yield from _frames(status)
        yield from _latency(histograms)
        yield from _thermal(status)
        if verdicts is not None:
            yield from _verdicts(verdicts)
        yield from _evidence(status)
        yield InfoMetricFamily(
            "edged_build",
            "edged's version and the model it runs.",
            value={
                "version": __version__,
                "model": status.model.name,
                "model_sha256": status.model.sha256,
                "provider": status.model.provider,
            },
        )


def _frames(status: StatusMessage) -> Iterator[Metric]:
    yield CounterMetricFamily("edged_frames", "Frames processed by the model.", value=status.frames_processed)
    dropped = CounterMetricFamily(
        "edged_frames_dropped", "Frames (and messages) not processed or sent, by cause.", labels=["reason"]
    )
    for reason, count in sorted(status.drops.items()):
        dropped.add_metric([reason], count)
    yield dropped
    up = GaugeMetricFamily("edged_source_up", "1 while the camera delivers frames, 0 while starting, lost or ended.")
    up.add_metric([], 1.0 if status.source_state == "ok" else 0.0)
    yield up
    if status.capture is not None:
        yield CounterMetricFamily(
            "edged_frames_captured", "Frames taken off the camera.", value=status.capture.frames_captured
        )
        yield CounterMetricFamily(
            "edged_source_reconnects", "Times the camera was reopened after being lost.", value=status.capture.reconnects
        )
    yield GaugeMetricFamily(
        "edged_rate_cap_fps",
        "The frame-rate cap now in force (thermal or service.max_fps); 0 when uncapped.",
        value=status.rate_cap_fps or 0.0,
    )


def _buckets(counts: HistogramCounts) -> list[tuple[str, float]]:
    bounds = [(repr(ms / 1000), float(n)) for ms, n in zip(BUCKETS_MS, counts.buckets, strict=True)]
    return [*bounds, ("+Inf", float(counts.count))]


def _latency(histograms: Mapping[str, HistogramCounts]) -> Iterator[Metric]:
    stages = HistogramMetricFamily(
        "edged_stage_duration_seconds", "Time per frame in each stage of the pipeline.", labels=["stage"]
    )
    for stage in STAGE_NAMES:
        if stage in histograms:
            counts = histograms[stage]
            stages.add_metric([stage], _buckets(counts), counts.sum_ms / 1000)
    yield stages
    if "age" in histograms:
        age = histograms["age"]
        yield HistogramMetricFamily(
            "edged_frame_age_seconds",
            "Capture to result: how old a frame is when its detections are ready.",
            buckets=_buckets(age),
            sum_value=age.sum_ms / 1000,
        )


def _thermal(status: StatusMessage) -> Iterator[Metric]:
    if status.thermal is None:
        return
    temperatures = GaugeMetricFamily("edged_soc_temperature_celsius", "Temperature of each thermal zone.", labels=["zone"])
    for zone, celsius in sorted(status.thermal.zones.items()):
        temperatures.add_metric([zone], float(celsius))
    yield temperatures
    active = set(status.thermal.throttled_flags)
    throttled = GaugeMetricFamily(
        "edged_throttled", "1 where the firmware reports this throttling flag (Raspberry Pi get_throttled).", labels=["flag"]
    )
    for _, flag in THROTTLED_BITS:
        throttled.add_metric([flag], 1.0 if flag in active else 0.0)
    yield throttled
    state = GaugeMetricFamily("edged_thermal_state", "1 for edged's current thermal state.", labels=["state"])
    for name in THERMAL_STATES:
        state.add_metric([name], 1.0 if status.thermal.state == name else 0.0)
    yield state


def _verdicts(verdicts: VerdictCounts) -> Iterator[Metric]:
    by_verdict = CounterMetricFamily("edged_verdicts", "Inspected frames by verdict.", labels=["verdict"])
    for verdict in ("ok", "ng"):
        by_verdict.add_metric([verdict], verdicts.verdicts[verdict])
    yield by_verdict
    reasons = CounterMetricFamily(
        "edged_ng_reasons",
        'Detections that made a frame NG, by class and zone (zone "" when no zones are set).',
        labels=["class", "zone"],
    )
    for (label, zone), count in sorted(verdicts.ng_reasons.items()):
        reasons.add_metric([label, zone], count)
    yield reasons
    latency = verdicts.latency
    yield HistogramMetricFamily(
        "edged_verdict_latency_seconds",
        "Capture to verdict of each inspected frame.",
        buckets=_buckets(latency),
        sum_value=latency.sum_ms / 1000,
    )


def _evidence(status: StatusMessage) -> Iterator[Metric]:
    evidence = status.evidence
    if evidence is None:
        return
    yield CounterMetricFamily("edged_evidence_saved", "Frames saved as evidence.", value=evidence.saved)
    yield CounterMetricFamily(
        "edged_evidence_dropped", "Evidence frames dropped because the writer's queue was full.", value=evidence.dropped
    )
    yield CounterMetricFamily(
        "edged_evidence_errors",
        "Evidence saves or retention passes that failed (disk full, read-only).",
        value=evidence.errors,
    )
    yield CounterMetricFamily(
        "edged_evidence_rate_limited", "Evidence frames refused by evidence.max_per_minute.", value=evidence.rate_limited
    )
    yield GaugeMetricFamily("edged_evidence_bytes", "Bytes the camera's evidence folder holds.", value=evidence.bytes)
