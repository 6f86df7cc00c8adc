"""Prometheus metrics: edged's counters, histograms and gauges in the text exposition format.

Nothing is counted here. The families are built at scrape time from the last status message and
the stage histograms the loop handed over with it (`edged.stats`), so ``/metrics``, the status
message and ``systemctl status`` report the same numbers; they are as fresh as
``publish.status_interval_s``. The registry is edged's own, not prometheus-client's process-wide
default, so nothing else in the process leaks into the exposition.

Names follow Prometheus' conventions: the ``edged_`` prefix, base units (seconds, celsius),
``_total`` on counters, ``_info`` for build metadata, low-cardinality labels only. What is per
camera carries a ``camera`` label (its ``camera_id``); thermal state, memory and build are the board's.
With ``[inspect]`` the verdicts come too, counted since start by `edged.stats` and handed over with
the status: NG reasons are labelled by camera, class and zone, so their cardinality is at most the
cameras times the classes times the zones. With ``[evidence]``, each writer's counters from the status;
with ``[opcua]``, the server's clients and counters;
with ``[model.candidate]``, the shadow trial's (the board's), boxes labelled by class and outcome.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import get_args

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from edged import __version__
from edged.messages import StageLatency, StatusMessage, Verdict
from edged.stats import BUCKETS_MS, HistogramCounts, VerdictCounts
from edged.thermal_readers import THROTTLED_BITS

STAGE_NAMES = ("preprocess", "inference", "decode")
THERMAL_STATES = ("unknown", "ok", "warm", "throttled", "critical")


# One camera's status, stage histograms and verdicts (None without [inspect]).
CameraStatus = tuple[StatusMessage, Mapping[str, HistogramCounts], VerdictCounts | None]


ACCEPT_FAILED_HELP = "Connections not taken for want of a file descriptor or memory (each waited in the backlog)."


class Metrics:
    """The registry behind ``/metrics`` and the latest figures it exposes, per camera (label ``camera``)."""

    def __init__(self, refused: Callable[[], Mapping[str, int]] | None = None) -> None:
        """``refused``: the HTTP server's refusals by reason, read at every scrape."""
        self.registry = CollectorRegistry(auto_describe=False)
        self._refused = refused
        self._lock = threading.Lock()
        self._cameras: Sequence[CameraStatus] = ()
        self.registry.register(self)

    def update(self, cameras: Sequence[CameraStatus]) -> None:
        """Every camera's latest status: a camera no longer here has no series any more."""
        with self._lock:
            self._cameras = cameras

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        if self._refused is not None:
            refused = CounterMetricFamily(
                "edged_http_refused",
                "HTTP connections and requests refused, by reason (limits, deadlines, unknown Host).",
                labels=["reason"],
            )
            for reason, count in self._refused().items():
                refused.add_metric([reason], count)
            yield refused
        with self._lock:
            cameras = self._cameras
        if not cameras:
            return
        first = cameras[0][0]  # thermal state, memory and model are the board's: any camera's say them
        yield from _frames([status for status, _, _ in cameras])
        yield from _latency(cameras)
        yield from _thermal(first)
        yield from _memory(first)
        yield from _verdicts([(status.camera_id, verdicts) for status, _, verdicts in cameras if verdicts is not None])
        yield from _evidence([status for status, _, _ in cameras])
        yield from _journal([status for status, _, _ in cameras])
        yield from _reject([status for status, _, _ in cameras])
        yield from _opcua(first)
        yield from _candidate(first)
        yield from _modbus(first)
        yield InfoMetricFamily(
            "edged_build",
            "edged's version and the model it runs.",
            value={
                "version": __version__,
                "model": first.model.name,
                "model_sha256": first.model.sha256,
                "provider": first.model.provider,
            },
        )


def _frames(statuses: Sequence[StatusMessage]) -> Iterator[Metric]:
    frames = CounterMetricFamily("edged_frames", "Frames processed by the model.", labels=["camera"])
    dropped = CounterMetricFamily(
        "edged_frames_dropped", "Frames (and messages) not processed or sent, by cause.", labels=["camera", "reason"]
    )
    up = GaugeMetricFamily(
        "edged_source_up", "1 while the camera delivers frames, 0 while starting, lost or ended.", labels=["camera"]
    )
    captured = CounterMetricFamily("edged_frames_captured", "Frames taken off the camera.", labels=["camera"])
    reconnects = CounterMetricFamily(
        "edged_source_reconnects", "Times the camera was reopened after being lost.", labels=["camera"]
    )
    cap = GaugeMetricFamily(
        "edged_rate_cap_fps",
        "The frame-rate cap now in force (thermal or max_fps); 0 when uncapped.",
        labels=["camera"],
    )
    for status in statuses:
        camera = status.camera_id
        frames.add_metric([camera], status.frames_processed)
        for reason, count in sorted(status.drops.items()):
            dropped.add_metric([camera, reason], count)
        up.add_metric([camera], 1.0 if status.source_state == "ok" else 0.0)
        if status.capture is not None:
            captured.add_metric([camera], status.capture.frames_captured)
            reconnects.add_metric([camera], status.capture.reconnects)
        cap.add_metric([camera], status.rate_cap_fps or 0.0)
    yield from (frames, dropped, up, captured, reconnects, cap)


def _buckets(counts: HistogramCounts) -> list[tuple[str, float]]:
    bounds = [(repr(ms / 1000), float(n)) for ms, n in zip(BUCKETS_MS, counts.buckets, strict=True)]
    return [*bounds, ("+Inf", float(counts.count))]


def _latency(cameras: Sequence[CameraStatus]) -> Iterator[Metric]:
    stages = HistogramMetricFamily(
        "edged_stage_duration_seconds", "Time per frame in each stage of the pipeline.", labels=["camera", "stage"]
    )
    age = HistogramMetricFamily(
        "edged_frame_age_seconds",
        "Capture to result: how old a frame is when its detections are ready.",
        labels=["camera"],
    )
    for status, histograms, _ in cameras:
        for stage in STAGE_NAMES:
            if stage in histograms:
                counts = histograms[stage]
                stages.add_metric([status.camera_id, stage], _buckets(counts), counts.sum_ms / 1000)
        if "age" in histograms:
            counts = histograms["age"]
            age.add_metric([status.camera_id], _buckets(counts), counts.sum_ms / 1000)
    yield stages
    if age.samples:
        yield age


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


def _memory(status: StatusMessage) -> Iterator[Metric]:
    memory = status.memory
    if memory is None:
        return
    yield GaugeMetricFamily(
        "edged_memory_limit_bytes", "The memory limit of edged's cgroup (MemoryMax=).", value=memory.limit_bytes
    )
    yield GaugeMetricFamily(
        "edged_memory_used_bytes",
        "edged's cgroup's memory use less the page cache the kernel drops first: what it would reclaim last.",
        value=memory.used_bytes,
    )
    yield GaugeMetricFamily(
        "edged_memory_cgroup_bytes", "edged's cgroup's memory use, page cache included.", value=memory.cgroup_bytes
    )
    if memory.oom_kills is not None:
        yield CounterMetricFamily(
            "edged_memory_oom_kills", "Processes of edged's cgroup the kernel's OOM killer ended.", value=memory.oom_kills
        )


def _verdicts(cameras: Sequence[tuple[str, VerdictCounts]]) -> Iterator[Metric]:
    if not cameras:
        return
    by_verdict = CounterMetricFamily("edged_verdicts", "Inspected frames by verdict.", labels=["camera", "verdict"])
    reasons = CounterMetricFamily(
        "edged_ng_reasons",
        'Detections that made a frame NG, by class and zone (zone "" when no zones are set).',
        labels=["camera", "class", "zone"],
    )
    latency = HistogramMetricFamily(
        "edged_verdict_latency_seconds", "Capture to verdict of each inspected frame.", labels=["camera"]
    )
    for camera, verdicts in cameras:
        for verdict in get_args(Verdict):
            by_verdict.add_metric([camera, verdict], verdicts.verdicts[verdict])
        for (label, zone), count in sorted(verdicts.ng_reasons.items()):
            reasons.add_metric([camera, label, zone], count)
        latency.add_metric([camera], _buckets(verdicts.latency), verdicts.latency.sum_ms / 1000)
    yield from (by_verdict, reasons, latency)


def _evidence(statuses: Sequence[StatusMessage]) -> Iterator[Metric]:
    writers = [(status.camera_id, status.evidence) for status in statuses if status.evidence is not None]
    if not writers:
        return
    saved = CounterMetricFamily("edged_evidence_saved", "Frames saved as evidence.", labels=["camera"])
    dropped = CounterMetricFamily(
        "edged_evidence_dropped", "Evidence frames dropped because the writer's queue was full.", labels=["camera"]
    )
    errors = CounterMetricFamily(
        "edged_evidence_errors", "Evidence saves or retention passes that failed (disk full, read-only).", labels=["camera"]
    )
    limited = CounterMetricFamily(
        "edged_evidence_rate_limited", "Evidence frames refused by evidence.max_per_minute.", labels=["camera"]
    )
    held = GaugeMetricFamily("edged_evidence_bytes", "Bytes the camera's evidence folders hold.", labels=["camera"])
    for camera, evidence in writers:
        saved.add_metric([camera], evidence.saved)
        dropped.add_metric([camera], evidence.dropped)
        errors.add_metric([camera], evidence.errors)
        limited.add_metric([camera], evidence.rate_limited)
        held.add_metric([camera], evidence.bytes)
    yield from (saved, dropped, errors, limited, held)


def _opcua(status: StatusMessage) -> Iterator[Metric]:
    """The OPC UA server's, the board's one: any camera's status says it."""
    server = status.opcua
    if server is None:
        return
    yield GaugeMetricFamily(
        "edged_opcua_serving", "1 while the OPC UA server listens and takes clients.", value=server.serving
    )
    yield GaugeMetricFamily("edged_opcua_clients", "OPC UA client connections now.", value=server.clients)
    yield CounterMetricFamily("edged_opcua_accept_failed", ACCEPT_FAILED_HELP, value=server.accept_failed)
    yield CounterMetricFamily("edged_opcua_requests", "OPC UA Trigger calls answered.", value=server.requests)
    yield CounterMetricFamily("edged_opcua_refused", "OPC UA sign-ins refused.", value=server.refused)
    yield CounterMetricFamily("edged_opcua_updates", "Verdicts written to the OPC UA nodes.", value=server.updates)
    yield _quantiles(
        "edged_opcua_update_seconds", "Capture to OPC UA node update over the last verdicts: p50 and p99.", server.update_ms
    )


def _journal(statuses: Sequence[StatusMessage]) -> Iterator[Metric]:
    """Entries per camera; errors and size are the one journal's."""
    journals = [(status.camera_id, status.journal) for status in statuses if status.journal is not None]
    if not journals:
        return
    per_camera = {
        "recorded": CounterMetricFamily("edged_journal_recorded", "Entries written to the journal.", labels=["camera"]),
        "dropped": CounterMetricFamily(
            "edged_journal_dropped", "Journal entries dropped: the disk fell too far behind.", labels=["camera"]
        ),
    }
    for camera, journal in journals:
        for name, family in per_camera.items():
            family.add_metric([camera], getattr(journal, name))
    board = journals[0][1]
    yield from per_camera.values()
    yield CounterMetricFamily(
        "edged_journal_errors",
        "Journal writes or retention passes that failed (disk full, read-only), and journal files found removed or "
        "replaced under edged (opened anew).",
        value=board.errors,
    )
    yield GaugeMetricFamily("edged_journal_bytes", "Bytes the journal holds, at its last retention pass.", value=board.bytes)
    yield CounterMetricFamily(
        "edged_journal_unsent_deleted",
        "Verdicts deleted for room (journal.max_bytes) before the broker acknowledged them: never sent.",
        value=board.unsent_deleted,
    )


def _reject(statuses: Sequence[StatusMessage]) -> Iterator[Metric]:
    """Each camera's reject line: what it fired, and how close to its deadlines."""
    lines = [(status.camera_id, status.reject) for status in statuses if status.reject is not None]
    if not lines:
        return
    counters = {
        "pulses": "Reject pulses fired (merged ones count once).",
        "late": "Parts with no verdict by their deadline (capture + reject.delay_ms).",
        "late_fired": "Parts rejected without a verdict at their deadline (late = 'reject', the fail-safe).",
        "late_verdicts": "Verdicts that came after their part's deadline, ignored.",
        "merged": "Reject pulses merged into the one before (closer than reject.min_gap_ms).",
        "dropped": "Parts to be ejected whose pulse could not be fired (the line's process ended or was down).",
    }
    families = {
        name: CounterMetricFamily(f"edged_reject_{name}", text, labels=["camera"]) for name, text in counters.items()
    }
    lateness = GaugeMetricFamily(
        "edged_reject_lateness_seconds", "Pulse start minus its target over the last pulses.", labels=["camera", "stat"]
    )
    margin = GaugeMetricFamily(
        "edged_reject_margin_seconds",
        "Target minus verdict time over the last verdicts: shrinking warns of late rejects.",
        labels=["camera", "stat"],
    )
    alarm = GaugeMetricFamily(
        "edged_reject_alarm", "1 while the alarm line is active (late = 'alarm', or parts dropped).", labels=["camera"]
    )
    for camera, report in lines:
        for name, family in families.items():
            family.add_metric([camera], getattr(report, name))
        for stat, ms in (("p50", report.lateness_p50_ms), ("p99", report.lateness_p99_ms), ("max", report.lateness_max_ms)):
            lateness.add_metric([camera, stat], ms / 1000)
        for stat, maybe in (("p1", report.margin_p1_ms), ("p50", report.margin_p50_ms)):
            if maybe is not None:
                margin.add_metric([camera, stat], maybe / 1000)
        alarm.add_metric([camera], 1.0 if report.alarm else 0.0)
    yield from (*families.values(), lateness, margin, alarm)


def _candidate(status: StatusMessage) -> Iterator[Metric]:
    """The shadow trial of ``[model.candidate]``: the board's, said by any camera's status."""
    trial = status.candidate
    if trial is None:
        return
    model = trial.model
    yield InfoMetricFamily(
        "edged_candidate",
        "The candidate model on trial and its state (on_trial, failed, live).",
        value={"state": trial.state, "model": model.name if model else "", "model_sha256": model.sha256 if model else ""},
    )
    yield CounterMetricFamily("edged_candidate_frames", "Live frames the candidate was compared on.", value=trial.frames)
    yield CounterMetricFamily(
        "edged_candidate_skipped_busy", "Sampled frames the candidate never ran on: no headroom.", value=trial.skipped_busy
    )
    yield CounterMetricFamily(
        "edged_candidate_failed_frames", "Sampled frames the candidate failed on (error, NaN).", value=trial.failed_frames
    )
    yield GaugeMetricFamily(
        "edged_candidate_gate_passed", "1 when edged promote would promote the candidate now.", value=trial.gate is None
    )
    if trial.agreement is not None:
        yield GaugeMetricFamily(
            "edged_candidate_agreement", "Share of compared frames both models agree on.", value=trial.agreement
        )
    if trial.score_shift is not None:
        yield GaugeMetricFamily(
            "edged_candidate_score_shift", "Mean candidate minus live score over matched boxes.", value=trial.score_shift
        )
    verdicts = CounterMetricFamily(
        "edged_candidate_verdicts", "Compared frames by live and candidate verdict.", labels=["live", "candidate"]
    )
    for pair, count in trial.verdicts.items():
        verdicts.add_metric(pair.split("/", 1), count)
    yield verdicts
    boxes = CounterMetricFamily(
        "edged_candidate_boxes", "Boxes by class: matched, live_only, candidate_only.", labels=["class", "outcome"]
    )
    for label, agreement in trial.classes.items():
        for outcome in ("matched", "live_only", "candidate_only"):
            boxes.add_metric([label, outcome], getattr(agreement, outcome))
    yield boxes
    if trial.latency is not None:
        yield _quantiles("edged_candidate_latency_seconds", "The candidate's latency per frame.", trial.latency)
    yield CounterMetricFamily(
        "edged_candidate_live_frames", "Live frames published while the candidate was on trial.", value=trial.live_frames
    )
    yield CounterMetricFamily(
        "edged_candidate_live_delayed",
        "Live frames that may have waited for the trial's time on the loop.",
        value=trial.live_delayed,
    )
    if trial.live_delay_ms is not None:
        yield GaugeMetricFamily(
            "edged_candidate_live_delay_mean_seconds",
            "Frame age the trial added per live frame, an upper bound.",
            value=trial.live_delay_ms / 1e3,
        )
    if trial.live_delay is not None:
        yield _quantiles(
            "edged_candidate_live_delay_seconds", "Frame age the trial added to a delayed frame.", trial.live_delay
        )


def _quantiles(name: str, documentation: str, latency: StageLatency) -> GaugeMetricFamily:
    """A latency's median and 99th percentile, in seconds, labelled ``stat`` (``p50``, ``p99``) as the
    reject line's are: a ``quantile`` label is a summary's alone (promtool refuses it on a gauge)."""
    gauge = GaugeMetricFamily(name, documentation, labels=["stat"])
    gauge.add_metric(["p50"], latency.p50_ms / 1e3)
    gauge.add_metric(["p99"], latency.p99_ms / 1e3)
    return gauge


def _modbus(status: StatusMessage) -> Iterator[Metric]:
    """The Modbus server's clients and requests: the board's, so any camera's status says them."""
    modbus = status.modbus
    if modbus is None:
        return
    yield GaugeMetricFamily("edged_modbus_clients", "Modbus TCP clients connected.", value=modbus.clients)
    yield CounterMetricFamily("edged_modbus_accept_failed", ACCEPT_FAILED_HELP, value=modbus.accept_failed)
    yield CounterMetricFamily(
        "edged_modbus_requests", "Modbus requests answered, exceptions included.", value=modbus.requests
    )
    yield CounterMetricFamily(
        "edged_modbus_exceptions", "Modbus requests answered with an exception.", value=modbus.exceptions
    )
    refused = CounterMetricFamily(
        "edged_modbus_connections_dropped",
        "Modbus connections closed by edged: beyond max_connections, leaving their answers unread, or silent "
        "when a new client needed the room.",
        labels=["reason"],
    )
    refused.add_metric(["max_connections"], modbus.refused)
    refused.add_metric(["unread"], modbus.unread)
    refused.add_metric(["reclaimed"], modbus.reclaimed)
    yield refused
    yield CounterMetricFamily(
        "edged_modbus_triggers", "Inspection requests taken through a Modbus coil.", value=modbus.triggers
    )
