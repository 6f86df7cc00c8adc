"""OPC UA output: each camera's verdicts as nodes a PLC or SCADA reads, subscribes to and triggers.

Under ``Objects/edged/<camera_id>/`` (namespace ``urn:edged``) every camera has::

    Verdict             String   "OK", "NG", or "uncertain" (a part the model cannot tell)
    Sequence            UInt64   the verdict message's seq, as on ZeroMQ's verdict topic
    PartId              String   the request's part id; empty when free-running or none given
    OkCount, NgCount    UInt64   verdicts since start
    State               String   the camera: starting, ok, lost or ended (from each status round)
    CaptureToVerdictMs  Double   capture to verdict
    LastMessage         String   the verdict message, JSON, as sent on ZeroMQ
    Trigger(partId: String) -> String   in request mode: the verdict message of a frame captured after the call

Until the first verdict, a verdict's variables are Bad_WaitingForInitialData. A verdict's values
are written together with the frame's capture time as source timestamp, so a subscriber gets
them as one set, once the journal has recorded the verdict (`JournalOutput.after_recorded`): a
PLC never acts on a verdict a crash could lose. Verdict repeats its value from one part to the
next: a subscriber that wants a notification for each verdict monitors Sequence, or Verdict with
the StatusValueTimestamp trigger.
The server runs on its own thread (`edged.opcua_server`); the frame loop only queues each change.

asyncua (2.0 or later) is an optional dependency (the ``opcua`` extra; `INSTALL_ASYNCUA` says how), imported
only when a configuration has ``[opcua]``.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

from edged.errors import EdgedError, KeyFileError, MissingDependency
from edged.listen import listen_tcp
from edged.output import Delivery, Endpoint, FrameReport, Output, OutputReport, Services, StatusReport
from edged.settings.opcua import OpcuaConfig, listen_host_port

if TYPE_CHECKING:
    from edged.config import Settings
    from edged.journal import JournalOutput
    from edged.opcua_server import Change, UaServer
    from edged.trigger import TriggerServer

log = logging.getLogger(__name__)

VERDICTS = {"ok": "OK", "ng": "NG", "uncertain": "uncertain"}  # the Verdict node's strings
DROPPED = "opcua_dropped"  # the status drop counting verdicts the server fell too far behind to write
MIN_ASYNCUA = 2  # the limits `edged.opcua_server` sets on connections and subscriptions came with 2.0
# How long a server replacing another waits for it to let go of the address: as long as
# `edged.opcua_server.UaServer.close` waits for a server still starting, and then stopping.
CLOSING_WAIT_S = 35.0
INSTALL_ASYNCUA = (
    "in a checkout, .venv/bin/python -m pip install -e '.[opcua]'; with the .deb, "
    f"sudo pip --python /usr/lib/edged/venv/bin/python install 'asyncua>={MIN_ASYNCUA}.0,<{MIN_ASYNCUA + 1}'"
)


def load_asyncua() -> None:
    """Import asyncua (2.0 or later), or raise `MissingDependency` saying how to install it. An older
    one, kept in the .deb's venv across upgrades, would pass the import and stop the server at start."""
    try:
        version = str(importlib.import_module("asyncua").__version__)
    except ImportError as e:
        raise MissingDependency(
            f"an [opcua] section needs asyncua {MIN_ASYNCUA}.0 or later, which this Python cannot import ({e}): "
            f"{INSTALL_ASYNCUA}"
        ) from e
    major = version.partition(".")[0]
    if not major.isdigit() or int(major) < MIN_ASYNCUA:
        raise MissingDependency(
            f"an [opcua] section needs asyncua {MIN_ASYNCUA}.0 or later, this Python has {version}: {INSTALL_ASYNCUA}"
        )


def opcua_problems(cfg: OpcuaConfig) -> list[str]:
    """What would stop the server from starting, one line each, reported when the config loads."""
    try:
        load_asyncua()
    except MissingDependency as e:
        return [f"opcua: {e}"]
    from edged.opcua_server import cert_dir_problem, read_users

    if cfg.users_file is None:
        return []
    try:
        read_users(cfg.users_file)
    except KeyFileError as e:
        return [str(e)]
    problem = cert_dir_problem(cfg.cert_dir)
    return [] if problem is None else [problem]


def describe(cfg: OpcuaConfig, settings: Settings) -> str:
    """``edged check``'s line: where, for which cameras, and who may sign in."""
    requesting = settings.requesting()
    trigger = f", Trigger on {', '.join(requesting)}" if requesting else ""
    cameras = f"verdicts of {', '.join(settings.inspected()) or 'no camera (none has [inspect])'}{trigger}"
    if cfg.users_file is None:
        return f"{cfg.listen}: {cameras}; anonymous, unencrypted (loopback only)"
    from edged.opcua_server import CERT_FILE, read_users

    users = read_users(cfg.users_file)
    cert = cfg.cert_dir / CERT_FILE
    made = "" if cert.is_file() else ", made on the first start"
    return (
        f"{cfg.listen}: {cameras}; Basic256Sha256 SignAndEncrypt, {len(users)} user(s) of {cfg.users_file}; "
        f"certificate {cert}{made}"
    )


def try_listen(listen: str) -> Callable[[], None]:
    """`Endpoint.bind` of ``opcua.listen``: bound and listening as the server binds it, then
    released. Raises `BindError` naming the key."""
    host, port = listen_host_port(listen)
    return listen_tcp("opcua.listen", listen, host, port, "the OPC UA server cannot listen there").close


def try_listen_after(closing: threading.Thread | None, listen: str) -> Callable[[], None]:
    """`try_listen`, once ``closing``, the thread stopping the server a reload replaced, has ended (within
    `CLOSING_WAIT_S`): the new server takes the address as the old one lets go of it. Called on the new
    server's own thread."""
    if closing is not None:
        closing.join(CLOSING_WAIT_S)
    return try_listen(listen)


class OpcuaOutput(Output):
    """The verdicts and states of ``cameras`` handed to the OPC UA server; `frame` never blocks."""

    def __init__(
        self,
        cfg: OpcuaConfig,
        cameras: Sequence[str],
        inspected: Sequence[str],
        requesting: Sequence[str],
        trigger_timeout_s: float,
        previous: OpcuaOutput | None = None,
        closing: threading.Thread | None = None,
    ) -> None:
        """``inspected``: the cameras with verdicts; ``requesting``: those in request mode, which get ``Trigger``;
        ``previous``: the output a reload replaces, whose counts and last verdicts go on here, closed by
        ``closing``: the new server listens once that thread has ended."""
        try:
            from edged.opcua_server import Change, UaServer
        except ImportError as e:
            raise MissingDependency(f"an [opcua] section needs asyncua ({e}): {INSTALL_ASYNCUA}") from None
        self.cfg = cfg
        self._change: type[Change] = Change
        self._key = (cfg, tuple(cameras), tuple(inspected), tuple(requesting), trigger_timeout_s)
        self._inspected = frozenset(inspected)
        self._counts: dict[str, Counter[str]] = {camera: Counter() for camera in cameras}
        self._states: dict[str, str] = {}
        self._journal: JournalOutput | None = None  # with it, a verdict's values wait until it is recorded
        self._last: dict[str, Change] = {}  # each camera's last verdict handed to the server
        listen = partial(try_listen_after, closing, cfg.listen)
        self.server: UaServer = UaServer(cfg, cameras, requesting, trigger_timeout_s, listen)
        if previous is not None:
            self._carry_on(previous)
        self._dropped = self.server.dropped  # the changes dropped as of the last status round

    @classmethod
    def from_settings(cls, settings: Settings, services: Services) -> OpcuaOutput | None:
        return cls._made(settings)

    @classmethod
    def _made(
        cls, settings: Settings, previous: OpcuaOutput | None = None, closing: threading.Thread | None = None
    ) -> OpcuaOutput | None:
        cfg = settings.opcua
        if cfg is None:
            return None
        requesting, timeout_s = settings.requesting(), settings.trigger.timeout_s
        return cls(cfg, settings.camera_ids(), settings.inspected(), requesting, timeout_s, previous, closing)

    @classmethod
    def listening(cls, settings: Settings) -> list[Endpoint]:
        cfg = settings.opcua
        return [] if cfg is None else [Endpoint("opcua.listen", cfg.listen, partial(try_listen, cfg.listen))]

    def wants(self, camera_id: str, found: bool) -> Delivery:
        """Every frame of an inspected camera has a verdict, OK ones too: a PLC waits for both."""
        return Delivery.SENT if camera_id in self._inspected else Delivery.NONE

    def frame(self, report: FrameReport) -> None:
        verdict = report.verdict
        if verdict is None or report.verdict_payload is None:
            return
        counts = self._counts.get(report.camera_id)
        if counts is None:
            return
        counts[verdict.verdict] += 1
        values = {
            "Verdict": VERDICTS[verdict.verdict],
            "Sequence": verdict.seq,
            "PartId": verdict.part_id or "",
            "OkCount": counts["ok"],
            "NgCount": counts["ng"],
            "CaptureToVerdictMs": verdict.verdict_latency_ms,
            "LastMessage": report.verdict_payload.decode(),
        }
        change = self._change(report.camera_id, values, verdict.capture_time_ns, report.outcome.frame.t_capture_ns)
        if self._journal is None:
            self._put_verdict(change)
        else:
            self._journal.after_recorded(partial(self._put_verdict, change))

    def _put_verdict(self, change: Change) -> None:
        """A verdict's values, to the server clients read now (`Output.current`): a verdict the journal
        held across a reload that restarted the server goes to the one that carries on."""
        current = self.current()
        if change.camera_id in current._counts:
            current._last[change.camera_id] = change
            current.server.put(change)

    def _carry_on(self, previous: OpcuaOutput) -> None:
        """After a reload that restarts the server, each camera's counts go on from the output this one
        replaces, and its last verdict and state are the new server's first values (the verdict
        written, not timed as an update), so that clients reconnecting see the verdicts since start,
        the last one, and the camera's state before the next status round. The server's counters
        go on too."""
        self.server.carry_on(previous.server)
        for camera, counts in self._counts.items():
            counts.update(previous._counts.get(camera, Counter()))
            last = previous._last.get(camera)
            if last is not None:
                self._last[camera] = last
                self.server.put(dataclasses.replace(last, capture_ns=0))
            state = previous._states.get(camera)
            if state is not None:
                self._states[camera] = state
                self.server.put(self._change(camera, {"State": state}, time.time_ns()))

    def use_journal(self, journal: JournalOutput | None) -> None:
        self._journal = journal

    def status(self, reports: Sequence[StatusReport]) -> None:
        """Each camera's state, written when it changes; and every camera's state and last verdict again
        after the server's line dropped changes (verdicts flooding in while it started, or while it
        fell behind), of which they may have been: one camera's verdicts never leave another's
        nodes at a verdict before its last, or any camera's state at one it has left."""
        if (dropped := self.server.dropped) != self._dropped:
            self._dropped = dropped
            for last in self._last.values():
                self.server.put(dataclasses.replace(last, capture_ns=0))
            for camera, state in self._states.items():
                self.server.put(self._change(camera, {"State": state}, time.time_ns()))
        for report in reports:
            message = report.message
            if self._states.get(message.camera_id) != message.source_state and message.camera_id in self._counts:
                self._states[message.camera_id] = message.source_state
                self.server.put(self._change(message.camera_id, {"State": message.source_state}, time.time_ns()))

    def report(self, camera_id: str) -> OutputReport:
        server = self.server
        p50, p99 = server.update_ms()
        clients = server.clients
        fields = {
            "opcua": {
                "listen": self.cfg.listen,
                "serving": server.serving,
                "clients": clients,
                "accept_failed": server.accept_failures.count,
                "requests": server.requests,
                "refused": server.users.refused,
                "updates": server.updates,
                "update_ms": {"p50_ms": p50, "p99_ms": p99},
            }
        }
        return OutputReport(drops={DROPPED: server.dropped}, fields=fields, summary=f"opcua {clients} client(s)")

    def reread_secrets(self) -> None:
        """SIGHUP: the users file again (its users take over from the next sign-in; raises KeyFileError,
        keeping the old ones)."""
        if self.cfg.users_file is not None:
            from edged.opcua_server import read_users

            self.server.users.replace(read_users(self.cfg.users_file))

    def carry_requests(self, server: TriggerServer) -> None:
        self.server.offer = server.offer

    def reload(self, settings: Settings, services: Services) -> OpcuaOutput | None:
        """The same settings and cameras keep this server and its sessions; others replace it."""
        key = (
            settings.opcua,
            tuple(settings.camera_ids()),
            tuple(settings.inspected()),
            tuple(settings.requesting()),
            settings.trigger.timeout_s,
        )
        if key == self._key:
            return self
        # Closed on a thread of its own: asyncua takes a second or more to stop a server, longer to
        # finish starting one first, and every camera's frames would wait as long on the loop's thread.
        closing = threading.Thread(target=self.close, name="edged-opcua-stop", daemon=True)
        closing.start()
        try:
            return OpcuaOutput._made(settings, previous=self, closing=closing)
        except EdgedError as e:  # the users file went, or the port was taken, between the check and here
            log.error("OPC UA output off until the next reload: %s", e)
            return None

    def close(self) -> None:
        self.server.close()
