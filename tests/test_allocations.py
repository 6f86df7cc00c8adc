"""The numpy allocation counter the hot-path tests rely on: it counts arrays that own a buffer, not views."""

from __future__ import annotations

import numpy as np
from allocations import NumpyAllocations


def test_numpy_counter_counts_arrays_with_their_own_buffer() -> None:
    counter = NumpyAllocations.get()
    assert counter is not None
    base = np.arange(100.0)
    out = np.empty_like(base)
    with counter.counting():
        start = counter.buffers
        fresh = base * base
        view = base[10:20]
        np.multiply(base, base, out=out)
        counted = counter.buffers - start
    assert counted == 1
    assert fresh.sum() == out.sum() and view.base is base
