"""systemd integration: sd_notify, the progress-gated watchdog, journald logging, signals.

Outside systemd (no ``NOTIFY_SOCKET``, no ``JOURNAL_STREAM``) every part quietly does nothing
special: notifications are skipped and logs go to stderr.

The watchdog is the reason this module exists: ``WATCHDOG=1`` is sent at half of
``WATCHDOG_USEC`` only while ``healthy()`` says the pipeline is really progressing. A loop stuck
in inference or a dead capture thread therefore stops the pings, and systemd restarts us.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from types import FrameType

log = logging.getLogger(__name__)


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
    """Pings ``WATCHDOG=1`` every ``interval_s`` while ``healthy()`` holds; silent otherwise."""

    def __init__(self, notifier: Notifier, interval_s: float, healthy: Callable[[], bool]) -> None:
        self._notifier = notifier
        self._interval = interval_s
        self._healthy = healthy
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._was_healthy = True

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            healthy = self._healthy()
            if healthy:
                self._notifier.send("WATCHDOG=1")
            if healthy != self._was_healthy:
                level = logging.INFO if healthy else logging.ERROR
                log.log(
                    level,
                    "pipeline %s: watchdog pings %s",
                    "progressing again" if healthy else "made no progress",
                    "resumed" if healthy else "withheld",
                )
                self._was_healthy = healthy

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


def exit_safely(code: int) -> int:
    """``code``, for the interpreter to exit with; or the process ends here with it while a thread still runs.

    A thread that outlives its join is a daemon thread stuck in native code (OpenCV decoding a
    large image, a camera driver). If the interpreter finalises around it, the thread's return to
    Python tears it down with ``pthread_exit``, whose unwinding through OpenCV's C++ frames calls
    ``std::terminate``: SIGABRT instead of ``code``, which systemd reads as a crash to restart
    rather than a configuration error (78) to stop at. Such a thread holds nothing to save (the
    kernel releases a camera with the process), so the logs and output are flushed and the process
    leaves with ``os._exit``, skipping finalisation.
    """
    lingering = [t.name for t in threading.enumerate() if t is not threading.current_thread() and t.is_alive()]
    if not lingering:
        return code
    log.info("exiting with %d while %s still run(s) in native code", code, ", ".join(lingering))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Signals:
    """SIGTERM/SIGINT ask for a stop; SIGHUP asks for a config reload. Both are just flags."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.reload = threading.Event()

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_reload)

    def _on_stop(self, signum: int, _frame: FrameType | None) -> None:
        log.info("received %s: stopping", signal.Signals(signum).name)
        self.stop.set()

    def _on_reload(self, _signum: int, _frame: FrameType | None) -> None:
        self.reload.set()
