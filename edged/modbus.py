"""Modbus TCP output: each camera's state and last verdict in holding registers a PLC polls, and a
coil per camera in request mode that triggers an inspection.

The register map is fixed across versions (docs/outputs.md, "Modbus TCP"). Camera i (in ``[[source]]``
order) has the block of 16 holding registers at ``base + 16 * i``::

    0   heartbeat: +1 per second while the loop turns (modulo 65536); a PLC watches it change
    1   state: 0 starting, 1 running, 2 camera lost, 3 throttled, 4 stopping
    2   last verdict: 0 none, 1 OK, 2 NG, 3 uncertain (a part the model cannot tell)
    3-4 the last verdict's sequence number, as on ZeroMQ and MQTT (32 bits, high word first)
    5-6 OK count since start (32 bits, high word first)
    7-8 NG count since start (32 bits, high word first)
    9   the last NG verdict's first reason's class id; 0xFFFF: none
    10  capture to this register update of the last verdict, in 0.1 ms (0xFFFF: 6.5535 s or more)
    11  frames per second x 10, over the last status interval
    12-13 part id of the next request, written by the PLC (32-bit unsigned, high word first; 0: none)
    14  the last request's error: 0 none, then `REQUEST_ERRORS`' codes
    15  reserved, 0

Only registers 12-13 take writes; the coil at ``base + 16 * i`` takes a request for camera i
when it is in request mode. The loop builds a verdict's new registers and writes them under
the lock every read takes, so a PLC never reads a new verdict with an old sequence number.

The server is pymodbus' (3.16 or a later 3.x, the ``modbus`` extra), run on an asyncio loop of
its own thread; a coil write goes to `edged.trigger.TriggerServer.offer`, whose answer (on the
loop's thread) clears the coil once the verdict's registers hold the verdict. Connections beyond
``max_connections`` are closed as they come, unless the client silent longest has been silent
for ``reclaim_idle_s``: it makes room instead (a PLC reconnecting after a restart gets in past
its stale connections); a client that lets
`edged.modbus_server.MAX_UNREAD_BYTES` of answers pile up unread is dropped. All three are counted.
pymodbus' own log lines (one per malformed frame) are kept to critical ones: a flood of bad
frames must not flood the journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

from edged.accept import AcceptFailures, quiet_accept_failures
from edged.errors import BindError, MissingDependency
from edged.listen import BIND_RETRY_S, listen_tcp, retry_bind
from edged.messages import ModbusReport, TriggerError, TriggerProblem, VerdictMessage
from edged.output import Delivery, Endpoint, FrameReport, Output, OutputReport, Services, StatusReport
from edged.settings.modbus import BLOCK, ModbusConfig

if TYPE_CHECKING:
    from pymodbus.server import ModbusTcpServer

    from edged.config import Settings
    from edged.journal import JournalOutput
    from edged.trigger import TriggerServer

log = logging.getLogger(__name__)

# Register offsets within a camera's block.
HEARTBEAT, STATE, VERDICT, SEQ, OK_COUNT, NG_COUNT, NG_CLASS, LATENCY, FPS, PART_ID, REQUEST_ERROR = (
    0,
    1,
    2,
    3,
    5,
    7,
    9,
    10,
    11,
    12,
    14,
)
STARTING, RUNNING, CAMERA_LOST, THROTTLED, STOPPING = range(5)
NO_VERDICT, OK, NG, UNCERTAIN = range(4)
VERDICT_WORDS = {"ok": OK, "ng": NG, "uncertain": UNCERTAIN}
NO_CLASS = 0xFFFF
REQUEST_ERRORS: dict[TriggerProblem, int] = {
    "bad_request": 1,
    "busy": 2,
    "timeout": 3,
    "camera_lost": 4,
    "thermal_critical": 5,
    "inference_failed": 6,
    "stopping": 7,
}
CLOSE_TIMEOUT_S = 2.0
MIN_MINOR = 16  # pymodbus 3.16: the server hooks `edged.modbus_server` uses
INSTALL_PYMODBUS = (
    "in a checkout, .venv/bin/python -m pip install -e '.[modbus]'; with the .deb, "
    "sudo pip --python /usr/lib/edged/venv/bin/python install 'pymodbus>=3.16,<4'"
)


def load_pymodbus() -> None:
    """Import pymodbus' server (3.16 or a later 3.x), or raise `MissingDependency` saying how to install it."""
    try:
        version = str(importlib.import_module("pymodbus").__version__)
        importlib.import_module("pymodbus.server")
    except ImportError as e:
        raise MissingDependency(
            f"a [modbus] section needs pymodbus 3.{MIN_MINOR} or a later 3.x, which this Python cannot import "
            f"({e}): {INSTALL_PYMODBUS}"
        ) from e
    major, _, rest = version.partition(".")
    minor = rest.partition(".")[0]
    if major != "3" or not minor.isdigit() or int(minor) < MIN_MINOR:
        raise MissingDependency(
            f"a [modbus] section needs pymodbus 3.{MIN_MINOR} or a later 3.x, this Python has {version}: {INSTALL_PYMODBUS}"
        )


def dependency_problems() -> list[str]:
    """What would stop the server from starting, one line each, reported when the configuration loads."""
    try:
        load_pymodbus()
    except MissingDependency as e:
        return [f"modbus: {e}"]
    return []


def bind(listen: str) -> socket.socket:
    """A socket bound and listening on ``listen`` as pymodbus binds it; raises `BindError` naming
    ``modbus.listen`` and what to do."""
    host, port = ModbusConfig(listen=listen, allow_remote=True).host_port()
    privileged = (
        "a port below 1024 (502) needs CAP_NET_BIND_SERVICE: add the drop-in docs/outputs.md's Modbus section "
        "gives, or choose a port from 1024"
    )
    return listen_tcp("modbus.listen", listen, host, port, "the Modbus server cannot listen there", privileged)


def _try_bind(listen: str) -> Callable[[], None]:
    """`Endpoint.bind` of ``modbus.listen`` (``edged check``)."""
    return bind(listen).close


def part_id_of(high: int, low: int) -> str | None:
    """The part id registers 12-13 hold: their 32-bit number in decimal, None for 0."""
    number = (high << 16) | low
    return str(number) if number else None


class Registers:
    """Every camera's block and request coil, behind one lock: the loop writes a whole block at once,
    the server's thread reads and writes under the same lock, so no read sees half an update."""

    def __init__(self, base: int, cameras: int) -> None:
        self.base = base
        self.end = base + BLOCK * cameras
        self.words = [0] * (BLOCK * cameras)
        for i in range(cameras):
            self.words[BLOCK * i + NG_CLASS] = NO_CLASS
        self.coils = [False] * cameras
        self.lock = threading.Lock()

    def read(self, address: int, count: int) -> list[int] | None:
        """Holding registers ``address`` on; None when any is outside the blocks."""
        if not self.base <= address or address + count > self.end:
            return None
        with self.lock:
            return self.words[address - self.base : address - self.base + count]

    def write_part_id(self, address: int, values: Sequence[int]) -> bool:
        """Registers 12-13 of a block; False (nothing written) when the write touches any other."""
        offsets = [(address + k - self.base) for k in range(len(values))]
        if not offsets or offsets[0] < 0 or address + len(values) > self.end:
            return False
        if any(offset % BLOCK not in (PART_ID, PART_ID + 1) for offset in offsets):
            return False
        with self.lock:
            for offset, value in zip(offsets, values, strict=True):
                self.words[offset] = value
        return True

    def coil_index(self, address: int) -> int | None:
        """The camera whose coil is at ``address``; None for an address between them or outside."""
        offset = address - self.base
        return offset // BLOCK if 0 <= offset < self.end - self.base and offset % BLOCK == 0 else None

    def read_coils(self, address: int, count: int) -> list[bool] | None:
        """Coils ``address`` on (those between the cameras' read 0); None when any is outside the blocks."""
        if not self.base <= address or address + count > self.end:
            return None
        with self.lock:
            return [(index := self.coil_index(a)) is not None and self.coils[index] for a in range(address, address + count)]


class ModbusOutput(Output):
    """The server of one configuration; its thread serves, the loop's calls only write registers."""

    def __init__(
        self,
        cfg: ModbusConfig,
        camera_ids: Sequence[str],
        requesting: Sequence[str],
        inspected: Sequence[str],
        previous: ModbusOutput | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``previous``: the server a reload replaces, closed, whose registers and counts go on here;
        ``clock``: what the server times each connection's silence by (`reclaim_idle_s`)."""
        load_pymodbus()
        self.cfg = cfg
        self.clock = clock
        self.camera_ids = list(camera_ids)
        self.requesting = frozenset(requesting)
        self.inspected = frozenset(inspected)
        self._index = {camera: i for i, camera in enumerate(camera_ids)}
        self.registers = Registers(cfg.base, len(camera_ids))
        self._ok = [0] * len(camera_ids)
        self._ng = [0] * len(camera_ids)
        self._stopping = False
        self._t0_ns: int = previous._t0_ns if previous is not None else time.monotonic_ns()  # the heartbeat goes on
        self._trigger: TriggerServer | None = None
        self._journal: JournalOutput | None = None  # with it, a verdict's registers wait until it is recorded
        # Counted on the server's thread, read by `report`: plain ints, each written by that thread alone.
        self.requests = 0  # requests answered, exceptions included
        self.exceptions = 0  # requests answered with a Modbus exception
        self.refused = 0  # connections closed as they came, beyond max_connections
        self.unread = 0  # connections closed for leaving their answers unread
        self.reclaimed = 0  # silent connections closed to make room for a new client
        self.triggers = 0  # inspection requests taken through a coil
        self.clients = 0
        if previous is not None:
            self._carry_on(previous)
        self._loop = asyncio.new_event_loop()
        self.accept_failures = AcceptFailures("modbus")
        quiet_accept_failures(self._loop, self.accept_failures)  # said once, not a traceback per try
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="edged-modbus", daemon=True)
        self._thread.start()

    # ---- as an output (`edged.output`) --------------------------------------------------------

    @classmethod
    def from_settings(cls, settings: Settings, services: Services) -> ModbusOutput | None:
        if settings.modbus is None:
            return None
        return cls(settings.modbus, settings.camera_ids(), settings.requesting(), settings.inspected())

    @classmethod
    def listening(cls, settings: Settings) -> list[Endpoint]:
        if settings.modbus is None:
            return []
        listen = settings.modbus.listen
        return [Endpoint("modbus.listen", f"modbus://{listen}", partial(_try_bind, listen))]

    def wants(self, camera_id: str, found: bool) -> Delivery:
        """Every verdict of an inspected camera, the registers being the PLC's only view of them."""
        return Delivery.SENT if camera_id in self.inspected else Delivery.NONE

    def frame(self, report: FrameReport) -> None:
        """A verdict's registers, once the journal has it (`JournalOutput.after_recorded`): a PLC
        never acts on a verdict a crash could lose."""
        verdict = report.verdict
        if verdict is None or report.camera_id not in self._index:
            return
        write = partial(self._write, report.camera_id, verdict, report.outcome.frame.t_capture_ns)
        if self._journal is None:
            write()
        else:
            self._journal.after_recorded(write)

    def use_journal(self, journal: JournalOutput | None) -> None:
        self._journal = journal

    def _write(self, camera_id: str, verdict: VerdictMessage, t_capture_ns: int) -> None:
        """A verdict's registers, written by the server the PLC reads now (`Output.current`): one
        the journal held across a reload goes to the server that replaced this one."""
        current = self.current()
        index = current._index.get(camera_id)
        if index is None:  # the camera went with a reload
            return
        current._put(index, verdict, t_capture_ns)

    def _put(self, index: int, verdict: VerdictMessage, t_capture_ns: int) -> None:
        """Write a verdict's registers at once under the lock (the heartbeat with them); an uncertain
        verdict counts as neither OK nor NG."""
        if verdict.verdict == "ok":
            self._ok[index] += 1
        elif verdict.verdict == "ng":
            self._ng[index] += 1
        ng_class = verdict.reasons[0].class_id if verdict.verdict == "ng" and verdict.reasons else NO_CLASS
        at = BLOCK * index
        registers = self.registers
        now_ns = time.monotonic_ns()
        latency_ns = now_ns - t_capture_ns
        with registers.lock:
            words = registers.words
            words[at + HEARTBEAT] = self._heartbeat(now_ns)
            words[at + VERDICT] = VERDICT_WORDS[verdict.verdict]
            _put32(words, at + SEQ, verdict.seq)
            _put32(words, at + OK_COUNT, self._ok[index])
            _put32(words, at + NG_COUNT, self._ng[index])
            words[at + NG_CLASS] = min(ng_class, NO_CLASS)
            words[at + LATENCY] = min(latency_ns // 100_000, 0xFFFF)

    def status(self, reports: Sequence[StatusReport]) -> None:
        """Each camera's state, rate and the heartbeat, once per status round."""
        now_ns = time.monotonic_ns()
        heartbeat = self._heartbeat(now_ns)
        registers = self.registers
        with registers.lock:
            for report in reports:
                message = report.message
                index = self._index.get(message.camera_id)
                if index is None:
                    continue
                at = BLOCK * index
                registers.words[at + HEARTBEAT] = heartbeat
                registers.words[at + STATE] = self._state(
                    message.source_state, message.thermal.state if message.thermal else None
                )
                registers.words[at + FPS] = min(round(message.fps * 10), 0xFFFF)

    def report(self, camera_id: str) -> OutputReport:
        modbus = ModbusReport(
            clients=self.clients,
            accept_failed=self.accept_failures.count,
            requests=self.requests,
            exceptions=self.exceptions,
            refused=self.refused,
            unread=self.unread,
            reclaimed=self.reclaimed,
            triggers=self.triggers,
        )
        return OutputReport(fields={"modbus": modbus}, summary=f"modbus {self.clients} client(s)")

    def carry_requests(self, server: TriggerServer) -> None:
        self._trigger = server

    def reload(self, settings: Settings, services: Services) -> ModbusOutput | None:
        """The same ``[modbus]`` and cameras keep this server; other settings get a new one."""
        same = (settings.modbus, settings.camera_ids(), frozenset(settings.requesting()), frozenset(settings.inspected()))
        if same == (self.cfg, self.camera_ids, self.requesting, self.inspected):
            return self
        self.close()
        if settings.modbus is None:
            return None
        return ModbusOutput(
            settings.modbus, settings.camera_ids(), settings.requesting(), settings.inspected(), previous=self
        )

    def drain(self) -> None:
        """At stop: every camera's state says stopping, for the last status round and after."""
        self._stopping = True
        with self.registers.lock:
            for index in range(len(self.camera_ids)):
                self.registers.words[BLOCK * index + STATE] = STOPPING

    def close(self) -> None:
        """Stop serving within `CLOSE_TIMEOUT_S`: connections closed, the port released."""
        stop = self._stop
        if stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended already
                self._loop.call_soon_threadsafe(stop.set)
        self._thread.join(CLOSE_TIMEOUT_S)

    def _carry_on(self, previous: ModbusOutput) -> None:
        """After a reload, each camera's registers, counts and request coil go on from the server this
        one replaces, so that a PLC sees the counts since start, no verdict vanish, and a request in
        hand keeps its coil at 1 until it is answered here. What still comes for the server replaced,
        verdicts the journal holds and requests' answers, comes here (`Output.current`). The server's own
        counters go on too (its thread has stopped): the status says them since start."""
        self.requests, self.exceptions, self.refused = previous.requests, previous.exceptions, previous.refused
        self.unread, self.reclaimed, self.triggers = previous.unread, previous.reclaimed, previous.triggers
        for camera, index in self._index.items():
            was = previous._index.get(camera)
            if was is not None:
                block = previous.registers.words[BLOCK * was : BLOCK * (was + 1)]
                self.registers.words[BLOCK * index : BLOCK * (index + 1)] = block
                self.registers.coils[index] = previous.registers.coils[was]
                self._ok[index], self._ng[index] = previous._ok[was], previous._ng[was]

    # ---- the loop's side ----------------------------------------------------------------------

    def _heartbeat(self, now_ns: int) -> int:
        return ((now_ns - self._t0_ns) // 1_000_000_000) & 0xFFFF

    def _state(self, source_state: str, thermal_state: str | None) -> int:
        if self._stopping or source_state == "ended":
            return STOPPING
        if source_state == "lost":
            return CAMERA_LOST
        if source_state == "starting":
            return STARTING
        return THROTTLED if thermal_state in ("throttled", "critical") else RUNNING

    def _answered(self, camera_id: str, reply: VerdictMessage | TriggerError) -> None:
        """A request's reply (on the loop's thread, or at once when refused on arrival): its coil
        cleared, and the error register set, after the verdict's registers were written (`frame`)."""
        current = self.current()
        index = current._index.get(camera_id)
        if index is None:  # the camera went with a reload
            return
        registers = current.registers
        with registers.lock:
            registers.coils[index] = False
            error = REQUEST_ERRORS[reply.error] if isinstance(reply, TriggerError) else 0
            registers.words[BLOCK * index + REQUEST_ERROR] = error

    # ---- the server's thread ------------------------------------------------------------------

    def takes_requests(self, index: int) -> bool:
        """Whether camera ``index``'s coil takes requests: it is in request mode, and requests are carried."""
        return self.camera_ids[index] in self.requesting and self._trigger is not None

    def request(self, index: int) -> None:
        """Camera ``index``'s coil set to 1 (`takes_requests`): its request, with the part id of its
        registers 12-13. A coil already 1 (a request in hand) is left so, taking no second request."""
        server = self._trigger
        if server is None:
            return
        registers = self.registers
        with registers.lock:
            if registers.coils[index]:
                return
            registers.coils[index] = True
            at = BLOCK * index
            part_id = part_id_of(registers.words[at + PART_ID], registers.words[at + PART_ID + 1])
        self.triggers += 1
        camera_id = self.camera_ids[index]
        server.offer("modbus", camera_id, part_id, partial(self._answered, camera_id))

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except Exception:  # a bug here must not end the daemon: the registers stop, the rest goes on
            log.exception("the Modbus server failed and stops; detection goes on")
        finally:
            self.clients = 0
            self._loop.close()

    async def _serve(self) -> None:
        """Listen (retrying every `BIND_RETRY_S` while the address cannot be bound), serve until `close`."""
        from edged.modbus_server import start_server

        self._stop = asyncio.Event()
        logging.getLogger("pymodbus").setLevel(logging.CRITICAL)

        async def attempt() -> ModbusTcpServer:
            bind(self.cfg.listen).close()  # says why, where pymodbus would only fail
            return await start_server(self)

        def said(e: Exception) -> None:
            log.error("%s; the registers are not served, detection goes on; retrying every %.0f s", e, BIND_RETRY_S)

        server = await retry_bind(attempt, self._stop, said, (BindError, RuntimeError))
        if server is None:  # closed first
            return
        log.info("Modbus TCP on %s, unit %d, registers from %d", self.cfg.listen, self.cfg.unit_id, self.cfg.base)
        await self._stop.wait()
        await server.shutdown()  # type: ignore[no-untyped-call]


def _put32(words: list[int], at: int, value: int) -> None:
    """A 32-bit number (modulo 2**32) into two registers, high word first."""
    words[at] = (value >> 16) & 0xFFFF
    words[at + 1] = value & 0xFFFF
