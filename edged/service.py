"""systemd integration: sd_notify, the progress-gated watchdog, journald logging, signals.

Outside systemd (no ``NOTIFY_SOCKET``, no ``JOURNAL_STREAM``) every part quietly does nothing
special: notifications are skipped and logs go to stderr.

The watchdog is the reason this module exists: ``WATCHDOG=1`` is sent at half of
``WATCHDOG_USEC`` only while ``healthy()`` says the pipeline is really progressing. A loop stuck
in inference or a dead capture thread therefore stops the pings, and systemd restarts us.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, NoReturn, ParamSpec, TypeVar

from edged.errors import EXIT_OK
from edged.lograte import LogRate

if TYPE_CHECKING:
    from edged.wake import Waker

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

# Signals whose default action ends the process: a log rotation script's SIGUSR1 for a daemon that
# reopens its log files, a stray alarm. Ended by one, edged restarted and the line stopped for it.
UNUSED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)

STOP_POLL_S = 0.1  # how soon a start waiting on a model load sees a stop asked for
# A stop the handler has not taken by then ends the process (`Signals._watch_stops`): under the units'
# TimeoutStopSec=5s, which ends in SIGKILL and a failed unit, and above a slow board's frame, which a stop
# lets finish.
STOP_STUCK_S = 4.0
_SIGNAL_THREADS: set[threading.Thread] = set()  # waiting for signals for the whole process: never lingering
LOAD_CHECK_S = 1.0  # how often `StartTimeout` looks at the start's model load
# What each EXTEND_TIMEOUT_USEC= of a load that progresses gives: a load stalled that long past the unit's
# TimeoutStartSec= ends the start, as a stuck one should.
LOAD_EXTEND_S = 30.0


class Notifier:
    """Sends sd_notify datagrams to ``$NOTIFY_SOCKET`` (a path or an @abstract name)."""

    def __init__(self, address: str | None = None) -> None:
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        # "@name" is an abstract socket: its address starts with a NUL byte.
        self._address = "\0" + address[1:] if address.startswith("@") else address
        self._lock = threading.Lock()
        self._dropped = 0  # notifications refused by a full queue since the last one accepted
        self._socket: socket.socket | None = None
        if self._address:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def send(self, *lines: str) -> None:
        """One datagram of ``KEY=value`` lines; a vanished socket is logged, never fatal.

        The send never waits: a receiver that stops reading (a wedged manager, a test harness)
        fills the socket's small queue, and a blocking send would then freeze the loop and the
        watchdog with it. A notification the queue refuses is dropped; the first drop and the
        recovery are logged.
        """
        if self._socket is None:
            return
        data = "\n".join(lines).encode()
        with self._lock:
            try:
                self._socket.sendto(data, socket.MSG_DONTWAIT, self._address)
            except BlockingIOError:
                self._dropped += 1
                if self._dropped == 1:
                    log.warning("sd_notify: %s is full (nothing reads it); dropping notifications", self._address)
                return
            except OSError as e:
                log.debug("sd_notify to %s failed: %s", self._address, e.strerror)
                return
            if self._dropped:
                log.info("sd_notify: %s accepts again after %d dropped notification(s)", self._address, self._dropped)
                self._dropped = 0

    def ready(self, status: str) -> None:
        self.send("READY=1", "STATUS=" + status)

    def status(self, text: str) -> None:
        self.send("STATUS=" + text.replace("\n", " "))

    def reloading(self) -> None:
        self.send("RELOADING=1")

    def stopping(self) -> None:
        self.send("STOPPING=1")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def watchdog_interval_s() -> float | None:
    """Half of ``$WATCHDOG_USEC`` when the watchdog is meant for this process, else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(int(usec), 1) / 2e6
    except ValueError:
        log.warning("ignoring malformed WATCHDOG_USEC=%r", usec)
        return None


class Watchdog:
    """Pings ``WATCHDOG=1`` every ``interval_s`` while ``problem()`` finds none; silent otherwise.

    Withholding, it says why, in the journal and as ``STATUS=``: the loop's own status line goes stale
    when the loop itself is what is stuck (one lane runs inference on it), and systemd's "Watchdog
    timeout" names no cause, so the reason would otherwise be nowhere before the restart.
    """

    def __init__(self, notifier: Notifier, interval_s: float, problem: Callable[[], str | None]) -> None:
        self._notifier = notifier
        self._interval = interval_s
        self._problem = problem
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._was_healthy = True

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            problem = self._problem()
            if problem is None:
                self._notifier.send("WATCHDOG=1")
            if (problem is None) != self._was_healthy:
                if problem is None:
                    log.info("pipeline progressing again: watchdog pings resumed")
                else:
                    log.error("pipeline made no progress: watchdog pings withheld: %s", problem)
                    self._notifier.status(f"unhealthy: {problem}")
                self._was_healthy = problem is None

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._interval + 1)


def _journal_handler() -> logging.Handler | None:
    """journald's handler when systemd connected our output to the journal (JOURNAL_STREAM)."""
    if not os.environ.get("JOURNAL_STREAM"):
        return None
    try:
        from systemd.journal import JournalHandler
    except ImportError:
        return None
    handler: logging.Handler = JournalHandler(SYSLOG_IDENTIFIER="edged")
    return handler


def _stderr_handler() -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    return handler


def setup_logging(level: str) -> None:
    """journald with structured fields under systemd, plain stderr otherwise."""
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(_journal_handler() or _stderr_handler())
    root.setLevel(level.upper())


def follow_log_level(level: str) -> None:
    """A reload's ``service.log_level`` takes over from the next line on; a change is said at the
    higher of the two levels, so that the log shows it whichever way it goes."""
    root = logging.getLogger()
    new = logging.getLevelName(level.upper())
    if new == root.level:
        return
    log.log(max(new, root.level), "service.log_level: logging at %s from now on", level)
    root.setLevel(new)


def exit_safely(code: int) -> NoReturn:
    """Ends the process with ``code`` once what it owes is done, without the interpreter's finalisation.

    Finalisation frees, object by object, what the kernel frees at once with the process: 0.15-0.2 s
    of CPU at every stop on the development machine, more on a board's cores, paid by each stop,
    restart and rollback. And a thread that outlives its join (a daemon thread stuck in native code:
    OpenCV decoding a large image, a camera driver) was torn down by it with ``pthread_exit``, whose
    unwinding through OpenCV's C++ frames calls ``std::terminate``: SIGABRT instead of ``code``,
    which systemd reads as a crash to restart rather than a configuration error (78) to stop at.
    Such a thread holds nothing to save (the kernel releases a camera with the process).

    What is owed: ZeroMQ's queued messages, which libzmq sends out while its context is terminated
    (for at most each socket's linger, ``publish.linger_ms``), as finalisation did in freeing it;
    then the exit handlers (logging's flush among them), stdout and stderr. ZeroMQ is left as it is
    where another thread lingers: a socket is never to be closed under a thread that may be using
    it. Called on another thread than the main one (a stop the main thread never came out of a call
    for), only the logs are flushed: the main thread may hold what an exit handler needs (a hung
    inference, the session whose profiling a handler ends).
    """
    others = [t for t in threading.enumerate() if t is not threading.current_thread() and t not in _SIGNAL_THREADS]
    lingering = [t.name for t in others if t.is_alive()]
    if lingering:
        log.info("exiting with %d while %s still run(s) in native code", code, ", ".join(lingering))
    if threading.current_thread() is not threading.main_thread():
        logging.shutdown()
    else:
        if not lingering and "zmq" in sys.modules:
            import zmq

            zmq.Context.instance().destroy(linger=0)  # sockets still open (none should be) go at once
        atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def thread_progress(native_id: int) -> tuple[int, ...] | None:
    """CPU ticks, major page faults and bytes read so far by one of this process's threads (/proc); None once gone."""
    task = f"/proc/self/task/{native_id}"
    try:
        with open(f"{task}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2 :].split()  # the name in parentheses may hold spaces
        ticks, faults = int(fields[11]) + int(fields[12]), int(fields[9])  # utime + stime, majflt
    except (OSError, ValueError, IndexError):
        return None
    try:
        with open(f"{task}/io", "rb") as f:
            read = next(int(line.split()[1]) for line in f if line.startswith(b"rchar:"))
    except (OSError, ValueError, IndexError, StopIteration):  # no task accounting in this kernel
        read = 0
    return ticks, faults, read


class StartTimeout:
    """``EXTEND_TIMEOUT_USEC=`` while the start's model load (`Signals.unless_stopped`) progresses.

    A model the board takes longer than the unit's ``TimeoutStartSec=`` to load (a large model on a Pi,
    an engine compiled on the first start) was killed and started again the same way, without end. The
    load's thread is looked at every `LOAD_CHECK_S`: while its CPU time, page faults or bytes read grow,
    the timeout moves `LOAD_EXTEND_S` on; a stalled load (a disk or mount that hangs) gets no more, so
    systemd still ends a start that is stuck. ``STATUS=`` says how long the load has taken, and how long
    it has stalled. Outside systemd it does nothing.
    """

    def __init__(self, notifier: Notifier, signals: Signals) -> None:
        self._notifier = notifier
        self._signals = signals
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="start-timeout", daemon=True)

    def __enter__(self) -> StartTimeout:
        if self._notifier.enabled:
            self._thread.start()
        return self

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        watched: threading.Thread | None = None
        last: tuple[int, ...] | None = None
        since = moved = time.monotonic()
        warned = False  # that this stall outlasted the last extension
        while not self._done.wait(LOAD_CHECK_S):
            load, now = self._signals.loading, time.monotonic()
            if load is None or load.native_id is None:
                continue
            if load is not watched:
                watched, last, since, moved = load, None, now, now
            progress = thread_progress(load.native_id)
            if progress is None:
                continue
            if last is not None and progress != last:
                moved, warned = now, False
                extend = f"EXTEND_TIMEOUT_USEC={int(LOAD_EXTEND_S * 1e6)}"
                self._notifier.send(extend, f"STATUS=loading the model: {now - since:.0f} s so far")
            elif last is not None:
                stalled = f"no progress for {now - moved:.0f} s (its file on a disk or network mount that stalls?)"
                self._notifier.status(f"loading the model: {now - since:.0f} s so far, {stalled}")
                if now - moved >= LOAD_EXTEND_S and not warned:
                    warned = True
                    log.warning("the model's load has made %s: systemd's start timeout is no longer extended", stalled)
            last = progress


class StartStopped(Exception):
    """A stop (SIGTERM, SIGINT) asked for while the daemon was still starting: the start ends there, exit 0."""


class Signals:
    """SIGTERM/SIGINT ask for a stop; SIGHUP asks for a config reload. Both are just flags. The
    `UNUSED_SIGNALS` are said and ignored.

    ``edged run`` installs them before it reads its configuration or imports the daemon's modules:
    until then SIGHUP's default action ends the process, which systemd counts as a clean exit and
    does not restart (``Restart=on-failure``), so one sent during a slow board's start stopped the
    service for good.
    """

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.reload = threading.Event()
        self.loading: threading.Thread | None = None  # `unless_stopped`'s thread while it runs (`StartTimeout`)
        self.wake: Waker | None = None  # the loop's (`edged.wake`): set at each signal (`_watch_stops`)
        self._unused_said = LogRate(60.0)

    def unless_stopped(self, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``work(*args, **kwargs)`` (the model's load at start) on a thread of its own: its result or its
        error, or `StartStopped` as soon as a stop is asked for meanwhile.

        A load runs in native code, where no signal handler runs, for as long as the board takes (a large
        model, an engine built on the first start, a card that stalls): a stop waiting for it outlasted
        ``TimeoutStopSec=``, and systemd killed edged and marked the unit failed. The thread is left
        to the exit (`exit_safely`).
        """
        if self.stop.is_set():
            raise StartStopped
        outcome: list[T] = []
        failure: list[BaseException] = []
        done = threading.Event()

        def run() -> None:
            try:
                outcome.append(work(*args, **kwargs))
            except BaseException as e:  # raised again on the waiting thread
                failure.append(e)
            finally:
                done.set()

        self.loading = threading.Thread(target=run, name="model-load", daemon=True)
        self.loading.start()
        try:
            while not done.wait(STOP_POLL_S):
                if self.stop.is_set():
                    raise StartStopped
        finally:
            self.loading = None
        if failure:
            raise failure[0]
        return outcome[0]

    def install(self) -> None:
        """The handlers, and a thread woken by every signal as it arrives (`_watch_stops`)."""
        woken, wake = os.pipe()
        os.set_blocking(wake, False)
        signal.set_wakeup_fd(wake, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_reload)
        for unused in UNUSED_SIGNALS:
            signal.signal(unused, self._on_unused)
        watch = threading.Thread(target=self._watch_stops, args=(woken,), name="signals", daemon=True)
        _SIGNAL_THREADS.add(watch)
        watch.start()

    def _watch_stops(self, woken: int) -> None:
        """End the process, exit 0, when a stop's handler has not run `STOP_STUCK_S` after the signal.

        Python runs a handler on the main thread between two bytecodes, so a stop waits for a native call
        there to return. With one inference lane the loop runs the model itself: a hung run never returns,
        and a slow board's takes seconds, so ``systemctl stop`` ended in SIGKILL at ``TimeoutStopSec=``
        (the unit then failed) and Ctrl-C did nothing. The C-level handler writes each signal's number to
        the wakeup descriptor at once, whatever the main thread is doing, which wakes this thread.

        It sets the loop's `wake` too: the handler runs once the main thread is back from its wait for
        frames, which the signal does not end where the kernel gave it to another thread, or where the
        wait is taken up again after the handler (a stop or reload then waited for the next frame).
        """
        stops = {signal.SIGTERM.value, signal.SIGINT.value}
        while received := os.read(woken, 64):
            if self.wake is not None:
                self.wake.set()
            signum = next((n for n in received if n in stops), None)
            if signum is not None and not self.stop.wait(STOP_STUCK_S):
                log.error(
                    "received %s, but the main thread has not come out of a call for %.0f s (a hung model or "
                    "camera call): exiting without finishing the stop",
                    signal.Signals(signum).name,
                    STOP_STUCK_S,
                )
                exit_safely(EXIT_OK)

    def _on_stop(self, signum: int, _frame: FrameType | None) -> None:
        log.info("received %s: stopping", signal.Signals(signum).name)
        self.stop.set()

    def _on_reload(self, _signum: int, _frame: FrameType | None) -> None:
        self.reload.set()

    def _on_unused(self, signum: int, _frame: FrameType | None) -> None:
        """Said once a minute at most: a script's ``kill -USR1`` (log rotation's habit) sent as often as it likes."""
        if self._unused_said.allows():
            log.warning(
                "received %s, which edged has no use for: ignored (`systemctl reload edged` reads the configuration "
                "again, SIGTERM stops it)",
                signal.Signals(signum).name,
            )
