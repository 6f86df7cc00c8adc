"""The latest-frame slot ring, driven directly as producer and consumer: no capture thread, a clock the test sets."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from waiting import wait_for

from edged.demand import DEMAND_CYCLES
from edged.errors import SourceError
from edged.latest import SLOT_COUNT, LatestFrame
from edged.sources.base import Frame

MS = 1_000_000
SMALL, LARGE = (24, 32, 3), (48, 40, 3)


class Clock:
    def __init__(self) -> None:
        self.now_ns = 0

    def __call__(self) -> int:
        return self.now_ns


def deliver(ring: LatestFrame, value: int, shape: tuple[int, ...] = SMALL, t_capture_ns: int = 0) -> np.ndarray:
    """What the capture thread does per frame from a source that fills the slot in place when it fits."""
    index, buf = ring.claim()
    image = buf if buf is not None and buf.shape == shape else np.empty(shape, np.uint8)
    image.fill(value)
    ring.adopt(index, image)
    ring.hand_over(index, t_capture_ns, t_capture_ns + 1, "bgr")
    return image


def taken(ring: LatestFrame) -> Frame:
    frame = ring.take(timeout_s=0)
    assert frame is not None
    return frame


def test_a_frame_handed_over_is_taken_once_with_its_id_times_and_channel_order() -> None:
    ring = LatestFrame()
    index, buf = ring.claim()
    assert buf is None  # no size known before the first frame
    image = np.full(SMALL, 7, np.uint8)
    assert ring.adopt(index, image) is None
    ring.hand_over(index, 123, 456, "rgb")
    frame = taken(ring)
    assert (frame.frame_id, frame.t_capture_ns, frame.t_wall_ns, frame.channel_order) == (0, 123, 456, "rgb")
    assert frame.image is image
    assert ring.take(timeout_s=0) is None


def test_a_producer_keeping_every_frame_waits_until_the_one_waiting_is_taken() -> None:
    ring = LatestFrame()
    assert ring.taken(0)  # nothing waiting
    deliver(ring, 1)
    assert not ring.taken(0)
    waited = threading.Thread(target=ring.taken, args=(30,))
    waited.start()
    assert taken(ring).frame_id == 0
    waited.join(30)
    assert not waited.is_alive()
    deliver(ring, 2)
    ring.close()
    assert ring.taken(30)  # closed: nothing more will be taken, so nothing is waited for


def test_a_frame_dropped_counts_under_the_cause_the_consumer_last_gave() -> None:
    ring = LatestFrame()
    deliver(ring, 1)
    deliver(ring, 2)  # nothing said yet: the consumer is taken to be busy
    ring.passing("rate_capped")
    deliver(ring, 3)
    deliver(ring, 4)
    ring.passing("not_requested")
    deliver(ring, 5)
    ring.skip()  # a frame left undecoded, and the one waiting with it
    assert ring.counts().dropped == {"stale_slow": 1, "rate_capped": 2, "not_requested": 3}


def test_a_new_frame_replaces_one_not_taken_and_counts_it_stale() -> None:
    ring = LatestFrame()
    deliver(ring, 1)
    deliver(ring, 2)
    frame = taken(ring)
    assert frame.frame_id == 1 and int(frame.image[0, 0, 0]) == 2
    counts = ring.counts()
    assert (counts.frames_captured, counts.frames_decoded, sum(counts.dropped.values()), counts.size_changes) == (2, 2, 1, 0)


def test_steady_state_reuses_the_preallocated_slots_and_never_writes_the_held_one() -> None:
    ring = LatestFrame()
    deliver(ring, 0)
    held = taken(ring)
    buffers = set()
    for n in range(1, 30):
        index, buf = ring.claim()
        assert buf is not None and buf.shape == SMALL
        assert buf.ctypes.data != held.image.ctypes.data
        buffers.add(buf.ctypes.data)
        buf.fill(n)
        assert ring.adopt(index, buf) is None
        ring.hand_over(index, 0, 0, "bgr")
        np.testing.assert_array_equal(held.image, held.frame_id)  # untouched while held
        if n % 3 == 0:  # a consumer taking every third frame
            held = taken(ring)
            assert held.frame_id == n and int(held.image[0, 0, 0]) == n
    assert len(buffers | {held.image.ctypes.data}) == SLOT_COUNT
    assert sum(ring.counts().dropped.values()) == 29 - 29 // 3 - 1  # handed over, less taken, less the one still latest


def test_a_source_array_of_the_slot_size_is_copied_into_the_slot() -> None:
    ring = LatestFrame()
    deliver(ring, 0)
    taken(ring)
    index, buf = ring.claim()
    other = np.full(SMALL, 9, np.uint8)
    assert ring.adopt(index, other) is None
    ring.hand_over(index, 0, 0, "bgr")
    frame = taken(ring)
    assert frame.image is buf and frame.image is not other
    np.testing.assert_array_equal(frame.image, 9)


def test_a_new_frame_size_resizes_the_free_slots_and_leaves_the_held_and_latest_frames_intact() -> None:
    ring = LatestFrame()
    deliver(ring, 0)
    held = taken(ring)
    deliver(ring, 1)  # the latest, not yet taken
    index, _ = ring.claim()
    assert ring.adopt(index, np.full(LARGE, 2, np.uint8)) == SMALL
    assert ring.shape == LARGE
    np.testing.assert_array_equal(held.image, 0)
    ring.hand_over(index, 0, 0, "bgr")  # replaces frame 1 unseen
    frame = taken(ring)
    assert frame.image.shape == LARGE and frame.frame_id == 2
    np.testing.assert_array_equal(held.image, 0)  # the old frame's memory outlives its slot
    # The slots that held old-size frames get the new size when they are next claimed.
    for n in range(3, 3 + SLOT_COUNT):
        _, buf = ring.claim()
        assert buf is not None and buf.shape == LARGE
        deliver(ring, n, LARGE)
    assert ring.counts().size_changes == 1


@pytest.mark.parametrize(
    "image",
    [np.zeros((24, 32), np.uint8), np.zeros((24, 32, 4), np.uint8), np.zeros(SMALL, np.float32)],
    ids=["gray", "bgra", "float"],
)
def test_frames_that_are_not_height_width_3_uint8_are_refused(image: np.ndarray) -> None:
    ring = LatestFrame()
    index, _ = ring.claim()
    with pytest.raises(SourceError, match="expected \\(height, width, 3\\) uint8"):
        ring.adopt(index, image)


def test_a_skipped_frame_takes_an_id_and_drops_the_frame_still_waiting() -> None:
    ring = LatestFrame()
    deliver(ring, 0)
    ring.skip()
    assert ring.take(timeout_s=0) is None
    deliver(ring, 2)
    assert taken(ring).frame_id == 2
    counts = ring.counts()
    assert (counts.frames_captured, counts.frames_decoded, sum(counts.dropped.values())) == (3, 2, 2)


def test_close_hands_out_the_frame_still_waiting_then_returns_at_once() -> None:
    ring = LatestFrame()
    deliver(ring, 0)
    ring.close()
    start = time.monotonic()
    assert taken(ring).frame_id == 0
    assert ring.take(timeout_s=5.0) is None
    assert time.monotonic() - start < 1.0


def test_take_times_out_when_no_frame_arrives() -> None:
    ring = LatestFrame()
    start = time.monotonic()
    assert ring.take(timeout_s=0.1) is None
    assert 0.09 <= time.monotonic() - start < 0.4


def test_take_waits_for_a_frame_handed_over_from_another_thread() -> None:
    ring = LatestFrame()
    got: list[Frame | None] = []
    consumer = threading.Thread(target=lambda: got.append(ring.take(timeout_s=10.0)))
    consumer.start()
    deliver(ring, 5)
    consumer.join(timeout=10.0)
    assert len(got) == 1 and got[0] is not None and got[0].frame_id == 0


def test_takes_on_the_clock_tell_the_producer_which_frames_the_consumer_may_take() -> None:
    clock = Clock()
    ring = LatestFrame(clock)
    for _ in range(DEMAND_CYCLES + 1):  # a consumer that takes a frame every 200 ms
        deliver(ring, 0, t_capture_ns=clock.now_ns)
        taken(ring)
        clock.now_ns += 200 * MS
    served = clock.now_ns - 200 * MS
    assert not ring.wants(served + 50 * MS, 40 * MS)  # a newer frame will be ready before it asks
    assert ring.wants(served + 199 * MS, 40 * MS)


def test_a_consumer_waiting_in_take_wants_the_next_frame_even_after_a_pause() -> None:
    clock = Clock()
    ring = LatestFrame(clock)
    for _ in range(DEMAND_CYCLES + 1):
        deliver(ring, 0)
        taken(ring)
        clock.now_ns += 200 * MS
    clock.now_ns += 60_000 * MS  # paused for a minute: nothing is wanted
    assert not ring.wants(clock.now_ns, 40 * MS)
    got: list[Frame | None] = []
    consumer = threading.Thread(target=lambda: got.append(ring.take(timeout_s=10.0)))
    consumer.start()
    assert wait_for(lambda: ring.wants(clock.now_ns, 40 * MS))  # once it is inside take
    deliver(ring, 1)
    consumer.join(timeout=10.0)
    assert got and got[0] is not None
