"""When the consumer will want its next frame: the capture thread's policy for decoding on demand.

A camera delivers every frame, but a model slower than the camera takes only some; a frame
decoded and then replaced before it is taken costs a board heat for nothing. The capture thread
grabs every frame and asks `Demand.wants` whether to decode it, given when a newer frame could
be ready (`StreamTiming`).
"""

from __future__ import annotations

from dataclasses import dataclass

DEMAND_CYCLES = 8  # the consumer's pace is judged from its last this many frames
DEMAND_MARGIN = 0.1  # a frame is decoded from this fraction before the shortest of them
# A consumer that has not asked for this long past its longest cycle is paused (thermal, reload);
# it gets the next frame grabbed once it asks again.
AWAY_NS = 1_000_000_000


class Demand:
    """When the consumer will next ask for a frame, learnt from its calls to ``take``.

    The consumer's time outside ``take`` (processing, a rate cap) is remembered for its last
    `DEMAND_CYCLES` frames; the soonest it plausibly asks again is the shortest of them, less
    `DEMAND_MARGIN`. A shorter cycle counts at once, a longer one once it is the new normal, so
    a misjudgement errs towards decoding. Guarded by the lock of the `edged.latest.LatestFrame` it serves.
    """

    def __init__(self) -> None:
        self.waiting = False
        self.served_ns: int | None = None  # when take() last handed out a frame
        self._busy_ns = [0] * DEMAND_CYCLES  # a ring of the last cycles
        self._cycles = 0

    def asked(self, now_ns: int) -> None:
        if self.served_ns is not None:
            self._busy_ns[self._cycles % DEMAND_CYCLES] = now_ns - self.served_ns
            self._cycles += 1
        self.waiting = True

    def answered(self, now_ns: int, served: bool) -> None:
        self.waiting = False
        self.served_ns = now_ns if served else None

    def wants(self, now_ns: int, newer_ready_ns: float) -> bool:
        """Whether a frame grabbed now may be taken before a newer one, ready in ``newer_ready_ns``, could be."""
        if self.waiting or self.served_ns is None or self._cycles < DEMAND_CYCLES:
            return True
        idle = now_ns - self.served_ns
        if idle > max(self._busy_ns) + AWAY_NS:
            return False  # paused (thermal, reload): it gets the next frame grabbed after it asks
        return idle + newer_ready_ns >= min(self._busy_ns) * (1.0 - DEMAND_MARGIN)


@dataclass(slots=True)
class StreamTiming:
    """Frame interval (the pace, else smoothed from grabs) and smoothed decode time of one stream, in ns."""

    period_ns: float = 0.0
    paced: bool = False
    decode_ns: float = 0.0
    last_grab_ns: int | None = None

    def grabbed(self, now_ns: int) -> None:
        if not self.paced and self.last_grab_ns is not None:
            self.period_ns = _smoothed(self.period_ns, now_ns - self.last_grab_ns)
        self.last_grab_ns = now_ns

    def decoded(self, took_ns: int) -> None:
        self.decode_ns = _smoothed(self.decode_ns, took_ns)

    @property
    def newer_ready_ns(self) -> float:
        return self.period_ns + self.decode_ns


def _smoothed(mean: float, sample: float) -> float:
    """An exponential mean with weight 1/8 for the new sample; the first sample (mean 0) is taken as is."""
    return sample if mean == 0 else mean + (sample - mean) / 8
