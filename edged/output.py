"""What an output is: one way a frame's results, the verdicts and the status leave edged.

ZeroMQ (`edged.publish`), MQTT (`edged.mqtt`), the live view (`edged.http`) and evidence
(`edged.evidence`) are each an `Output`; `edged.outputs` lists them and the daemon loops over
that list. An output is made from the settings (`from_settings`, None when its section is
absent), says per frame whether it wants the message (`wants`), gets the frame's report
(`frame`), may learn of a frame as it is taken, before its result (`taken`), may show a camera's
frames unprocessed while it waits for requests (`previews`, `preview`), gets every status round
(`status`), adds what it knows to each camera's status (`report`), follows a reload (`reload`,
which may return a new output or None; what still comes for one replaced goes to `current`) and
closes. Every method but `close` runs on the loop's thread and must never block it. An output
that listens (a server) lists its addresses (`listening`), which ``edged check`` binds and
releases. The reject line (`edged.reject`) is an output too.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

if TYPE_CHECKING:
    from edged.config import Settings
    from edged.journal import JournalOutput
    from edged.messages import DetectionsMessage, StatusMessage, VerdictMessage
    from edged.pipeline import Processed
    from edged.prometheus import CameraStatus
    from edged.sources.base import Frame
    from edged.trigger import TriggerServer
    from edged.wake import Waker


class Delivery(enum.IntEnum):
    """How much of a frame an output wants, ordered: the daemon builds what the most demanding asks."""

    NONE = 0  # nothing
    SHOWN = 1  # the message to show, with the frame; it takes no sequence number
    SENT = 2  # the message as sent (a sequence number, the JSON payload, the verdict message)


@dataclass(frozen=True, slots=True)
class FrameReport:
    """One processed frame of camera ``camera_id`` as every output gets it.

    ``outcome`` is a view into the camera's plan, valid until its next frame: an output that
    keeps anything of it copies it (the evidence writer copies the image it saves). ``message``
    is there when some output asked for it (`Delivery.SHOWN`); ``payload``, ``verdict`` and
    ``verdict_payload``, the JSON bytes sent, when one asked for `Delivery.SENT`. ``saved`` is what
    an output kept of the frame, for those after it in `edged.outputs.OUTPUTS` (evidence: the image's path).
    """

    camera_id: str
    outcome: Processed
    found: bool  # the frame has results, or was taken for a request: sent whatever ``publish_empty`` says
    message: DetectionsMessage | None = None
    payload: bytes | None = None
    verdict: VerdictMessage | None = None
    verdict_payload: bytes | None = None
    saved: dict[str, str] = field(default_factory=dict)

    def sent(self, publish_empty: bool) -> bytes | None:
        """The payload an output that skips empty frames unless ``publish_empty`` sends, if any."""
        return self.payload if self.found or publish_empty else None


@dataclass(frozen=True, slots=True)
class OutputReport:
    """What an output adds to one camera's status: drop counters, status message fields (by name),
    and a few words for systemd's STATUS= line."""

    drops: Mapping[str, int] = field(default_factory=dict)
    fields: Mapping[str, Any] = field(default_factory=dict)
    summary: str | None = None


NO_REPORT = OutputReport()


@dataclass(frozen=True, slots=True)
class StatusReport:
    """One camera's status message as sent (``payload``), with what ``/metrics`` adds to it."""

    status: CameraStatus  # the message, its stage histograms, its verdict counts (None without [inspect])
    payload: bytes

    @property
    def message(self) -> StatusMessage:
        return self.status[0]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """An address edged would listen on, as ``edged check`` names and tries it.

    ``bind`` binds it as `run` will and returns what releases it; it raises `edged.errors.BindError`
    naming ``key`` when the address is in use or cannot be bound.
    """

    key: str  # the setting that names it: "publish.endpoints", "http.listen"
    address: str  # as a client reaches it: the endpoint, the URL
    bind: Callable[[], Callable[[], None]]


@dataclass(frozen=True, slots=True)
class Services:
    """What the daemon lends its outputs: the health verdict ``/healthz`` serves, and the loop's
    wake-up, for an output whose thread has something for the loop (the journal, `Outputs.deliver_recorded`)."""

    health: Callable[[], str | None]
    wake: Waker


OutputT = TypeVar("OutputT", bound="Output")


class Output:
    """The base of every output; each hook does nothing unless the output needs it."""

    replaced_by: Output | None = None  # set by `edged.outputs.Outputs.reload` when a reload replaces it

    def current(self: OutputT) -> OutputT:
        """This output, or the one a reload put in its place (and so on): what still comes for a
        replaced output, such as a send the journal held across the reload, goes on there."""
        output: Output = self
        while output.replaced_by is not None:
            output = output.replaced_by
        return cast(OutputT, output)

    @classmethod
    def from_settings(cls, settings: Settings, services: Services) -> Output | None:
        """The output ``settings`` configure, started; None when they configure none."""
        raise NotImplementedError

    @classmethod
    def listening(cls, settings: Settings) -> list[Endpoint]:
        """The addresses this output would listen on with ``settings``, none unless it is a server:
        ``edged check`` binds and releases each, so that one in use is found before `run`."""
        return []

    def wants(self, camera_id: str, found: bool) -> Delivery:
        """What this output wants of camera ``camera_id``'s next frame (``found``: it has results). No allocation."""
        return Delivery.NONE

    def taken(self, camera_id: str, t_capture_ns: int) -> None:
        """Camera ``camera_id``'s frame captured at ``t_capture_ns`` (monotonic) went to the model to be
        published: its `frame` follows unless the contract rejects the frame or the model fails. An
        output with a deadline per part (the reject line) starts counting here. No allocation."""

    def frame(self, report: FrameReport) -> None:
        """Every processed frame, with what the outputs' `wants` asked for."""

    def previews(self, camera_id: str) -> bool:
        """Whether this output would show camera ``camera_id``'s next frame unprocessed (a camera in
        request mode between requests). No allocation."""
        return False

    def preview(self, camera_id: str, frame: Frame) -> None:
        """A frame nobody asked the model about, right after `previews` said yes; ``frame`` is valid
        only during the call."""

    def status(self, reports: Sequence[StatusReport]) -> None:
        """Every camera's status, once per status round."""

    def report(self, camera_id: str) -> OutputReport:
        """What this output adds to camera ``camera_id``'s status."""
        return NO_REPORT

    def carry_requests(self, server: TriggerServer) -> None:
        """Hand ``server`` the inspection requests that arrive through this output (request mode)."""

    def use_journal(self, journal: JournalOutput | None) -> None:
        """The journal (None: it is off), after every open and reload: an output that promises
        delivery sends the verdicts recorded there rather than those of `frame`, so that none is
        lost to an outage (MQTT); the live view serves its history."""

    def reread_secrets(self) -> None:
        """SIGHUP: read key and password files again (raises KeyFileError, keeping the old ones)."""

    def reload(self, settings: Settings, services: Services) -> Output | None:
        """A reload's settings take over: this output adapted, or its replacement, or None when gone."""
        return self

    def drain(self) -> None:
        """At stop, before the last status round: finish what is queued, within the output's own bound."""

    def close(self) -> None:
        """Flush within its own bound and release everything."""


MessageKind = Literal["detections", "verdict", "status"]


class MessageOutput(Output):
    """An output that sends every message as it is, on the camera's topic of its kind (ZeroMQ, MQTT),
    skipping a frame without results unless `publish_empty`."""

    @property
    def publish_empty(self) -> bool:
        raise NotImplementedError

    def deliver(self, kind: MessageKind, camera_id: str, payload: bytes) -> None:
        """Send one message; never blocks."""
        raise NotImplementedError

    def wants(self, camera_id: str, found: bool) -> Delivery:
        return Delivery.SENT if found or self.publish_empty else Delivery.NONE

    def frame(self, report: FrameReport) -> None:
        """The detections message, and its verdict message beside it."""
        payload = report.sent(self.publish_empty)
        if payload is None:
            return
        self.deliver("detections", report.camera_id, payload)
        if report.verdict_payload is not None:
            self.deliver("verdict", report.camera_id, report.verdict_payload)

    def status(self, reports: Sequence[StatusReport]) -> None:
        for report in reports:
            self.deliver("status", report.message.camera_id, report.payload)
