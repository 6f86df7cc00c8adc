"""Which camera's frame the loop takes next, and how long it may wait with nothing to do.

Of the cameras on no lane whose rate cap allows a frame, those with a request in hand go first,
then the one served longest ago, so a fast camera cannot starve a slow one. A camera in request
mode wants a frame only for its request in hand, a reload's trial, or before READY=1 (a frame
through the model unpublished proves camera and model, and warms the session up); between
requests an output that shows its frames unprocessed (the live view, watched) gets them, so that
a technician can aim and focus it. Each camera's capture is told why the frames the loop leaves
are dropped (`drop_cause`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from edged.camera import Camera
from edged.lanes import Lanes
from edged.latest import DropCause
from edged.outputs import Outputs
from edged.requests import RequestDesk
from edged.sources.base import Frame
from edged.trigger import Request


def request_of(desk: RequestDesk | None, camera: Camera) -> Request | None:
    """``camera``'s request in hand, if any."""
    return desk.request(camera) if desk is not None else None


def turn_order(cameras: Sequence[Camera], desk: RequestDesk | None) -> list[Camera]:
    """``cameras`` in the order they are offered a lane."""
    return sorted(cameras, key=lambda camera: (request_of(desk, camera) is None, camera.served_s))


def wants_frame(camera: Camera, desk: RequestDesk | None, *, ready: bool, on_trial: bool) -> bool:
    """Whether ``camera`` takes its next frame now (module docstring)."""
    return camera.mode == "free" or request_of(desk, camera) is not None or not ready or on_trial


def drop_cause(camera: Camera, desk: RequestDesk | None, now_s: float, *, ready: bool, on_trial: bool) -> DropCause:
    """Why ``camera``'s frames that the loop leaves now are dropped: it wants none (request mode
    between requests), its rate cap holds it back, or it is still busy with an earlier frame."""
    if not wants_frame(camera, desk, ready=ready, on_trial=on_trial):
        return "not_requested"
    return "stale_slow" if camera.due(now_s) else "rate_capped"


def pause(cameras: Sequence[Camera]) -> None:
    """Inference is paused (the board is critically hot): what is dropped meanwhile is rate-capped,
    by a thermal cap of nothing."""
    for camera in cameras:
        camera.capture.passing("rate_capped")


def idle_s(cameras: Sequence[Camera], desk: RequestDesk | None, busy: Callable[[Camera], bool], at_most_s: float) -> float:
    """How long the loop may wait with nothing to do: until a rate cap lets a camera's frame be
    taken or a request's time is up, at most ``at_most_s``."""
    now_s, now_ns = time.monotonic(), time.monotonic_ns()
    waits = [at_most_s]
    for camera in cameras:
        request = request_of(desk, camera)
        if desk is not None and request is not None and not busy(camera):
            waits.append((desk.deadline_ns(request) - now_ns) / 1e9)
        elif not camera.due(now_s):
            waits.append(camera.wait_s(now_s))
    return max(0.0, min(waits))


def hand_out(
    cameras: Sequence[Camera],
    lanes: Lanes,
    desk: RequestDesk | None,
    outputs: Outputs,
    *,
    ready: bool,
    on_trial: Callable[[Camera], bool],
    try_frame: Callable[[Camera, Frame], None],
) -> int:
    """Hand idle ``lanes`` the frames of the cameras that want one, are on no lane and have a frame
    ready, in `turn_order`, and ``outputs`` that show frames unprocessed those of the cameras that
    want none; returns how many frames were taken for the model.

    A camera in request mode passes over a frame captured before its request arrived (one
    waiting in the latest-frame slot, picamera2's queued one): its capture time, on the monotonic
    clock of the arrival, says so. A reload on trial (``on_trial``) takes its cameras' next frame
    on this thread instead (``try_frame``), after which the cameras may have changed: it is the
    last frame taken. A camera with a frame on a lane is left alone: taking another would free
    that frame's slot. ``outputs`` learn of each frame taken to be published (`Outputs.taken`).
    """
    taken = 0
    now = time.monotonic()
    for camera in turn_order(cameras, desk):
        trial = on_trial(camera)
        if lanes.carrying(camera):
            continue
        if not wants_frame(camera, desk, ready=ready, on_trial=trial):
            if outputs.previews(camera.id) and (frame := camera.take()) is not None:
                outputs.preview(camera.id, frame)
            continue
        if not lanes.idle or not camera.due(now):
            continue
        frame = camera.take()
        if frame is None:
            continue
        taken += 1
        request = request_of(desk, camera)
        fresh = request is None or frame.t_capture_ns > request.arrived_ns
        if fresh and (camera.mode == "free" or request is not None):  # its result will be published
            outputs.taken(camera.id, frame.t_capture_ns)  # a trial frame's too: its part is on its way all the same
        if trial:
            try_frame(camera, frame)
            return taken
        if fresh:
            lanes.submit(camera, frame)
    now = time.monotonic()
    for camera in cameras:
        camera.capture.passing(drop_cause(camera, desk, now, ready=ready, on_trial=on_trial(camera)))
    return taken
