"""Where a message came from: the board, the boot, this start of edged, and whether the clock was set."""

from __future__ import annotations

import subprocess

import pytest
from filesystems import no_descriptor_left

from edged import identity
from edged.identity import CLOCK_EVERY_S, clock_synced

pytestmark = pytest.mark.unit


def test_the_kernel_is_asked_whether_the_clock_is_set_with_no_descriptor_left() -> None:
    """Every status and verdict says it, asked once a minute: with the process out of descriptors (its
    limit reached, or a leak) the first asking, which found the C library by running ldconfig, raised
    out of the daemon's loop and stopped edged."""
    identity._adjtimex.cache_clear()
    identity._CLOCK.asked = (-CLOCK_EVERY_S, None)
    with no_descriptor_left():
        with pytest.raises(OSError):  # the limit holds: nothing can be opened, nothing spawned
            subprocess.run(["true"], check=False)
        synced = clock_synced()
    assert synced in (True, False)  # the kernel answered
