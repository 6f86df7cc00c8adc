"""Which camera's frame the loop takes next, and how long it may wait with nothing to do.

Of the cameras on no lane whose rate cap allows a frame, those with a request in hand go first,
then the one served longest ago, so a fast camera cannot starve a slow one. A camera in request
mode wants a frame only for its request in hand, a reload's trial, or before READY=1 (a frame
through the model unpublished proves camera and model, and warms the session up).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from edged.camera import Camera
from edged.requests import RequestDesk
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
