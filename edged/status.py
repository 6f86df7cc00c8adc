"""What the daemon says about itself: the status message, systemd's STATUS= line, drops by cause.

Both are built from one snapshot of the running parts, so a subscriber and ``systemctl status``
never disagree. Each camera has its status message; the STATUS= line summarises them all. A status
round also reads edged's memory against its cgroup's limit (`edged.memory`), which warns as it nears it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from edged.camera import Camera
from edged.capture import CaptureStats
from edged.identity import Identity
from edged.memory import MIB, MemoryWatch, near_limit
from edged.messages import CandidateReport, CaptureReport, MemoryReadings, ModelInfo, StatusMessage
from edged.model import LoadedModel
from edged.output import OutputReport, StatusReport
from edged.outputs import Outputs
from edged.stats import RunStats
from edged.thermal import ThermalReport


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The running parts' state at one moment, as the status reports it."""

    camera_id: str
    stats: RunStats
    capture: CaptureStats
    rate_cap_fps: float | None
    thermal: ThermalReport | None
    model: ModelInfo
    model_short: str  # name@hash prefix, as the logs name the model
    outputs: Sequence[OutputReport] = ()  # what each output adds (`edged.output.Output.report`)
    candidate: CandidateReport | None = None  # the shadow trial's, the board's (`edged.shadow`)
    memory: MemoryReadings | None = None  # edged's cgroup's, read once a status round (`edged.memory`)

    def drops(self) -> dict[str, int]:
        """Frames and messages lost, by cause: the loop's, the capture thread's and the outputs'."""
        drops = dict(self.stats.drops)
        drops.update(self.capture.dropped.items())
        drops["read_error"] = self.capture.read_errors
        if self.capture.unreadable:
            drops["unreadable_image"] = self.capture.unreadable
        for output in self.outputs:
            drops.update(output.drops)
        return drops

    def outputs_line(self) -> str:
        return "".join(f" | {output.summary}" for output in self.outputs if output.summary)

    def message(self, seq: int) -> StatusMessage:
        cap = self.rate_cap_fps
        fields: dict[str, object] = {}
        for output in self.outputs:
            fields.update(output.fields)
        return StatusMessage(
            camera_id=self.camera_id,
            seq=seq,
            time_ns=time.time_ns(),
            uptime_s=round(self.stats.uptime_s(), 3),
            fps=round(self.stats.fps, 2),
            frames_processed=self.stats.frames_processed,
            source_state=self.capture.state,
            drops=self.drops(),
            latency=self.stats.latencies(),
            rate_cap_fps=round(cap, 2) if cap is not None else None,
            thermal=self.thermal.to_dict() if self.thermal else None,
            model=self.model,
            capture=CaptureReport(
                frames_captured=self.capture.frames_captured,
                frames_decoded=self.capture.frames_decoded,
                reconnects=self.capture.reconnects,
                size_changes=self.capture.size_changes,
                last_error=self.capture.last_error,
            ),
            candidate=self.candidate,
            memory=self.memory,
            **Identity.here().fields(),
            **fields,
        )

    def line(self) -> str:
        """systemd's one-line STATUS=."""
        thermal = self.thermal.summary() if self.thermal else "thermal off"
        cap = f" cap {self.rate_cap_fps:.1f}fps" if self.rate_cap_fps else ""
        return (
            f"{self.stats.fps:.1f} fps{cap} | camera {self.capture.state}{self.outputs_line()} | {thermal}"
            f"{self.memory_line()} | {self.stats.frames_processed} frames | model {self.model_short}"
        )

    def memory_line(self) -> str:
        """`` | memory N % of its limit`` while edged's use is near its cgroup's limit (`edged.memory.near_limit`):
        ``systemctl status`` shows it beside the warning the journal has; nothing otherwise."""
        memory = self.memory
        if memory is None or not near_limit(memory.used_bytes, memory.limit_bytes):
            return ""
        return f" | memory {100 * memory.used_bytes / memory.limit_bytes:.0f} % of its {memory.limit_bytes // MIB} MiB limit"


def summary_line(snapshots: Sequence[Snapshot], problem: str | None = None) -> str:
    """systemd's STATUS= for the whole board: one camera's own line, or every camera's rate and state,
    and then the health ``problem`` that withholds the watchdog's pings, if any (`edged.health`), so
    that ``systemctl status`` names a camera stuck in inference while the others flow.

    Thermal state and model are the board's, so they are said once; frames are the sum.
    """
    unhealthy = f" | unhealthy: {problem}" if problem else ""
    if len(snapshots) == 1:
        return snapshots[0].line() + unhealthy
    first = snapshots[0]
    thermal = first.thermal.summary() if first.thermal else "thermal off"
    cameras = ", ".join(f"{s.camera_id} {s.stats.fps:.1f} fps {s.capture.state}" for s in snapshots)
    frames = sum(s.stats.frames_processed for s in snapshots)
    outputs = first.outputs_line()
    board = f"{thermal}{first.memory_line()} | {frames} frames | model {first.model_short}{unhealthy}"
    return f"{len(snapshots)} cameras: {cameras}{outputs} | {board}"


def snapshot(
    camera: Camera,
    thermal: ThermalReport | None,
    model: LoadedModel,
    outputs: Outputs,
    candidate: CandidateReport | None = None,
    memory: MemoryReadings | None = None,
) -> Snapshot:
    """Camera ``camera``'s state now, with what each output adds, the shadow trial's report and edged's memory."""
    short = model.engine.identity.short
    capture = camera.capture.stats()
    reports = outputs.reports(camera.id)
    rate_cap = camera.rate_cap.fps
    return Snapshot(camera.id, camera.stats, capture, rate_cap, thermal, model.info, short, reports, candidate, memory)


def publish_status(
    cameras: Sequence[Camera],
    thermal: ThermalReport | None,
    model: LoadedModel,
    outputs: Outputs,
    candidate: CandidateReport | None = None,
) -> list[Snapshot]:
    """Each camera's status message, on its own ``seq``, to every output; returns what they said. edged's
    memory is read once for them all (`edged.memory.MemoryWatch.read`), which warns near the limit."""
    snapshots, reports = [], []
    memory = MemoryWatch.own().read()
    for camera in cameras:
        camera.stats.update_fps()
        snap = snapshot(camera, thermal, model, outputs, candidate, memory)
        snapshots.append(snap)
        message = snap.message(camera.next_seq("status"))
        verdicts = camera.stats.verdict_counts() if camera.path.inspector else None
        reports.append(StatusReport((message, camera.stats.histograms(), verdicts), message.model_dump_json().encode()))
    outputs.status(reports)
    return snapshots
