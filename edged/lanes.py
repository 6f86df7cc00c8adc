"""Inference lanes: several cameras' frames through the one model at once.

One loop running each camera's frame path in turn makes every camera wait for the others' runs:
with four cameras, the frame served last waits for three inferences first. ONNX Runtime allows
concurrent runs on one session, each camera's plans bind buffers of their own
(`edged.engine.Binding`), and a run releases the interpreter lock, so a few threads that each
take one camera's whole path (`edged.pipeline.FramePath.run`: contract, preprocess, inference,
decode, inspection) overlap where one loop would queue. The loop keeps everything else: it hands
out frames, and counts and publishes each result on its own thread.

A camera is on at most one lane at a time, and stays there until the loop has collected its
result: a `Processed` is a view into its plan, valid until that plan's next frame, so the loop
publishes it before the camera can be handed out again. With one lane the loop's own thread is
the lane: a single camera pays no hand-over.

A lane may never return (a hung model or accelerator), so nothing the loop does waits on one
without a bound. A reload changes the number of lanes without replacing them (`resize`): a frame
still running stays on its thread, counted by camera id, so the camera a reload makes again is
not handed a second run until that frame comes back, and the watchdog keeps seeing it
(`inferring`).
"""

from __future__ import annotations

import threading
import time
from collections import deque

from edged.camera import Camera
from edged.pipeline import Processed, Rejected
from edged.sources.base import Frame
from edged.wake import Waker

Outcome = Processed | Rejected


class Lanes:
    """``count`` lanes running cameras' frames through their paths; the loop submits and collects.

    ``wake`` is set whenever a lane finishes a frame, so a loop waiting on it for frames wakes
    for results too. An exception a path raises on a lane (the model cannot run on this frame
    size at all) is raised again by the `collect` that would have returned its result.
    """

    def __init__(self, count: int, wake: Waker) -> None:
        self.count = count
        self._wake = wake
        self._cond = threading.Condition()
        self._todo: deque[tuple[Camera, Frame]] = deque()
        self._done: deque[tuple[Camera, Outcome | Exception]] = deque()
        self._carrying: set[str] = set()  # camera ids submitted and not yet collected
        self._running: dict[str, int] = {}  # camera id -> when a lane thread started its frame (monotonic ns)
        self._left: set[str] = set()  # camera ids whose frame runs on a thread that `resize` retired
        self._generation = 0  # a lane thread whose generation is not this one ends after its frame
        self._closed = False
        self._start_threads()

    def _start_threads(self) -> None:
        for index in range(self.count if self.count > 1 else 0):
            name = f"edged-lane{index}"
            threading.Thread(target=self._work, args=(self._generation,), name=name, daemon=True).start()

    @property
    def idle(self) -> int:
        """Lanes free for another camera's frame (a frame left on a retired thread takes none)."""
        return self.count - len(self._carrying) + len(self._left)

    def carrying(self, camera: Camera) -> bool:
        """A camera of ``camera``'s id has a frame on a lane, or a result not collected yet."""
        return camera.id in self._carrying

    def resize(self, count: int) -> None:
        """A reload's number of lanes: fresh lane threads take the frames from now on; the frames
        running now finish on their own threads, which then end, and come out of `collect`."""
        if count == self.count:
            return
        with self._cond:
            self._generation += 1
            self._left |= self._running.keys()
            self.count = count
            self._cond.notify_all()
            queued = list(self._todo) if count == 1 else []  # no lane thread left to take them
            if queued:
                self._todo.clear()
        for camera, frame in queued:  # run here, at once, as `submit` does with one lane
            self._done.append((camera, _run(camera, frame)))
        self._start_threads()

    def submit(self, camera: Camera, frame: Frame) -> None:
        """Run ``frame`` through ``camera``'s path on an idle lane (at once, here, with one lane)."""
        self._carrying.add(camera.id)
        if self.count == 1:
            self._done.append((camera, _run(camera, frame)))
            return
        with self._cond:
            self._todo.append((camera, frame))
            self._cond.notify()

    def collect(self) -> list[tuple[Camera, Outcome]]:
        """The results finished since the last call, in the order they finished; their cameras are
        free again. An error is raised alone: the results beside it wait for the next call."""
        with self._cond:
            for index, (camera, outcome) in enumerate(self._done):
                if isinstance(outcome, Exception):
                    del self._done[index]
                    self._carrying.discard(camera.id)
                    raise outcome
            done = [(camera, outcome) for camera, outcome in self._done if not isinstance(outcome, Exception)]
            self._done.clear()
        for camera, _ in done:
            self._carrying.discard(camera.id)
        return done

    def drain(self, timeout_s: float | None = None) -> list[tuple[Camera, Outcome]]:
        """Wait for every frame on a lane to finish (up to ``timeout_s``), then `collect`."""
        with self._cond:
            self._cond.wait_for(lambda: not self._todo and not self._running, timeout_s)
        return self.collect()

    def inferring(self) -> dict[str, int]:
        """Since when (monotonic ns), by camera, each frame a lane thread is working on has run:
        the watchdog's view of a hung run (`edged.health`)."""
        with self._cond:
            return dict(self._running)

    def close(self) -> None:
        """Stop the lane threads once their frames are done; a frame still running is abandoned to
        exit (the threads are daemons, as a capture thread stuck in a camera call is)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _work(self, generation: int) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._todo or self._closed or generation != self._generation)
                if not self._todo or generation != self._generation:
                    return
                camera, frame = self._todo.popleft()
                self._running[camera.id] = time.monotonic_ns()
            outcome = _run(camera, frame)
            with self._cond:
                del self._running[camera.id]
                self._left.discard(camera.id)
                self._done.append((camera, outcome))
                self._cond.notify_all()
            self._wake.set()


def _run(camera: Camera, frame: Frame) -> Outcome | Exception:
    try:
        return camera.path.run(frame)
    except Exception as e:  # raised again on the loop's thread by `collect`
        return e
