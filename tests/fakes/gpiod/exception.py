"""gpiod.exception as in gpiod 2.5."""

from __future__ import annotations

__all__ = ["ChipClosedError", "RequestReleasedError"]


class ChipClosedError(Exception):
    def __init__(self) -> None:
        super().__init__("I/O operation on closed chip")


class RequestReleasedError(Exception):
    def __init__(self) -> None:
        super().__init__("GPIO lines have been released")
