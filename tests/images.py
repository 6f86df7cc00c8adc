"""Image files that OpenCV's readers cannot take, made for real byte by byte."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import cv2
import numpy as np


def oversized_png(path: Path) -> Path:
    """A 60-byte PNG whose header claims 40000x40000 pixels, over what OpenCV decodes (2^30): its
    imread raises instead of returning None."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 40000, 40000, 8, 2, 0, 0, 0)
    chunks = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunks)
    return path


def truncated_jpeg(path: Path, image: np.ndarray) -> Path:
    """``image`` as a JPEG cut halfway through its image data: a camera's upload still being
    written. OpenCV's ``imread`` decodes it with a warning and the missing rows grey."""
    data = cv2.imencode(".jpg", image)[1].tobytes()
    scan = data.index(b"\xff\xda")
    path.write_bytes(data[: (scan + len(data)) // 2])
    return path
