"""Readiness and liveness: when systemd hears READY=1, and whether the watchdog keeps pinging.

READY=1 goes out once the first frame is processed (the model, the contract and the camera all
work), or as soon as the camera is known to be missing, so that a start with the camera unplugged
is up and honest about it rather than timed out. The watchdog pings only while the loop turns and
frames flow, or while a reconnect is alive, on any of the cameras, and no camera's frame has been
stuck in inference on a lane (`edged.lanes`) for longer than the stall timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from edged.capture import Capture, CaptureStats
from edged.messages import CaptureState


@dataclass(frozen=True, slots=True)
class Watched:
    """What the watchdog and ``/healthz`` judge, as the loop last published it: the captures of the
    cameras it serves and the lanes' view of what is in inference. Never the loop's own
    dictionaries, which a reload changes under another thread."""

    captures: tuple[tuple[str, Capture], ...]
    inferring: Callable[[], Mapping[str, int]]


class Health:
    """Progress timestamps written by the loop, read by the watchdog thread; ``stall_timeout_s``
    (``service.stall_timeout_s``) is set again by the loop when a reload switches in."""

    def __init__(self, stall_timeout_s: float, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.stall_timeout_s = stall_timeout_s
        self._clock = clock
        self.loop_ns = self.frame_ns = clock()
        self.ready = False
        self._watched: Watched | None = None

    def watch(self, watched: Watched) -> None:
        """The loop's cameras and lanes from now on (a reference swap, so readers see one or the other).

        The first, as the start hands over to the loop, starts the stall clock again: the model's load
        and the cameras' opening before it are the start's, which ``TimeoutStartSec=`` bounds, not the
        loop's, and a slow board's load said "unhealthy: no frame processed" before its first frame.
        """
        if self._watched is None:
            self.loop_ns = self.frame_ns = self._clock()
        self._watched = watched

    def current_problem(self) -> str | None:
        """`problem` for what the loop last published (`watch`): any thread may ask."""
        watched = self._watched
        if watched is None:
            return None
        return self.problem({name: capture.stats() for name, capture in watched.captures}, watched.inferring())

    def loop_turned(self) -> None:
        self.loop_ns = self._clock()

    def frame_done(self) -> None:
        self.frame_ns = self._clock()

    def should_announce(self, *, frame_processed: bool, capture_state: CaptureState) -> bool:
        """True exactly once: on the first processed frame, or when the camera is lost before one."""
        if self.ready or not (frame_processed or capture_state == "lost"):
            return False
        self.ready = True
        return True

    def healthy(self, cameras: Mapping[str, CaptureStats], inferring: Mapping[str, int] | None = None) -> bool:
        """The loop turns, and frames flow or a reconnect is alive, on any camera; no inference hangs."""
        return self.problem(cameras, inferring) is None

    def problem(self, cameras: Mapping[str, CaptureStats], inferring: Mapping[str, int] | None = None) -> str | None:
        """Why the watchdog would not ping now, or None when it would (``/healthz`` says it).

        One camera progressing is enough: a lost camera must not restart the others, and its
        state is in its own status message. A capture thread that died, or a frame stuck in
        inference on a lane (``inferring``: since when, by camera, on this clock), is a problem
        whatever the others do: only a restart brings that camera back, and a hung accelerator
        may take the others next.
        """
        now, limit_ns = self._clock(), self.stall_timeout_s * 1e9
        if now - self.loop_ns > limit_ns:
            return f"the loop has not turned for {(now - self.loop_ns) / 1e9:.1f} s"
        hung = {name: now - since for name, since in (inferring or {}).items() if now - since > limit_ns}
        if hung:
            name = max(hung, key=hung.__getitem__)
            return f"a frame of camera {name} has been in inference for {hung[name] / 1e9:.1f} s: a hung model or provider"
        dead = [name for name, capture in cameras.items() if not capture.alive and capture.state != "ended"]
        if dead:
            return f"the capture thread of camera {', '.join(dead)} died: only a restart brings the camera back"
        if now - self.frame_ns <= limit_ns:
            return None
        if any(c.state in ("lost", "starting") and now - c.last_progress_ns <= limit_ns for c in cameras.values()):
            return None
        states = ", ".join(f"{name} {c.state}" for name, c in cameras.items()) if len(cameras) > 1 else None
        states = states or f"camera {next(iter(cameras.values())).state}"
        return f"no frame processed for {(now - self.frame_ns) / 1e9:.1f} s ({states})"
