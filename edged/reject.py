"""The reject line: a GPIO output pulsed when a judged part reaches the ejector (``[reject]``).

A part's frame is captured ``delay_ms`` before the part is in front of the ejector. The output
learns of the frame when the loop takes it for the model (`RejectOutput.taken`): from then on
the part has a deadline, capture + ``delay_ms``, whether or not a verdict ever comes. Its verdict
(`RejectOutput.frame`) schedules a pulse at that deadline when it is one of ``on``; a part
still without a verdict at its deadline (inference slow or stuck, the frame rejected by the
contract, the model failing) gets the ``late`` policy: a pulse anyway (the fail-safe), none, or
the alarm line active until verdicts come in time again. A verdict after its deadline never
fires: the part has gone by.

Each camera's line is owned by one thread (`RejectLine`), which requests it through libgpiod's
v2 character-device API once at start, driven inactive, and fires the pulses on the monotonic
clock: it sleeps until just before an edge and spins the rest, so that neither a slow frame nor
the loop moves a pulse. Two things the thread cannot do alone: a core kept busy by other work
delays its wake-up by a scheduler time slice (milliseconds), so it asks for SCHED_FIFO (allowed
with ``LimitRTPRIO=`` in the unit, or as root; without it, it runs as any thread and says so);
and a thread woken while another holds the interpreter lock waits up to the switch interval
(5 ms by default) for it, so while a reject line runs the interval is `SWITCH_INTERVAL_S`. What
remains: another thread that holds the lock and loses its core to other work delays the pulse
thread by a time slice (BENCHMARKS.md measures it). Pulses closer than ``min_gap_ms`` merge into
one. Every stop, a reload that changes the line, and a failure of the thread itself drive the
line inactive before it is released.

``gpiod`` (the ``gpio`` extra) is imported only when a reject line is configured.
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from edged.errors import LineBusy, LineError, MissingDependency
from edged.messages import RejectReport
from edged.output import NO_REPORT, Delivery, FrameReport, Output, OutputReport, Services
from edged.settings.reject import LineId, RejectConfig
from edged.stats import LatencyWindow

if TYPE_CHECKING:
    from edged.config import Settings

log = logging.getLogger(__name__)

CONSUMER = "edged"  # the name the kernel shows for the line's holder (gpioinfo)
INSTALL_HINT = "the reject line needs libgpiod's v2 Python binding: pip install 'edged[gpio]' (gpiod 2.x)"
SPIN_S = 0.001  # the pulse thread sleeps until this long before an edge and spins the rest
SWITCH_INTERVAL_S = 0.0002  # the interpreter lock's longest hold while a reject line runs (Python's default: 5 ms)
RT_PRIORITY = 10  # the pulse thread's SCHED_FIFO priority, where the process may have one
STOP_WAIT_S = 1.0  # how long a stop waits for the pulse thread before driving the line itself
LINES_NAMED = 64  # the most of a chip's lines an error lists
WINDOW = 1024  # pulses and verdicts the lateness and margin percentiles are taken over


def import_gpiod() -> ModuleType:
    """libgpiod's v2 binding, or `MissingDependency` saying what to install."""
    try:
        import gpiod
        import gpiod.line
    except ImportError as e:
        raise MissingDependency(f"{INSTALL_HINT} ({e})") from None
    if not hasattr(gpiod, "request_lines"):  # gpiod 1.x has another API altogether
        raise MissingDependency(f"{INSTALL_HINT}: the installed gpiod is version 1")
    return gpiod


def gpiod_problem() -> str | None:
    """Why the reject line cannot be driven here (no gpiod 2.x), for the configuration's problems; None: it can."""
    try:
        import_gpiod()
    except MissingDependency as e:
        return str(e)
    return None


def chip_path(gpiod: ModuleType, chip: str) -> str:
    """The device of ``chip``: a path as it is, a name under /dev, or the chip whose label it is."""
    if "/" in chip:
        return chip
    path = f"/dev/{chip}"
    if gpiod.is_gpiochip_device(path):
        return path
    for candidate in sorted(glob.glob("/dev/gpiochip*")):
        if gpiod.is_gpiochip_device(candidate):
            with gpiod.Chip(candidate) as found:
                if found.get_info().label == chip:
                    return candidate
    return path


def _chips(gpiod: ModuleType) -> str:
    """The GPIO chips under /dev, as ``gpiochip0 (label)``, for an error."""
    named = []
    for candidate in sorted(glob.glob("/dev/gpiochip*")):
        if gpiod.is_gpiochip_device(candidate):
            with gpiod.Chip(candidate) as found:
                info = found.get_info()
            named.append(f"{info.name} ({info.label}, {info.num_lines} lines)")
    return "the chips here: " + ", ".join(named) if named else "no GPIO chip found under /dev"


def _lines(chip: Any) -> str:
    """A chip's lines as ``offset name``, for an error."""
    count = chip.get_info().num_lines
    named = []
    for offset in range(min(count, LINES_NAMED)):
        name = chip.get_line_info(offset).name
        named.append(f"{offset} {name}" if name else str(offset))
    more = f", ... ({count} in all)" if count > LINES_NAMED else ""
    return ", ".join(named) + more


@dataclass(frozen=True, slots=True)
class Lines:
    """The requested lines of one camera: the reject line and the alarm line (None without one)."""

    request: Any  # gpiod.LineRequest
    line: int
    alarm: int | None
    chip: str
    values: tuple[Any, Any]  # gpiod.line.Value.INACTIVE, .ACTIVE

    def drive(self, offset: int, active: bool) -> None:
        self.request.set_value(offset, self.values[active])

    def release(self) -> None:
        """Both lines inactive, then let go of them."""
        self.drive(self.line, False)
        if self.alarm is not None:
            self.drive(self.alarm, False)
        self.request.release()


def open_lines(cfg: RejectConfig, camera_id: str) -> Lines:
    """Request ``cfg``'s line (and alarm line) as outputs, driven inactive.

    Raises `LineError` (exit 78) naming the chips when the chip does not exist, or the chip's lines
    when a line does not; `LineBusy` (exit 1) naming the holder when another process has the line.
    """
    gpiod = import_gpiod()
    from gpiod.line import Direction, Value

    path = chip_path(gpiod, cfg.chip)
    try:
        chip = gpiod.Chip(path)
    except OSError as e:
        raise LineError(f"reject.chip {cfg.chip!r} (camera {camera_id}): {path}: {e.strerror}; {_chips(gpiod)}") from None
    with chip:
        info = chip.get_info()
        offsets: dict[str, int] = {}
        wanted: list[tuple[str, LineId | None]] = [("line", cfg.line), ("alarm_line", cfg.alarm_line)]
        for key, line in wanted:
            if line is None:
                continue
            try:
                offsets[key] = chip.line_offset_from_id(line)
            except (OSError, ValueError):
                raise LineError(
                    f"reject.{key} {line!r} (camera {camera_id}): {info.name} ({info.label}) has no such line; "
                    f"its lines: {_lines(chip)}"
                ) from None
        settings = gpiod.LineSettings(direction=Direction.OUTPUT, active_low=cfg.active_low, output_value=Value.INACTIVE)
        try:
            request = chip.request_lines({tuple(offsets.values()): settings}, consumer=CONSUMER)
        except OSError as e:
            if e.errno == errno.EBUSY:
                holders = [chip.get_line_info(offset).consumer for offset in offsets.values()]
                holder = next((h for h in holders if h), None)
                who = f"held by {holder!r}" if holder else "held by another process (the kernel names no consumer)"
                raise LineBusy(
                    f"reject.line {cfg.line!r} of {info.name} (camera {camera_id}) is {who}: stop it, or choose "
                    "another line (gpioinfo lists who holds what)"
                ) from None
            raise LineError(f"reject.line {cfg.line!r} of {info.name} (camera {camera_id}): {e.strerror}") from None
    return Lines(request, offsets["line"], offsets.get("alarm_line"), path, (Value.INACTIVE, Value.ACTIVE))


def check_lines(settings: Settings) -> list[str]:
    """``edged check``: request every camera's reject line once and release it; one line per line
    requested. Raises as `open_lines` does."""
    said = []
    for cfg in settings.source:
        reject = settings.reject_for(cfg)
        if reject is None:
            continue
        lines = open_lines(reject, cfg.camera_id)
        lines.release()
        alarm = f", alarm line {lines.alarm}" if lines.alarm is not None else ""
        said.append(f"camera {cfg.camera_id}: {lines.chip} line {lines.line}{alarm} (requested and released)")
    return said


class _SwitchInterval:
    """`SWITCH_INTERVAL_S` while any reject line runs, the interpreter's own interval again after the last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._before = sys.getswitchinterval()

    def hold(self) -> None:
        with self._lock:
            if self._users == 0:
                self._before = sys.getswitchinterval()
                sys.setswitchinterval(min(self._before, SWITCH_INTERVAL_S))
            self._users += 1

    def let_go(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                sys.setswitchinterval(self._before)


SWITCH = _SwitchInterval()


def realtime(camera_id: str) -> bool:
    """Ask SCHED_FIFO for the calling thread; False, said once per line, where the process may not have it."""
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_FIFO, os.sched_param(RT_PRIORITY))
    except (OSError, AttributeError) as e:
        log.info(
            "reject line: normal scheduling (%s): a busy CPU may delay pulses by a time slice; LimitRTPRIO=%d in the "
            "unit allows SCHED_FIFO",
            e,
            RT_PRIORITY,
            extra={"CAMERA": camera_id},
        )
        return False
    return True


class RejectLine:
    """One camera's reject line and the thread that owns it (module docstring).

    The loop calls `expect` and `resolve`; everything else happens on the thread. Times are
    monotonic ns. ``_parts`` holds the parts without a verdict yet, as (capture, deadline), in
    the order they were taken; ``_pulses`` the pulses to fire, as [start, end], the first one
    active while ``_active``.
    """

    def __init__(self, camera_id: str, cfg: RejectConfig, lines: Lines) -> None:
        self.camera_id = camera_id
        self.lines = lines
        self.cfg = cfg
        self._cond = threading.Condition()
        self._parts: deque[tuple[int, int]] = deque()
        self._pulses: deque[list[int]] = deque()
        self._active = False
        self._alarm = False
        self._late_upto = -1  # the latest capture whose deadline passed without a verdict
        self._stopping = False
        self._released = False
        self.pulses = self.late = self.late_fired = self.late_verdicts = self.merged = 0
        self.last_error: str | None = None
        self._lateness = LatencyWindow(WINDOW)
        self._margin = LatencyWindow(WINDOW)
        self.realtime = False
        self._thread = threading.Thread(target=self._run, name=f"edged-reject-{camera_id}", daemon=True)
        SWITCH.hold()
        self._thread.start()

    @property
    def _delay_ns(self) -> int:
        assert self.cfg.delay_ms is not None  # checked when the settings load
        return int(self.cfg.delay_ms * 1e6)

    def adopt(self, cfg: RejectConfig) -> None:
        """A reload's timing and policy for the same line: parts already taken keep their deadlines."""
        with self._cond:
            self.cfg = cfg
            self._cond.notify()

    # ---- the loop's side ----------------------------------------------------------------------

    def expect(self, t_capture_ns: int) -> None:
        """A frame captured at ``t_capture_ns`` went to the model: its part now has a deadline."""
        with self._cond:
            self._parts.append((t_capture_ns, t_capture_ns + self._delay_ns))
            self._cond.notify()

    def resolve(self, t_capture_ns: int, verdict: str | None, now_ns: int) -> None:
        """The verdict of the frame captured at ``t_capture_ns`` (None: it has none) came at ``now_ns``."""
        with self._cond:
            if self._released:  # the thread failed and let go of the line: nothing left to drive
                return
            deadline = self._take(t_capture_ns)
            if deadline is None:
                if t_capture_ns <= self._late_upto:  # its deadline passed: the late policy had it
                    self.late_verdicts += 1
                    return
                deadline = t_capture_ns + self._delay_ns  # a frame not announced (a reload's trial frame)
            if now_ns >= deadline:
                self.late_verdicts += 1
                self._missed(t_capture_ns, deadline)
                self._cond.notify()
                return
            self._margin.add((deadline - now_ns) / 1e6)
            self._alarm_off()
            if verdict in self.cfg.on:
                self._schedule(deadline)
                self._cond.notify()

    def _take(self, t_capture_ns: int) -> int | None:
        for i, (capture, deadline) in enumerate(self._parts):
            if capture == t_capture_ns:
                del self._parts[i]
                return deadline
        return None

    # ---- the thread's side --------------------------------------------------------------------

    def _schedule(self, start_ns: int) -> None:
        end = start_ns + int(self.cfg.pulse_ms * 1e6)
        last = self._pulses[-1] if self._pulses else None
        if last is not None and start_ns - last[1] < self.cfg.min_gap_ms * 1e6:
            last[1] = max(last[1], end)
            self.merged += 1
            return
        self._pulses.append([start_ns, end])

    def _missed(self, t_capture_ns: int, deadline_ns: int) -> None:
        """A part without a verdict at its deadline: the late policy."""
        self.late += 1
        self._late_upto = max(self._late_upto, t_capture_ns)
        if self.cfg.late == "reject":
            self.late_fired += 1
            self._schedule(deadline_ns)
        elif self.cfg.late == "alarm" and not self._alarm and self.lines.alarm is not None:
            self.lines.drive(self.lines.alarm, True)
            self._alarm = True
            log.warning("reject line: a part had no verdict by its deadline: alarm on", extra={"CAMERA": self.camera_id})

    def _alarm_off(self) -> None:
        if self._alarm and self.lines.alarm is not None:
            self.lines.drive(self.lines.alarm, False)
            self._alarm = False
            log.info("reject line: verdicts on time again: alarm off", extra={"CAMERA": self.camera_id})

    def _edges(self, now: int) -> int | None:
        """Drive the line for the pulses due at ``now``; returns when the next edge is due."""
        if self._active and now >= self._pulses[0][1]:
            self.lines.drive(self.lines.line, False)
            self._active = False
            self._pulses.popleft()
        if not self._active and self._pulses and now >= self._pulses[0][0]:
            pulse = self._pulses[0]
            self.lines.drive(self.lines.line, True)
            started = time.monotonic_ns()
            self._active = True
            self.pulses += 1
            self._lateness.add((started - pulse[0]) / 1e6)
            if started > pulse[0]:  # late: the pulse keeps its length
                pulse[1] += started - pulse[0]
        if not self._pulses:
            return None
        return self._pulses[0][1] if self._active else self._pulses[0][0]

    def _run(self) -> None:
        self.realtime = realtime(self.camera_id)
        try:
            with self._cond:
                while not self._stopping:
                    now = time.monotonic_ns()
                    while self._parts and self._parts[0][1] <= now:
                        self._missed(*self._parts.popleft())
                    edge = self._edges(now)
                    due = min((t for t in (edge, self._parts[0][1] if self._parts else None) if t is not None), default=None)
                    if due is None:
                        self._cond.wait()
                        continue
                    wait_s = (due - now) / 1e9
                    if wait_s > SPIN_S:
                        self._cond.wait(wait_s - SPIN_S)
                        continue
                    self._cond.release()  # the loop may hand over parts while this thread spins to the edge
                    try:
                        while time.monotonic_ns() < due:
                            pass
                    finally:
                        self._cond.acquire()
        except Exception as e:  # the line must end inactive whatever failed
            self.last_error = f"the reject line's thread failed: {e}"
            log.exception("reject line failed: driving it inactive", extra={"CAMERA": self.camera_id})
        finally:
            self._release()

    def _release(self) -> None:
        with self._cond:
            if self._released:
                return
            self._released = True
            SWITCH.let_go()
            try:
                self.lines.release()
            except Exception as e:  # said, the stop goes on
                self.last_error = f"releasing the line failed: {e}"
                log.error("reject line: %s", self.last_error, extra={"CAMERA": self.camera_id})

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        """Drive the line inactive and release it; pulses still scheduled are dropped."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)
        self._release()

    def report(self) -> RejectReport:
        with self._cond:
            lateness = self._lateness.percentiles(50, 99, 100) or [0.0, 0.0, 0.0]
            margin: Sequence[float | None] = self._margin.percentiles(1, 50) or [None, None]
            return RejectReport(
                pulses=self.pulses,
                late=self.late,
                late_fired=self.late_fired,
                late_verdicts=self.late_verdicts,
                merged=self.merged,
                alarm=self._alarm,
                lateness_p50_ms=lateness[0],
                lateness_p99_ms=lateness[1],
                lateness_max_ms=lateness[2],
                margin_p1_ms=margin[0],
                margin_p50_ms=margin[1],
                last_error=self.last_error,
            )


def _same_line(a: RejectConfig, b: RejectConfig) -> bool:
    """Whether two settings request the very same lines the same way (a reload then keeps the request)."""
    keys = ("chip", "line", "alarm_line", "active_low")
    return all(getattr(a, key) == getattr(b, key) for key in keys)


class RejectOutput(Output):
    """Every camera's reject line (``[reject]``, ``[source.reject]``)."""

    def __init__(self, settings: Settings) -> None:
        self.lines: dict[str, RejectLine] = {}
        try:
            for cfg in settings.source:
                reject = settings.reject_for(cfg)
                if reject is not None:
                    self.lines[cfg.camera_id] = RejectLine(cfg.camera_id, reject, open_lines(reject, cfg.camera_id))
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_settings(cls, settings: Settings, services: Services) -> RejectOutput | None:
        return cls(settings) if settings.rejecting() else None

    def taken(self, camera_id: str, t_capture_ns: int) -> None:
        line = self.lines.get(camera_id)
        if line is not None:
            line.expect(t_capture_ns)

    def wants(self, camera_id: str, found: bool) -> Delivery:
        return Delivery.NONE  # the verdict is read off the outcome itself

    def frame(self, report: FrameReport) -> None:
        line = self.lines.get(report.camera_id)
        if line is not None:
            inspected = report.outcome.inspected
            verdict = inspected.verdict if inspected is not None else None
            line.resolve(report.outcome.frame.t_capture_ns, verdict, time.monotonic_ns())

    def report(self, camera_id: str) -> OutputReport:
        line = self.lines.get(camera_id)
        if line is None:
            return NO_REPORT
        report = line.report()
        summary = f"reject {report.pulses} pulses, {report.late} late" if report.late else None
        return OutputReport(fields={"reject": report}, summary=summary)

    def reload(self, settings: Settings, services: Services) -> RejectOutput | None:
        """A camera whose line stays the same keeps it, with the new timing; the others' lines are
        driven inactive and released, and those the new settings name requested."""
        for camera_id, line in list(self.lines.items()):
            cfg = settings.camera(camera_id)
            reject = settings.reject_for(cfg) if cfg is not None else None
            if reject is not None and _same_line(line.cfg, reject):
                line.adopt(reject)
                continue
            line.stop()
            del self.lines[camera_id]
        for cfg in settings.source:
            reject = settings.reject_for(cfg)
            if reject is None or cfg.camera_id in self.lines:
                continue
            try:
                self.lines[cfg.camera_id] = RejectLine(cfg.camera_id, reject, open_lines(reject, cfg.camera_id))
            except (LineError, LineBusy, MissingDependency) as e:
                log.error("reload: camera %s drives no reject line: %s", cfg.camera_id, e)
        return self if self.lines else None

    def close(self) -> None:
        for line in self.lines.values():
            line.stop()
        self.lines.clear()
