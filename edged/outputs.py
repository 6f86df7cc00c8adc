"""The outputs edged has, and the one list of them the daemon loops over.

Adding an output is a module with an `edged.output.Output` subclass, its settings section, and
one line in `OUTPUTS`. The order is the order each frame and status round reaches them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TypeVar

from edged.camera import Camera
from edged.config import Settings
from edged.errors import ConfigError
from edged.evidence import EvidenceOutput
from edged.files import MadeFolders
from edged.http import HttpServer
from edged.journal import JournalOutput
from edged.messages import ThermalState, VerdictMessage
from edged.modbus import ModbusOutput
from edged.mqtt import MqttOutput
from edged.opcua import OpcuaOutput
from edged.output import Delivery, Endpoint, FrameReport, Output, OutputReport, Services, StatusReport
from edged.pipeline import Processed, verdict_message
from edged.publish import Publisher
from edged.reject import RejectOutput
from edged.sources.base import Frame
from edged.trigger import Request, TriggerServer

OutputT = TypeVar("OutputT", bound=Output)

# The reject line first: a verdict acts on the line before anything else is done with it. Evidence
# before the journal, which records where the image went; the journal before ZeroMQ, whose verdicts
# wait for it (`JournalOutput.after_recorded`).
OUTPUTS: tuple[type[Output], ...] = (
    RejectOutput,
    EvidenceOutput,
    JournalOutput,
    Publisher,
    MqttOutput,
    HttpServer,
    OpcuaOutput,
    ModbusOutput,
)


def listening(settings: Settings) -> list[Endpoint]:
    """Every address the daemon would listen on with ``settings``: each output's (`Output.listening`),
    then the trigger server's, which takes requests rather than sending results."""
    return [*(endpoint for kind in OUTPUTS for endpoint in kind.listening(settings)), *TriggerServer.listening(settings)]


class Outputs:
    """The running outputs, in `OUTPUTS` order; a failure while opening them closes those already open."""

    def __init__(self, settings: Settings, services: Services) -> None:
        """Raises `ConfigError` where two cameras' evidence would go to one folder (`EvidenceOutput.shared`;
        a reload that would is refused as it loads, `edged.reload.load_replacement`)."""
        made = MadeFolders()  # the cameras' folders, made to be compared: removed where the start is refused
        if (problem := EvidenceOutput.shared(settings, made)) is not None:
            made.remove()
            raise ConfigError(None, [problem])
        self.services = services
        self._kinds = OUTPUTS
        self._server: TriggerServer | None = None
        self._running: dict[type[Output], Output] = {}
        with contextlib.ExitStack() as opened:
            for kind in self._kinds:
                output = kind.from_settings(settings, services)
                if output is not None:
                    opened.callback(output.close)
                    self._running[kind] = output
            opened.pop_all()
        self._lend_journal()

    def get(self, kind: type[OutputT]) -> OutputT | None:
        """The running output of ``kind``, if its section configures one."""
        output = self._running.get(kind)
        return output if isinstance(output, kind) else None

    def wants(self, camera_id: str, found: bool) -> Delivery:
        """The most any output wants of this frame (`Delivery`)."""
        return max((output.wants(camera_id, found) for output in self._running.values()), default=Delivery.NONE)

    def taken(self, camera_id: str, t_capture_ns: int) -> None:
        """Camera ``camera_id``'s frame captured at ``t_capture_ns`` went to the model (`Output.taken`)."""
        for output in self._running.values():
            output.taken(camera_id, t_capture_ns)

    def publish(
        self, camera: Camera, done: Processed, request: Request | None, thermal_state: ThermalState
    ) -> VerdictMessage | None:
        """Hand ``done`` to every output, with the messages the most demanding asked for (`Delivery`);
        returns the verdict message sent, if any. A frame taken for a ``request`` is sent whatever an
        output's ``publish_empty`` says, with the request's part id."""
        found = len(done.result) > 0 or request is not None
        part_id = request.part_id if request else None
        report = _report(camera, done, found, self.wants(camera.id, found), part_id, thermal_state)
        for output in self._running.values():
            output.frame(report)
        return report.verdict

    def after_recorded(self, send: Callable[[], object]) -> None:
        """Call ``send``, a verdict leaving edged, once the journal has recorded this frame's entries
        (`JournalOutput.after_recorded`); at once without a journal."""
        journal = self.get(JournalOutput)
        if journal is None:
            send()
        else:
            journal.after_recorded(send)

    def deliver_recorded(self) -> None:
        """Every turn of the loop: the sends the journal has recorded go out (`JournalOutput.deliver_recorded`)."""
        journal = self.get(JournalOutput)
        if journal is not None:
            journal.deliver_recorded()

    def previews(self, camera_id: str) -> bool:
        """Some output shows camera ``camera_id``'s next frame unprocessed (`Output.previews`)."""
        return any(output.previews(camera_id) for output in self._running.values())

    def preview(self, camera_id: str, frame: Frame) -> None:
        for output in self._running.values():
            if output.previews(camera_id):
                output.preview(camera_id, frame)

    def status(self, reports: Sequence[StatusReport]) -> None:
        for output in self._running.values():
            output.status(reports)

    def reports(self, camera_id: str) -> list[OutputReport]:
        return [output.report(camera_id) for output in self._running.values()]

    def carry_requests(self, server: TriggerServer) -> None:
        """Requests that arrive through an output go to ``server``, now and from outputs a reload starts."""
        self._server = server
        for output in self._running.values():
            output.carry_requests(server)

    def reread_secrets(self) -> None:
        for output in self._running.values():
            output.reread_secrets()

    def reload(self, settings: Settings) -> None:
        """A reload's settings take over: each output adapts, is replaced, starts or stops (`Output.reload`)."""
        for kind in self._kinds:
            running = self._running.pop(kind, None)
            output = running.reload(settings, self.services) if running else kind.from_settings(settings, self.services)
            if running is not None and output is not running:
                running.replaced_by = output
            if output is None:
                continue
            self._running[kind] = output
            if output is not running and self._server is not None:
                output.carry_requests(self._server)
        self._lend_journal()

    def _lend_journal(self) -> None:
        """Every output learns of the journal (`Output.use_journal`)."""
        journal = self.get(JournalOutput)
        for output in self._running.values():
            output.use_journal(journal)

    def drain(self) -> None:
        for output in self._running.values():
            output.drain()

    def close(self) -> None:
        for output in self._running.values():
            output.close()
        self._running.clear()


def _report(
    camera: Camera, done: Processed, found: bool, delivery: Delivery, part_id: str | None, thermal_state: ThermalState
) -> FrameReport:
    """``done`` with as much of its messages as ``delivery`` asks: a message only shown takes no seq."""
    if delivery is Delivery.NONE:
        return FrameReport(camera.id, done, found)
    seq = camera.next_seq("detections") if delivery is Delivery.SENT else 0
    msg = camera.path.message(done, seq=seq, thermal_state=thermal_state, part_id=part_id)
    if delivery is Delivery.SHOWN:
        return FrameReport(camera.id, done, found, msg)
    verdict = verdict_message(msg, camera.next_seq("verdict")) if msg.verdict is not None else None
    sent = verdict.model_dump_json().encode() if verdict else None
    return FrameReport(camera.id, done, found, msg, msg.model_dump_json().encode(), verdict, sent)
