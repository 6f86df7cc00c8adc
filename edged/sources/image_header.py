"""What an image file's bytes say before OpenCV decodes them: its format, and whether it is whole.

OpenCV decodes a JPEG that ends early (a camera's upload still being written, a full disk, a copy
cut short) with a warning and its missing rows grey, a frame that would be judged as if it were
real. A JPEG is whole when its end-of-image marker (FF D9) follows the start of its image data;
whatever comes after that marker (the zeros some cameras pad with, a phone's trailer) is left be.
A PNG is whole with its IEND chunk, a WebP with the length its RIFF header gives: OpenCV refuses
those cut short itself, and the check only says why. OpenCV refuses a BMP or TIFF cut short too.
"""

from __future__ import annotations

from dataclasses import dataclass

_SOS, _EOI = 0xDA, 0xD9
_NO_LENGTH = {0x01, *range(0xD0, 0xD9)}  # TEM, the restart markers and SOI carry no length


@dataclass(frozen=True)
class Header:
    """An image file's format, and why it is not whole (None where it is)."""

    kind: str
    cut: str | None


def read_header(data: bytes) -> Header | None:
    """The header of the image file ``data`` holds; None for a format not read here."""
    if data.startswith(b"\xff\xd8\xff"):  # as OpenCV tells a JPEG
        return _jpeg(data)
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        end = data.rfind(b"IEND", 33) + 8  # the chunk's type and CRC: it holds no data
        return Header("PNG", None if 8 <= end <= len(data) else "it ends before its IEND chunk")
    if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        whole = len(data) >= 8 + int.from_bytes(data[4:8], "little")
        return Header("WebP", None if whole else "it is shorter than its RIFF header says")
    return None


def _jpeg(data: bytes) -> Header:
    """Its markers walked as libjpeg walks them (bytes before a marker and fill bytes skipped) to
    the start of the image data, then its end-of-image marker looked for from the end."""
    pos = 2
    while (pos := data.find(b"\xff", pos)) >= 0:
        while pos < len(data) and data[pos] == 0xFF:
            pos += 1
        if pos >= len(data):
            break
        marker = data[pos]
        pos += 1
        if marker == _SOS:
            whole = data.rfind(b"\xff\xd9", pos) >= 0
            return Header("JPEG", None if whole else "it ends before its end-of-image marker")
        if marker == _EOI:
            return Header("JPEG", "it ends before its image data")
        if marker and marker not in _NO_LENGTH:
            if pos + 2 > len(data):
                break
            pos += max(2, int.from_bytes(data[pos : pos + 2], "big"))
    return Header("JPEG", "it ends before its image data")
