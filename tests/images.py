"""Image files edged must refuse (cut short, claiming too many pixels) or that OpenCV cannot take, made byte by byte."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import cv2
import numpy as np


def _png(path: Path, width: int, height: int, pixels: bytes) -> Path:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit grey
    chunks = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(pixels, 9)) + chunk(b"IEND", b"")
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunks)
    return path


def oversized_png(path: Path) -> Path:
    """A 60-byte PNG whose header claims 40000x40000 pixels, over what OpenCV decodes (2^30): its
    imread raises instead of returning None."""
    return _png(path, 40000, 40000, b"")


def black_png(path: Path, width: int, height: int) -> Path:
    """A black grey-scale PNG, whole and valid, of any size in a few kilobytes per 10 megapixels:
    OpenCV decodes it into ``width * height * 3`` bytes."""
    return _png(path, width, height, bytes((width + 1) * height))


def truncated_jpeg(path: Path, image: np.ndarray) -> Path:
    """``image`` as a JPEG cut halfway through its image data: a camera's upload still being
    written. OpenCV's ``imread`` decodes it with a warning and the missing rows grey."""
    data = cv2.imencode(".jpg", image)[1].tobytes()
    scan = data.index(b"\xff\xda")
    path.write_bytes(data[: (scan + len(data)) // 2])
    return path


def lying_jpeg(path: Path, width: int, height: int) -> Path:
    """A 64x48 JPEG whose header claims ``width`` x ``height``: libjpeg decodes it that large, its
    missing rows grey."""
    data = cv2.imencode(".jpg", np.full((48, 64, 3), 90, np.uint8))[1].tobytes()
    at = data.index(b"\xff\xc0") + 5  # the start of frame's height and width, after its length and precision
    path.write_bytes(data[:at] + struct.pack(">HH", height, width) + data[at + 4 :])
    return path
