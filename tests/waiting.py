"""Waiting for an event in tests: poll a condition until it holds or a generous deadline passes."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], bool], timeout_s: float = 3.0) -> bool:
    """True as soon as ``predicate()`` holds; its last value once ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()
