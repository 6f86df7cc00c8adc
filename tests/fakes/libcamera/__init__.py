"""A stand-in for the parts of libcamera's Python bindings that picamera2 users touch: ``Transform``.

Only on ``sys.path`` while a test that asks for the fake picamera2 runs (see ``tests/fakes/picamera2``).
"""

from __future__ import annotations


class Transform:
    """libcamera's image transform: the flips the ISP applies, as picamera2's configurations carry it."""

    def __init__(self, rotation: int = 0, hflip: bool = False, vflip: bool = False, transpose: bool = False) -> None:
        self.rotation = rotation
        self.hflip = bool(hflip)
        self.vflip = bool(vflip)
        self.transpose = bool(transpose)

    def __repr__(self) -> str:
        return f"<libcamera.Transform '{'hflip ' * self.hflip}{'vflip' * self.vflip}'>"
