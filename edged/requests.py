"""Request mode on the loop: which request each camera answers, and the answers that are not verdicts.

`edged.trigger.TriggerServer` owns the sockets and the queues; this owns what the loop does with
them. A camera in request mode holds at most one request: the first frame it captures after that
request arrived answers it with its verdict. A request that cannot be served (the board is
critically hot, the camera is lost or ended, no frame came within ``trigger.timeout_s``) is
answered at once with the reason, and an unfit frame leaves the request to the next frame.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial

import zmq

from edged.camera import Camera
from edged.config import Settings
from edged.messages import TriggerProblem, VerdictMessage
from edged.outputs import Outputs
from edged.publish import Publisher
from edged.trigger import Request, TriggerServer
from edged.wake import Wake

Refusal = tuple[TriggerProblem, str]


class RequestDesk:
    """The trigger server of the cameras in request mode, and the loop's side of their requests."""

    def __init__(self, settings: Settings, outputs: Outputs) -> None:
        """Raises `PublishError` or `KeyFileError` as `TriggerServer` does."""
        self._timeout_s = settings.trigger.timeout_s
        self._outputs = outputs
        # The ZeroMQ publisher's CURVE keys and authenticator serve the request socket too.
        publisher = outputs.get(Publisher)
        auth = publisher.auth if publisher is not None else None
        self.server = TriggerServer(settings.trigger, settings.publish, settings.requesting(), auth)
        outputs.carry_requests(self.server)  # requests from the broker's trigger topics too

    @property
    def fds(self) -> list[zmq.Socket[bytes] | Wake]:
        """What the loop's wait selects on beside its wake-up: requests arriving."""
        return self.server.fds

    def request(self, camera: Camera) -> Request | None:
        """``camera``'s request in hand, if it is in request mode and has one."""
        return self.server.in_hand(camera.id) if camera.mode == "request" else None

    def deadline_ns(self, request: Request) -> int:
        return request.arrived_ns + int(self._timeout_s * 1e9)

    def take(self, cameras: Sequence[Camera], busy: Callable[[Camera], bool], critical: bool) -> bool:
        """Read the requests that arrived; give each request-mode camera without one its next, and
        answer at once those that cannot be served (`refusal`).

        A ``busy`` camera (a frame on a lane) keeps its request: that frame's result answers it.
        Returns whether some camera waits for a request: waiting is progress in this mode (`edged.health`).
        """
        self.server.collect()
        now_ns = time.monotonic_ns()
        idle = False
        for camera in cameras:
            if camera.mode != "request":
                continue
            while not busy(camera):
                request = self.server.in_hand(camera.id) or self.server.next(camera.id)
                if request is None:
                    idle = True
                    break
                problem = self.refusal(camera, request, critical, now_ns)
                if problem is None:
                    break
                self.refuse(request, *problem)
        return idle

    def refusal(self, camera: Camera, request: Request, critical: bool, now_ns: int) -> Refusal | None:
        """Why ``request`` gets no verdict: the board is ``critical``ly hot, the camera is lost or
        ended, or its time is up; None while one may still come."""
        if critical:
            return "thermal_critical", "inference is paused until the board cools"
        capture = camera.capture.stats()
        if capture.state in ("lost", "ended"):
            why = f": {capture.last_error}" if capture.last_error else ""
            return "camera_lost", f"the camera is {capture.state}{why}"
        if now_ns >= self.deadline_ns(request):
            return "timeout", f"no frame captured after the request within {self._timeout_s:g} s"
        return None

    def answers(self, camera: Camera, captured_ns: int) -> Request | None:
        """The request a frame of ``camera`` captured at ``captured_ns`` answers: one that arrived before it."""
        request = self.request(camera)
        return request if request is not None and captured_ns > request.arrived_ns else None

    def answer(self, request: Request, verdict: VerdictMessage) -> None:
        """The camera may take its next request now; the verdict goes back once the journal has it
        (`Outputs.after_recorded`), so a requester never holds a verdict a crash could lose."""
        self.server.release(request)
        self._outputs.after_recorded(partial(self.server.reply, request, verdict))

    def refuse(self, request: Request, problem: TriggerProblem, detail: str) -> None:
        self.server.answer(request, self.server.error(request, problem, detail))

    def follow(self, settings: Settings, before: Sequence[str]) -> None:
        """A reload's cameras in request mode take requests from now on; a request in hand of a camera
        (of ``before``) that no longer takes them is refused."""
        now = settings.requesting()
        self.server.follow_cameras(now)
        for camera_id in before:
            request = self.server.in_hand(camera_id)
            if request is not None and camera_id not in now:
                self.refuse(request, "bad_request", f"camera {camera_id} no longer takes requests")

    def close(self) -> None:
        self.server.close()
