"""The reject line: a GPIO output pulsed when a judged part reaches the ejector (``[reject]``).

A part's frame is captured ``delay_ms`` before the part is in front of the ejector. The output
learns of the frame when the loop takes it for the model (`RejectOutput.taken`): from then on
the part has a deadline, capture + ``delay_ms``, whether or not a verdict ever comes. Its verdict
(`RejectOutput.frame`) schedules a pulse at that deadline when it is one of ``on``; a part
still without a verdict at its deadline (inference slow or stuck, the frame rejected by the
contract, the model failing) gets the ``late`` policy: a pulse anyway (the fail-safe), none, or
the alarm line active until verdicts come in time again. A verdict after its deadline never
fires: the part has gone by.

Each camera's line is owned by a small process of its own (`serve`, started by `RejectLine`),
which requests it through libgpiod's v2 character-device API once at start, driven inactive, and
fires the pulses on the monotonic clock: it sleeps until just before an edge and spins the rest.
A process rather than a thread: the loop's Python work holds the daemon's interpreter lock, and a
thread that needs it at an edge waits for the holder, which a busy CPU may have set aside for a
whole time slice (tens of ms; BENCHMARKS.md). The line process has its own lock and nothing else
to do, and asks for SCHED_FIFO (allowed with ``LimitRTPRIO=`` in the unit, or as root; without
it, it runs as any process and says so) so that a busy CPU does not delay it either. The loop's
side is a write to a pipe per frame taken and per verdict. Pulses closer than ``min_gap_ms``
merge into one.

A stop lets the parts already judged and on their way go as judged: the daemon's stop, SIGTERM
or SIGINT to the line process (systemd's stop sends SIGTERM to every process of the unit at
once) and its pipe closing (the daemon gone, SIGKILL included) make the process drain
(`Stopping`): it fires the pulses scheduled at their times and applies ``late`` at the deadlines
of the parts taken without a verdict (it still takes the verdicts the daemon sends meanwhile),
then drives the line inactive and releases it. The drain lasts `DRAIN_S` at most, so that it ends
before systemd kills what is left; what falls due after it is dropped and said in one warning, and
a second signal ends it at once. The daemon waits for it at its stop, before its last status
round (once the daemon has exited, systemd sends SIGTERM again to the rest of the unit), but not
on a reload that moves the line: the old line's process drains on its own while the new one
serves, and the daemon's stop waits for that drain too, a reload that left no line included. A
reload that drives the same line otherwise (``active_low``, ``alarm_line``) keeps its process,
which requests the line again itself, its schedule kept. A failure of the process itself, and the
end of a drain however it comes, drive the line inactive before it is released.

A signal to the line process alone (an admin's ``kill``) drains it as a stop does, said at once
in the status; once it has ended, the loop's next write starts another (`RejectLine`). A part to
be ejected whose pulse cannot be fired (let go of at a drain's bound or a failure, or judged while
no process runs or while it reads nothing, stopped: the loop never waits on it) is never silent:
logged, counted in ``reject.dropped``, and the process that takes over drives the alarm line,
where there is one, active until a verdict is on time again.

``gpiod`` (the ``gpio`` extra) is imported only when a reject line is configured.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from edged.errors import EdgedError, LineBusy, LineError, MissingDependency
from edged.messages import RejectReport
from edged.output import NO_REPORT, Delivery, FrameReport, Output, OutputReport, Services
from edged.settings.reject import LineId, RejectConfig
from edged.stats import LatencyWindow
from edged.wake import ready

if TYPE_CHECKING:
    from edged.config import Settings

log = logging.getLogger(__name__)

CONSUMER = "edged"  # the name the kernel shows for the line's holder (gpioinfo), with the holding daemon's PID
NEEDS_GPIOD = "the reject line needs libgpiod's v2 Python binding, gpiod 2.x"
# edged is not on PyPI, and Debian 12's pip refuses to install into the system's Python (PEP 668).
INSTALL_GPIOD = (
    "in a checkout, .venv/bin/python -m pip install -e '.[gpio]'; with the .deb, "
    "sudo pip --python /usr/lib/edged/venv/bin/python install 'gpiod>=2.1,<3'"
)
SPIN_S = 0.001  # the line process sleeps until this long before an edge and spins the rest
REPORT_INTERVAL_S = 0.2  # the line process says its counters at most this often
START_WAIT_S = 10.0  # how long a line process may take to start and request its line
RESTART_INTERVAL_S = 5.0  # a line process that ended unasked is started again at most this often
RT_PRIORITY = 10  # the line process's SCHED_FIFO priority, where it may have one
# A stopping line process fires what falls due within this long, then lets go: systemd SIGKILLs the unit's processes
# TimeoutStopSec=5s after its SIGTERM (the units in systemd/), a line killed mid-pulse may stay active, and the
# daemon's own stop needs the rest of those 5 s once the drain ends.
DRAIN_S = 3.0
STOP_WAIT_S = 1.0  # how long a stop waits for the line process beyond its drain, then kills it (the kernel frees the line)
LINES_NAMED = 64  # the most of a chip's lines an error lists
WINDOW = 1024  # pulses and verdicts the lateness and margin percentiles are taken over


def holder_name(pid: int) -> str:
    """The consumer name of the lines edged ``pid`` holds (its line processes request them): ``edged:PID``.
    A reload tells its own lines from another edged's by it; with one name for all, a line another
    edged held passed the reload's look, and its line process then failed to request it every 5 s."""
    return f"{CONSUMER}:{pid}"


def _edged_holds(consumer: str, pid: int | None) -> bool:
    """Whether ``consumer`` is edged ``pid``'s name for its lines; with no ``pid``, any edged's (an older
    one named them ``edged``)."""
    if pid is not None:
        return consumer == holder_name(pid)
    return consumer == CONSUMER or consumer.startswith(f"{CONSUMER}:")


def import_gpiod() -> ModuleType:
    """libgpiod's v2 binding, or `MissingDependency` saying what to install."""
    try:
        import gpiod
        import gpiod.line
    except ImportError as e:
        raise MissingDependency(f"{NEEDS_GPIOD}, which this Python cannot import ({e}): {INSTALL_GPIOD}") from None
    if not hasattr(gpiod, "request_lines"):  # gpiod 1.x has another API altogether
        raise MissingDependency(f"{NEEDS_GPIOD}, this Python has gpiod 1: {INSTALL_GPIOD}")
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


def _found(gpiod: ModuleType, cfg: RejectConfig, camera_id: str) -> tuple[str, Any, dict[str, int]]:
    """``cfg``'s chip, opened (the caller closes it), with its device and the offsets of the line and
    alarm line it names; `LineError` naming the chips when the chip does not exist, or the chip's
    lines when a line does not."""
    path = chip_path(gpiod, cfg.chip)
    try:
        chip = gpiod.Chip(path)
    except OSError as e:
        raise LineError(f"reject.chip {cfg.chip!r} (camera {camera_id}): {path}: {e.strerror}; {_chips(gpiod)}") from None
    offsets: dict[str, int] = {}
    wanted: list[tuple[str, LineId | None]] = [("line", cfg.line), ("alarm_line", cfg.alarm_line)]
    with contextlib.ExitStack() as failing:
        failing.callback(chip.close)
        for key, line in wanted:
            if line is None:
                continue
            try:
                offsets[key] = chip.line_offset_from_id(line)
            except (OSError, ValueError):
                info = chip.get_info()
                raise LineError(
                    f"reject.{key} {line!r} (camera {camera_id}): {info.name} ({info.label}) has no such line; "
                    f"its lines: {_lines(chip)}"
                ) from None
        failing.pop_all()
    return path, chip, offsets


def open_lines(cfg: RejectConfig, camera_id: str, holder: str) -> Lines:
    """Request ``cfg``'s line (and alarm line) as outputs, driven inactive, in the name ``holder``.

    Raises `LineError` (exit 78) naming the chips when the chip does not exist, or the chip's lines
    when a line does not; `LineBusy` (exit 1) naming the holder when another process has the line.
    """
    gpiod = import_gpiod()
    from gpiod.line import Direction, Value

    path, chip, offsets = _found(gpiod, cfg, camera_id)
    with chip:
        info = chip.get_info()
        settings = gpiod.LineSettings(direction=Direction.OUTPUT, active_low=cfg.active_low, output_value=Value.INACTIVE)
        try:
            request = chip.request_lines({tuple(offsets.values()): settings}, consumer=holder)
        except OSError as e:
            if e.errno == errno.EBUSY:
                holders = [chip.get_line_info(offset).consumer for offset in offsets.values()]
                raise _busy(cfg, camera_id, info.name, next((h for h in holders if h), None)) from None
            raise LineError(f"reject.line {cfg.line!r} of {info.name} (camera {camera_id}): {e.strerror}") from None
    return Lines(request, offsets["line"], offsets.get("alarm_line"), path, (Value.INACTIVE, Value.ACTIVE))


def _busy(cfg: RejectConfig, camera_id: str, chip_name: str, holder: str | None) -> LineBusy:
    who = f"held by {holder!r}" if holder else "held by another process (the kernel names no consumer)"
    return LineBusy(
        f"reject.line {cfg.line!r} of {chip_name} (camera {camera_id}) is {who}: stop it, or choose "
        "another line (gpioinfo lists who holds what)"
    )


def check_lines(settings: Settings, *, request: bool = True, own: int | None = None) -> list[str]:
    """``edged check``: every camera's reject line found as `open_lines` finds it (its `LineError`), and
    with ``request`` requested once and released (its `LineBusy` too); one line said per camera. Without
    ``request``, beside the running daemon that holds the lines, a chip or line that is not there is
    still found: `run` refuses it (exit 78) as it starts; and a line another program holds, as the
    kernel names its holder (`LineBusy`): every program but edged ``own`` (a reload's look, in that
    daemon), or but any edged (``edged check --no-bind``, which cannot tell the service's PID)."""
    said = []
    for cfg in settings.source:
        reject = settings.reject_for(cfg)
        if reject is None:
            continue
        if request:
            lines = open_lines(reject, cfg.camera_id, holder_name(os.getpid()))
            lines.release()
            path, line, alarm, how = lines.chip, lines.line, lines.alarm, "requested and released"
        else:
            path, chip, offsets = _found(import_gpiod(), reject, cfg.camera_id)
            with chip:
                for offset in offsets.values():
                    held = chip.get_line_info(offset)
                    if held.used and not _edged_holds(held.consumer, own):
                        raise _busy(reject, cfg.camera_id, chip.get_info().name, held.consumer or None)
            line, alarm, how = offsets["line"], offsets.get("alarm_line"), "found; not requested: --no-bind"
        also = f", alarm line {alarm}" if alarm is not None else ""
        said.append(f"camera {cfg.camera_id}: {path} line {line}{also} ({how})")
    return said


class RecordingRequest:
    """A line request that drives nothing: `edged bench --reject`'s line where there is no gpio-sim."""

    def set_value(self, offset: int, value: Any) -> None:
        """Nothing to drive: the schedule times the call as it would a real line's."""

    def release(self) -> None:
        """Nothing to let go of."""


def realtime() -> bool:
    """Ask SCHED_FIFO for this process; False, said, where it may not have it."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(RT_PRIORITY))
    except (OSError, AttributeError) as e:
        log.info(
            "normal scheduling (%s): a busy CPU may delay pulses by a time slice; LimitRTPRIO=%d in the unit "
            "allows SCHED_FIFO",
            e,
            RT_PRIORITY,
        )
        return False
    return True


class Schedule:
    """One camera's parts, deadlines and pulses, and the line they drive: the line process's state.

    Times are monotonic ns. ``_parts`` holds the parts without a verdict yet, as (capture,
    deadline), in the order they were taken; ``_pulses`` the pulses to fire, as [start, end,
    ahead, parts], the first one active while ``_active``; ``ahead`` (1 or 0) says whether the
    pulse was known before its start, ``parts`` how many parts it ejects (merged ones). Lateness
    counts those known ahead alone: a pulse scheduled after its start (a frame the loop took after
    its part's deadline) is late by the loop, and counted in ``late``.
    """

    def __init__(self, cfg: RejectConfig, lines: Lines) -> None:
        self.cfg = cfg
        self.lines = lines
        self._parts: deque[tuple[int, int]] = deque()
        self._pulses: deque[list[int]] = deque()
        self._active = False
        self._alarm = False
        self._late_upto = -1  # the latest capture whose deadline passed without a verdict
        self.earlier_upto = -1  # the latest capture announced to the process before this one, which had its deadline
        self.pulses = self.late = self.late_fired = self.late_verdicts = self.merged = self.dropped = 0
        self._lateness = LatencyWindow(WINDOW)
        self._margin = LatencyWindow(WINDOW)

    @property
    def _delay_ns(self) -> int:
        assert self.cfg.delay_ms is not None  # checked when the settings load
        return int(self.cfg.delay_ms * 1e6)

    def expect(self, t_capture_ns: int) -> None:
        """A frame captured at ``t_capture_ns`` went to the model: its part now has a deadline."""
        self._parts.append((t_capture_ns, t_capture_ns + self._delay_ns))

    def resolve(self, t_capture_ns: int, verdict: str | None, now_ns: int) -> None:
        """The verdict of the frame captured at ``t_capture_ns`` (None: it has none) came at ``now_ns``."""
        deadline = self._take(t_capture_ns)
        if deadline is None:
            if t_capture_ns <= self._late_upto:  # its deadline passed: the late policy had it
                self.late_verdicts += 1
                return
            deadline = t_capture_ns + self._delay_ns  # a frame not announced (a reload's trial frame)
            if now_ns >= deadline and t_capture_ns <= self.earlier_upto:  # the process before applied `late` to it
                self.late_verdicts += 1
                return
        if now_ns >= deadline:
            self.late_verdicts += 1
            self.missed(t_capture_ns, deadline)
            return
        self._margin.add((deadline - now_ns) / 1e6)
        if self._alarm and self.lines.alarm is not None:
            self.lines.drive(self.lines.alarm, False)
            self._alarm = False
            log.info("verdicts on time again: alarm off")
        if verdict is not None and _ejected(self.cfg, verdict):
            self._schedule(deadline)

    def _take(self, t_capture_ns: int) -> int | None:
        for i, (capture, deadline) in enumerate(self._parts):
            if capture == t_capture_ns:
                del self._parts[i]
                return deadline
        return None

    def _schedule(self, start_ns: int) -> None:
        """A pulse from ``start_ns``, in start order: a part without a verdict may reach its deadline
        after a later part's pulse was scheduled (its frame stuck on one lane, the next one judged on
        another). It merges with a neighbour closer than ``min_gap_ms``."""
        gap = self.cfg.min_gap_ms * 1e6
        i = len(self._pulses)
        while i > int(self._active) and self._pulses[i - 1][0] > start_ns:
            i -= 1
        end = start_ns + int(self.cfg.pulse_ms * 1e6)
        if i > 0 and start_ns - self._pulses[i - 1][1] < gap:
            i -= 1
            before = self._pulses[i]
            before[1], before[3] = max(before[1], end), before[3] + 1
            self.merged += 1
        else:
            self._pulses.insert(i, [start_ns, end, int(start_ns >= time.monotonic_ns()), 1])
        while i + 1 < len(self._pulses) and self._pulses[i + 1][0] - self._pulses[i][1] < gap:
            after = self._pulses[i + 1]
            self._pulses[i][1], self._pulses[i][3] = max(self._pulses[i][1], after[1]), self._pulses[i][3] + after[3]
            del self._pulses[i + 1]
            self.merged += 1

    def alarm(self, why: str) -> None:
        """Drive the alarm line active, where there is one, until a verdict is on time again."""
        if not self._alarm and self.lines.alarm is not None:
            self.lines.drive(self.lines.alarm, True)
            self._alarm = True
            log.warning("%s: alarm on", why)

    def adopt(self, cfg: RejectConfig, reopen: Callable[[RejectConfig], Lines]) -> None:
        """A reload's settings for the same line. Another ``active_low`` or ``alarm_line`` requests
        it again here and now (``reopen``), the pulse under way and the alarm carried over: the
        parts on their way keep their pulses and the loop never waits for a drain. On failure
        (`EdgedError`, raised) the old settings are requested again, and kept."""
        old, self.cfg = self.cfg, cfg
        if (old.active_low, old.alarm_line) == (cfg.active_low, cfg.alarm_line):
            return
        self.lines.release()  # inactive for the microseconds until the new request drives it again
        try:
            self.lines = reopen(cfg)
        except EdgedError:
            self.cfg = old
            self.lines = reopen(old)  # failing too, the process fails: its parts are counted dropped
            self._carry_over()
            raise
        self._carry_over()

    def _carry_over(self) -> None:
        """A new request takes up the old one's levels: the pulse under way, and the alarm where it has one."""
        if self._active:
            self.lines.drive(self.lines.line, True)
        alarm = self.lines.alarm
        self._alarm = self._alarm and alarm is not None
        if self._alarm and alarm is not None:
            self.lines.drive(alarm, True)

    def missed(self, t_capture_ns: int, deadline_ns: int) -> None:
        """A part without a verdict at its deadline: the late policy."""
        self.late += 1
        self._late_upto = max(self._late_upto, t_capture_ns)
        if self.cfg.late == "reject":
            self.late_fired += 1
            self._schedule(deadline_ns)
        elif self.cfg.late == "alarm":
            self.alarm("a part had no verdict by its deadline")

    def due(self, now: int) -> int | None:
        """Apply the late policy to the parts whose deadline has come, drive the line for the pulses
        due at ``now``; returns when something is next due."""
        while self._parts and self._parts[0][1] <= now:
            self.missed(*self._parts.popleft())
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
            if pulse[2]:
                self._lateness.add((started - pulse[0]) / 1e6)
            if started > pulse[0]:  # late: the pulse keeps its length
                pulse[1] += started - pulse[0]
        edge = (self._pulses[0][1] if self._active else self._pulses[0][0]) if self._pulses else None
        deadline = self._parts[0][1] if self._parts else None
        return min((t for t in (edge, deadline) if t is not None), default=None)

    def abandon(self) -> tuple[list[int], bool]:
        """What the line process leaves as it lets go of the line: when each part still to be
        ejected was due (the pulses not started, per part, and with ``late = "reject"`` the parts
        without a verdict), and whether a pulse under way is cut short (the release ends it)."""
        waiting = list(self._pulses)[int(self._active) :]
        due = [pulse[0] for pulse in waiting for _ in range(pulse[3])]
        if self.cfg.late == "reject":
            due += [deadline for _, deadline in self._parts]
        cut = self._active
        self.dropped += len(due)
        self._parts.clear()
        self._pulses.clear()
        self._active = False
        return sorted(due), cut

    def report(self, last_error: str | None = None) -> RejectReport:
        lateness = self._lateness.percentiles(50, 99, 100) or [0.0, 0.0, 0.0]
        margin: Sequence[float | None] = self._margin.percentiles(1, 50) or [None, None]
        return RejectReport(
            pulses=self.pulses,
            late=self.late,
            late_fired=self.late_fired,
            late_verdicts=self.late_verdicts,
            merged=self.merged,
            dropped=self.dropped,
            alarm=self._alarm,
            lateness_p50_ms=lateness[0],
            lateness_p99_ms=lateness[1],
            lateness_max_ms=lateness[2],
            margin_p1_ms=margin[0],
            margin_p50_ms=margin[1],
            last_error=last_error,
        )


def _ejected(cfg: RejectConfig, verdict: str) -> bool:
    """Whether a part judged ``verdict`` goes to the reject bin: one the model cannot tell (``uncertain``) as an NG one."""
    return ("ng" if verdict == "uncertain" else verdict) in cfg.on


class Stopping:
    """How a line process ends. The first of the daemon's stop (``s``), its pipe closing (the daemon
    gone) and SIGTERM or SIGINT starts the drain: the pulses and deadlines still to come are served
    until nothing is left and the daemon has no more to send (its stop said, or its pipe closed:
    systemd's SIGTERM reaches the daemon too, whose last frames may still bring verdicts and parts),
    or until ``drain_s`` has passed. A second signal ends it at once (systemd sends SIGTERM again to
    what is left of the unit once the daemon has exited, then SIGKILL). The signal handler sets it,
    the loop reads it."""

    def __init__(self, drain_s: float) -> None:
        self.drain_ns = int(drain_s * 1e9)
        self.since: int | None = None  # when the drain began, monotonic ns
        self.why = ""
        self.signals = 0
        self.daemon_done = False  # the daemon sends nothing more

    def begin(self, why: str, *, daemon_done: bool = False) -> None:
        self.daemon_done |= daemon_done
        if self.since is None:
            self.since, self.why = time.monotonic_ns(), why

    def signalled(self, signum: int, frame: object) -> None:
        self.signals += 1
        self.begin(signal.Signals(signum).name)

    @property
    def deadline(self) -> int:
        assert self.since is not None
        return self.since + self.drain_ns

    def over(self, now_ns: int) -> bool:
        """The drain ends now, whatever is left: a second signal came, or its bound has passed."""
        return self.since is not None and (self.signals > 1 or now_ns >= self.deadline)


def serve(
    camera_id: str,
    cfg: RejectConfig,
    record: bool,
    commands: int,
    out: int,
    drain_s: float = DRAIN_S,
    *,
    dropped_before: bool = False,
    earlier_upto: int = -1,
) -> int:
    """The line process: request the line, then fire what the daemon's commands schedule until it
    stops, and the drain that follows has fired what was on its way (`Stopping`); the line inactive
    and released on every way out. Says ``ready`` or ``error`` first (and again when a reload requests
    the line otherwise), ``stopping`` when a signal begins a drain the daemon did not ask for, and a
    report line whenever its counters moved (at most every `REPORT_INTERVAL_S`). ``dropped_before``:
    the process before this one dropped parts, which the alarm line says; ``earlier_upto``: the latest
    capture announced to it, whose late verdict this one does not fire again (`Schedule.resolve`)."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the daemon's reload is the daemon's
    holder = holder_name(os.getppid())  # the lines are the daemon's that started this process

    def reopen(cfg: RejectConfig) -> Lines:
        return (
            Lines(RecordingRequest(), 0, None, "recording", (False, True)) if record else open_lines(cfg, camera_id, holder)
        )

    try:
        lines = reopen(cfg)
    except (LineError, LineBusy, MissingDependency) as e:
        _say_error(out, e)
        return e.exit_code
    stopping = Stopping(drain_s)
    woken, wake = os.pipe()  # a signal writes to it, which ends the wait below at once
    for fd in (woken, wake):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake)
    # systemd's watchdog sends SIGABRT to every process of the unit once the daemon stops pinging: the
    # line process is sound, and its parts on their way go as judged, as at a stop.
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGABRT):
        signal.signal(signum, stopping.signalled)
    schedule = Schedule(cfg, lines)
    schedule.earlier_upto = earlier_upto
    fast = realtime()
    _say_ready(out, lines, fast)

    def adopt(cfg: RejectConfig) -> None:
        before = schedule.lines
        try:
            schedule.adopt(cfg, reopen)
        except (LineError, LineBusy, MissingDependency) as e:
            log.error("the reload's settings could not be applied, the line kept as it was: %s", e)
            _say_error(out, e)
            return
        if schedule.lines is not before:
            _say_ready(out, schedule.lines, fast)

    error: str | None = None
    said_stopping = False
    said = schedule.report()
    if dropped_before:
        schedule.alarm("the line's process before this one dropped parts un-ejected")
    next_report = 0.0
    buffer = b""
    poller = select.poll()
    poller.register(commands, select.POLLIN)
    poller.register(woken, select.POLLIN)
    try:
        while not stopping.over(time.monotonic_ns()):
            due = schedule.due(time.monotonic_ns())
            if stopping.since is not None:
                if due is None and stopping.daemon_done:
                    break  # drained: every part on its way has gone by
                due = stopping.deadline if due is None else min(due, stopping.deadline)
            now = time.monotonic_ns()
            if due is not None and due - now <= SPIN_S * 1e9 and not poller.poll(0):
                while time.monotonic_ns() < due:
                    pass
                continue
            wait_ms = max(0, int((next_report - time.monotonic()) * 1000))
            if due is not None:
                wait_ms = min(wait_ms, max(0, (due - now) // 1_000_000 - int(SPIN_S * 1000)))
            for fd, _ in poller.poll(wait_ms):
                if fd == woken:
                    os.read(woken, 64)
                    continue
                chunk = os.read(commands, 65536)
                if not chunk:  # the daemon is gone: what it judged still goes as judged
                    poller.unregister(commands)
                    stopping.begin("the daemon is gone", daemon_done=True)
                    continue
                buffer += chunk
                *lines_in, buffer = buffer.split(b"\n")
                for command in lines_in:
                    if _command(schedule, command, adopt):
                        stopping.begin("the daemon's stop", daemon_done=True)
            if stopping.since is not None and not stopping.daemon_done and not said_stopping:
                said_stopping = True  # the daemon did not ask: it starts another process once this one ends
                with contextlib.suppress(OSError):
                    os.write(out, f"stopping {stopping.why}\n".encode())
            if time.monotonic() >= next_report:
                report = schedule.report(error)
                if report != said:
                    with contextlib.suppress(OSError):  # the daemon gone: the drain goes on
                        os.write(out, f"report {report.model_dump_json()}\n".encode())
                    said = report
                next_report = time.monotonic() + REPORT_INTERVAL_S
    except Exception as e:  # the line must end inactive whatever failed
        error = f"the reject line failed: {e}"
        log.exception("failed: driving the line inactive")
    finally:
        dropped, cut = schedule.abandon()
        try:
            schedule.lines.release()  # the one a reload requested, where it did
        except Exception as e:  # said, the stop goes on
            error = f"releasing the line failed: {e}"
            log.error("%s", error)
        _say_dropped(stopping, dropped, cut, drain_s)
        with contextlib.suppress(OSError):
            os.write(out, f"report {schedule.report(error).model_dump_json()}\n".encode())
    return 0


def _say_dropped(stopping: Stopping, dropped: list[int], cut: bool, drain_s: float) -> None:
    """One warning for the parts in flight the line let go of un-ejected, and when they were due."""
    if not dropped and not cut:
        return
    now = time.monotonic_ns()
    if stopping.signals > 1:
        how = f"stopping ({stopping.why}), a second signal ended the drain"
    elif stopping.since is not None and now >= stopping.deadline:
        how = f"stopping ({stopping.why}), the drain's {drain_s:g} s bound came"
    else:
        how = "the line failed"
    parts = f"{len(dropped)} part{'s' if len(dropped) != 1 else ''} in flight dropped, un-ejected"
    if dropped:
        first, last = ((t - now) / 1e9 for t in (dropped[0], dropped[-1]))
        parts += f", due {first:.2f} s later" if len(dropped) == 1 else f", due {first:.2f} to {last:.2f} s later"
    under_way = "; the pulse under way cut short" if cut else ""
    log.warning("%s: %s%s; the line inactive and released", how, parts, under_way)


def _say_ready(out: int, lines: Lines, fast: bool) -> None:
    ready = {"chip": lines.chip, "line": lines.line, "alarm": lines.alarm, "realtime": fast}
    with contextlib.suppress(OSError):  # the daemon gone: the drain goes on
        os.write(out, f"ready {json.dumps(ready)}\n".encode())


def _say_error(out: int, e: EdgedError) -> None:
    with contextlib.suppress(OSError):
        os.write(out, f"error {e.exit_code} {type(e).__name__} {json.dumps(str(e))}\n".encode())


def _command(schedule: Schedule, command: bytes, adopt: Callable[[RejectConfig], None]) -> bool:
    """One command of the daemon's; True: stop."""
    kind, _, rest = command.decode().partition(" ")
    if kind == "e":
        schedule.expect(int(rest))
    elif kind == "r":
        capture, verdict, now = rest.split()
        schedule.resolve(int(capture), None if verdict == "-" else verdict, int(now))
    elif kind == "a":
        adopt(RejectConfig.model_validate_json(rest))
    return kind == "s"


NO_PROCESS = "found no line process to fire its pulse"


@dataclass(slots=True)
class Unfired:
    """The parts to be ejected that the loop's side knows no line process fired (those a process let
    go of, it counts itself): added to ``dropped``, each said once, and raising the next start's alarm."""

    count: int = 0
    said: int = 0  # of ``count``, those said
    before: int = 0  # of ``count``, those before the last start
    why: str = NO_PROCESS  # why the last of them went unfired

    def add(self, count: int, why: str) -> None:
        if count:
            self.count, self.why = self.count + count, why

    def unsaid(self) -> str | None:
        """The line that says those not said yet, once; None when all are said."""
        new, self.said = self.count - self.said, self.count
        if not new:
            return None
        parts = "1 part to be ejected" if new == 1 else f"{new} parts to be ejected"
        return f"{parts} {self.why}: dropped, un-ejected"

    def since_start(self) -> bool:
        """Whether some came since the last start (its successor's alarm says so); a new start counts from here."""
        new, self.before = self.count > self.before, self.count
        return new


class RejectLine:
    """One camera's reject line, as the loop sees it: a process of its own owns the line (`serve`).

    The loop's calls (`expect`, `resolve`, `adopt`) are one short write each to the process's
    pipe, and `report` reads what it said last, so none of them waits on the line. The process
    has its own interpreter lock: the loop's Python work, however busy, never holds up a pulse.
    Its ``stderr`` is the daemon's (its log lines go where the daemon's go). A process that ends
    unasked (a signal to it alone, which it says at once, drains as a stop does) is started again
    as soon as the loop's next write finds it gone, or by the next `report`, at most every
    `RESTART_INTERVAL_S` and without waiting for it: its counters carry on from the last one's, the
    commands meanwhile wait in the new one's pipe, and with parts dropped its alarm line goes
    active. A part to be ejected whose verdict finds no process to take it (between two starts, or a
    process stopped whose pipe is full), went to one started again that then could not request the
    line, or was held by one a SIGKILL ended before it was due, is counted in ``dropped`` and said
    (`Unfired`). A stop (`drain`, then `wait`; `stop` does both) lets the process fire what it has
    scheduled, for ``drain_s`` at most.

    At the start the process's ``ready`` is waited for, and the error it says raised here (a line not
    there, or held); a reload's line (``wait=False``) starts as a restarted one does, the loop going on:
    a process takes a second or more to start on a board, and the reload found the line beforehand.
    """

    def __init__(
        self, camera_id: str, cfg: RejectConfig, *, record: bool = False, drain_s: float = DRAIN_S, wait: bool = True
    ) -> None:
        self.camera_id = camera_id
        self.cfg = cfg
        self.chip, self.line, self.alarm, self.realtime = cfg.chip, None, None, False  # as the process says once ready
        self.drain_s = drain_s
        self._record = record
        self.last_error: str | None = None
        self._stopped = False
        self._before = NO_PULSES  # the counters of the processes that ended
        self._report = NO_PULSES
        self._restarted_at = -math.inf  # the first restart is never held back: a board may be up less than the interval
        self._unfired = Unfired()
        self._unconfirmed = 0  # parts to be ejected sent to a process that has not said ``ready`` (`wait`, a restart)
        self._due: deque[int] = deque()  # when the parts to be ejected sent to this process are due at the ejector
        self._announced = -1  # the latest capture a process took (`expect`): the next one leaves its late verdict be
        self._spawn(ready_later=not wait)
        if not wait:
            return
        try:
            self._ready(self._first_line())
        except BaseException:
            self._proc.kill()
            self._proc.wait()
            self._close_pipes()
            raise

    def _spawn(self, *, dropped_before: bool = False, ready_later: bool = False) -> None:
        record = ["--record"] if self._record else []
        dropped = ["--dropped-before"] if dropped_before else []
        config = self.cfg.model_dump_json()
        command = [sys.executable, "-m", "edged.reject", self.camera_id, config, f"--drain-s={self.drain_s}"]
        command += [*record, *dropped, f"--earlier-upto={self._announced}"]
        self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._in, self._out = self._proc.stdin.fileno(), self._proc.stdout.fileno()
        os.set_blocking(self._out, False)  # `report` reads what is there, never waits
        # A process that reads nothing (SIGSTOP, a debugger) fills its pipe: the loop's next write would wait for
        # good. Each command is shorter than PIPE_BUF, so a write goes whole or not at all (EAGAIN).
        os.set_blocking(self._in, False)
        self._buffer = b""
        self._confirmed = not ready_later  # else its ``ready`` is read later (`_read`), its commands held till then
        self._closed = False  # the pipes: closed once the process has ended for good (their numbers may be reused)
        self._unsent = ""  # a reload's settings a process reading nothing did not take (`_send`): this one has them

    def _ready(self, ready: dict[str, Any]) -> None:
        self.chip, self.line, self.alarm, self.realtime = ready["chip"], ready["line"], ready["alarm"], ready["realtime"]

    def _first_line(self) -> dict[str, Any]:
        """The process's ``ready``, or the error it requesting the line raised, raised here."""
        deadline = time.monotonic() + START_WAIT_S
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            readable, _ = ready([self._out], [], left)
            chunk = os.read(self._out, 65536) if readable else b""
            if not chunk:
                code = self._proc.poll()
                raise LineError(f"reject line of camera {self.camera_id}: its process did not start (exit {code})")
            self._buffer += chunk
        first, _, self._buffer = self._buffer.partition(b"\n")
        return _ready_or_raise(first)

    def _send(self, command: str, *, keep: bool = False) -> str | None:
        """Write ``command`` to the process; one that is gone is started again first where it may be
        (`_restart`). None: a process took it; else why none did. ``keep``: one a process reading
        nothing did not take goes before the next command it takes (a reload's settings, lost
        otherwise until a restart)."""
        for _ in range(2):
            if self._closed:
                break
            try:
                os.write(self._in, (self._unsent + command).encode())
                self._unsent = ""
                return None
            except BlockingIOError:  # alive but reading nothing: what it is sent meanwhile is lost, and said
                self._unsent = command if keep else self._unsent
                self.last_error = f"the reject line's process (pid {self._proc.pid}) takes no commands: stopped or stuck"
                return f"found the line process (pid {self._proc.pid}) taking no commands, stopped or stuck"
            except OSError as e:  # the process is gone: said in the status, the loop goes on
                self.last_error = f"the reject line's process is gone ({e.strerror}; exit {self._proc.poll()})"
            if self._stopped or self._proc.poll() is None or not self._restart():
                break
        return NO_PROCESS

    def expect(self, t_capture_ns: int) -> None:
        """A frame captured at ``t_capture_ns`` went to the model: its part now has a deadline."""
        if self._send(f"e {t_capture_ns}\n") is None:
            self._announced = max(self._announced, t_capture_ns)

    def resolve(self, t_capture_ns: int, verdict: str | None, now_ns: int) -> None:
        """The verdict of the frame captured at ``t_capture_ns`` (None: it has none) came at ``now_ns``.
        One to be ejected that no process takes is counted dropped, and said at most every status round."""
        fires = _ejected(self.cfg, verdict) if verdict else self.cfg.late == "reject"
        unsent = self._send(f"r {t_capture_ns} {verdict or '-'} {now_ns}\n")
        if unsent is None:
            self._unconfirmed += fires and not self._confirmed
            while self._due and self._due[0] < now_ns:  # gone by: kept only while a kill could drop them
                self._due.popleft()
            if fires:
                self._due.append(t_capture_ns + int((self.cfg.delay_ms or 0.0) * 1e6))
        elif not self._stopped:
            self._unfired.add(fires, unsent)

    def adopt(self, cfg: RejectConfig) -> None:
        """A reload's settings for the same line: parts already taken keep their deadlines, and the
        process requests the line again itself where ``active_low`` or ``alarm_line`` changed."""
        self.cfg = cfg
        self._send(f"a {cfg.model_dump_json()}\n", keep=True)

    def report(self) -> RejectReport:
        """What the process said last, added to what the ended ones said; an error, or the process's
        end (and its restart), in ``last_error``."""
        self._read()
        if not self._stopped and self._proc.poll() is not None:
            self._restart()
        if (unsaid := self._unfired.unsaid()) is not None:
            self.last_error = unsaid
            log.error("reject line: %s", self.last_error, extra={"CAMERA": self.camera_id})
        report = _added(self._before, self._report)
        if self._unfired.count:
            report = report.model_copy(update={"dropped": report.dropped + self._unfired.count})
        error = self._report.last_error or self.last_error
        return report.model_copy(update={"last_error": error}) if error != report.last_error else report

    def _read(self) -> None:
        """Take in what the process said: its reports, a ``ready`` or error after a reload's new
        request, and ``stopping`` where a signal to it alone began its drain."""
        with contextlib.suppress(BlockingIOError, OSError):
            while not self._closed and (chunk := os.read(self._out, 65536)):
                self._buffer += chunk
        *said, self._buffer = self._buffer.split(b"\n")
        for line in said:
            if line.startswith(b"report "):
                self._report = RejectReport.model_validate_json(line.removeprefix(b"report "))
            elif line.startswith(b"stopping "):
                if self._stopped:  # systemd's stop: its SIGTERM reached the line process before the daemon's own stop
                    continue
                why = line.removeprefix(b"stopping ").decode()
                self.last_error = (
                    f"the reject line's process got {why}: it fires the parts on their way for {self.drain_s:g} s "
                    "at most, then another takes over"
                )
                log.warning("reject line: %s", self.last_error, extra={"CAMERA": self.camera_id})
            elif line:
                try:
                    self._ready(_ready_or_raise(line))
                    self._confirmed, self._unconfirmed = True, 0
                except EdgedError as e:
                    self.last_error = f"the reject line could not be requested again: {e}"
                    self._drop_unconfirmed(f"found the line process just started unable to request its line ({e})")

    def _drop_unconfirmed(self, why: str) -> None:
        """The parts to be ejected sent to a process that has not said ``ready`` are dropped: it could
        not request the line, or ended, and reads no command."""
        self._unfired.add(self._unconfirmed, why)
        self._unconfirmed = 0

    def _ended(self) -> None:
        """Take in what the ended process said last; what it was sent before saying ``ready`` is dropped,
        and, where a signal it cannot drain on ended it (SIGKILL: the kernel's OOM killer, an admin's
        ``kill -9``), the parts it held that are due from now on, which no process fires any more."""
        self._read()
        code = self._proc.returncode
        if not self._confirmed:
            self._drop_unconfirmed(f"found the line process just started ended before it requested its line (exit {code})")
        elif code is not None and code < 0:
            now = time.monotonic_ns()
            held = sum(due >= now for due in self._due)
            self._unfired.add(held, f"were held by the line process, which {_signal_name(-code)} ended")
        self._due.clear()

    def _restart(self) -> bool:
        """Start the line process again, if the last start is long enough ago, once what the ended one
        said last is read: its ``ready`` or error comes with a later report. True: started."""
        if time.monotonic() - self._restarted_at < RESTART_INTERVAL_S:
            return False
        self._restarted_at = time.monotonic()
        self._ended()
        self._close_pipes()
        dropped = self._unfired.since_start() or self._report.dropped > 0
        self._before, self._report = _added(self._before, self._report), NO_PULSES
        self.last_error = f"the reject line's process ended (exit {self._proc.returncode}); started again"
        log.error("reject line: %s", self.last_error, extra={"CAMERA": self.camera_id})
        self._spawn(dropped_before=dropped, ready_later=True)
        return True

    @property
    def pid(self) -> int:
        """The line process's id (``ps``, ``gpioinfo``'s holder)."""
        return self._proc.pid

    @property
    def ended(self) -> bool:
        """The process has exited."""
        return self._proc.poll() is not None

    def drain(self) -> None:
        """Ask the process to stop, without waiting for it: it fires the pulses still scheduled at
        their times and applies ``late`` at the deadlines of the parts without a verdict, for
        ``drain_s`` at most (what falls due after is dropped, and said), then drives the line
        inactive and releases it (`Stopping`)."""
        if not self._stopped:
            self._stopped = True
            self._send("s\n")

    def wait(self, until: float) -> None:
        """Wait for the process to end until ``until`` (monotonic s), then kill it (the kernel
        releases the line); its last report read, its pipes closed."""
        if self._closed:
            return
        try:
            self._proc.wait(max(0.0, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("reject line: its process did not end in time: killed", extra={"CAMERA": self.camera_id})
            self._proc.kill()
            self._proc.wait()
        self._ended()
        self.report()
        self._close_pipes()
        self._closed = True

    def stop(self) -> None:
        """Drive the line inactive and release it once the parts already on their way have gone as
        judged (`drain`), waiting for that: ``drain_s`` at most, and `STOP_WAIT_S` beyond it before the
        process is killed."""
        _stop([self])

    def _close_pipes(self) -> None:
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


NO_PULSES = RejectReport(
    pulses=0,
    late=0,
    late_fired=0,
    late_verdicts=0,
    merged=0,
    alarm=False,
    lateness_p50_ms=0.0,
    lateness_p99_ms=0.0,
    lateness_max_ms=0.0,
    margin_p1_ms=None,
    margin_p50_ms=None,
    last_error=None,
)
COUNTERS = ("pulses", "late", "late_fired", "late_verdicts", "merged", "dropped")


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:  # a real-time signal past SIGRTMIN
        return f"signal {signum}"


def _added(before: RejectReport, now: RejectReport) -> RejectReport:
    """``now``'s report with the counters of the processes before it added."""
    if before == NO_PULSES:
        return now
    return now.model_copy(update={key: getattr(before, key) + getattr(now, key) for key in COUNTERS})


def _ready_or_raise(line: bytes) -> dict[str, Any]:
    """A line process's first line: what it requested, or the error it raised, raised here."""
    kind, _, rest = line.decode().partition(" ")
    if kind == "error":
        _, name, message = rest.split(" ", 2)
        raise _ERRORS.get(name, LineError)(json.loads(message))
    answer: dict[str, Any] = json.loads(rest)
    return answer


_ERRORS: dict[str, type[EdgedError]] = {"LineError": LineError, "LineBusy": LineBusy, "MissingDependency": MissingDependency}


def _driven(cfg: RejectConfig) -> set[tuple[str, LineId]]:
    """The lines ``cfg`` drives, as written: its line, and its alarm line where it has one."""
    return {(cfg.chip, line) for line in (cfg.line, cfg.alarm_line) if line is not None}


def _same_line(a: RejectConfig, b: RejectConfig) -> bool:
    """Whether two settings drive the same line (a reload then keeps its process, which requests it
    again itself where ``active_low`` or ``alarm_line`` changed: `Schedule.adopt`)."""
    return (a.chip, a.line) == (b.chip, b.line)


class RejectOutput(Output):
    """Every camera's reject line (``[reject]``, ``[source.reject]``)."""

    def __init__(self, settings: Settings) -> None:
        self.lines: dict[str, RejectLine] = {}
        self._draining: list[RejectLine] = []  # the lines a reload moved, their processes firing what they had scheduled
        self._drained: dict[str, RejectReport] = {}  # per camera, what its lines a reload moved said, once drained
        try:
            for cfg in settings.source:
                reject = settings.reject_for(cfg)
                if reject is not None:
                    self.lines[cfg.camera_id] = RejectLine(cfg.camera_id, reject)
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

    def _reap(self) -> None:
        """Let go of the draining lines whose process has ended."""
        self._let_go([line for line in self._draining if line.ended])

    def _let_go(self, ended: list[RejectLine]) -> None:
        """Draining lines that have ended: their counters kept for their camera's report, the lines let go of."""
        for line in ended:
            line.wait(0.0)
            self._drained[line.camera_id] = _added(self._drained.get(line.camera_id, NO_PULSES), line.report())
            self._draining.remove(line)

    def report(self, camera_id: str) -> OutputReport:
        self._reap()
        line = self.lines.get(camera_id)
        if line is None:
            return NO_REPORT
        report = line.report()  # with what its lines before it fired and dropped: the counters never go back
        for old in self._draining:
            if old.camera_id == camera_id:
                report = _added(old.report(), report)
        report = _added(self._drained.get(camera_id, NO_PULSES), report)
        said = [f"{count} {what}" for count, what in ((report.late, "late"), (report.dropped, "dropped")) if count]
        summary = f"reject {report.pulses} pulses, {', '.join(said)}" if said else None
        return OutputReport(fields={"reject": report}, summary=summary)

    def reload(self, settings: Settings, services: Services) -> RejectOutput | None:
        """A camera whose line stays the same keeps its process, with the new settings (`RejectLine.adopt`);
        the others' lines drain (`RejectLine.drain`) on their own, the loop going on meanwhile, and those
        the new settings name are requested by processes the loop does not wait for (the reload found
        them first, `edged.reload.load_replacement`). A line a draining process still holds (another
        camera's old line) is requested once the drains have ended: a line has one holder. The output
        stays while a drain goes on, no camera having a line left included, so that the daemon's stop
        waits for it (`drain`) rather than leave a process holding its line beyond the daemon."""
        for camera_id, line in list(self.lines.items()):
            cfg = settings.camera(camera_id)
            reject = settings.reject_for(cfg) if cfg is not None else None
            if reject is not None and _same_line(line.cfg, reject):
                line.adopt(reject)
                continue
            line.drain()
            self._draining.append(line)
            del self.lines[camera_id]
        for cfg in settings.source:
            reject = settings.reject_for(cfg)
            if reject is None or cfg.camera_id in self.lines:
                continue
            self.lines[cfg.camera_id] = self._start(cfg.camera_id, reject)  # a line it cannot request: said, parts counted
        self._reap()
        return self if self.lines or self._draining else None

    def _start(self, camera_id: str, reject: RejectConfig) -> RejectLine:
        """A reload's line, started without waiting for it (`RejectLine`); one a draining process drives
        (another camera's old line), once those drains end: a line has one holder."""
        if any(_driven(line.cfg) & _driven(reject) for line in self._draining):
            _stop(self._draining)
            self._let_go(list(self._draining))
        return RejectLine(camera_id, reject, wait=False)

    def drain(self) -> None:
        """Every line fires the parts already on their way and lets go, waited for: at the daemon's
        stop before its last status round, which then counts them, since once the daemon has exited
        systemd sends SIGTERM again to the rest of the unit."""
        _stop([*self.lines.values(), *self._draining])
        self._let_go(list(self._draining))

    def close(self) -> None:
        self.drain()
        self.lines.clear()


def _stop(lines: list[RejectLine]) -> None:
    """Stop ``lines`` (`RejectLine.stop`), their drains side by side."""
    for line in lines:
        line.drain()
    until = time.monotonic() + max((line.drain_s for line in lines), default=0.0) + STOP_WAIT_S
    for line in lines:
        line.wait(until)


def main(argv: Sequence[str]) -> int:
    """``python -m edged.reject CAMERA CONFIG_JSON [--drain-s=SECONDS] [--record] [--dropped-before]
    [--earlier-upto=NS]``: the line process `RejectLine` starts, its commands on stdin, what it says on stdout."""
    logging.basicConfig(level=logging.INFO, format=f"edged reject line {argv[0]}: %(message)s")
    options = argv[2:]
    drain_s = next((float(o.removeprefix("--drain-s=")) for o in options if o.startswith("--drain-s=")), DRAIN_S)
    earlier = next((int(o.removeprefix("--earlier-upto=")) for o in options if o.startswith("--earlier-upto=")), -1)
    cfg = RejectConfig.model_validate_json(argv[1])
    dropped_before = "--dropped-before" in options
    return serve(argv[0], cfg, "--record" in options, 0, 1, drain_s, dropped_before=dropped_before, earlier_upto=earlier)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
