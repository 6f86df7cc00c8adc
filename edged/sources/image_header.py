"""What an image file's bytes say before OpenCV decodes them: its format, its size and whether it is whole.

The size is read from the header alone, so that an image too large to decode is refused before
OpenCV allocates it: a PNG or JPEG of a few kilobytes can claim 30000x30000 pixels, 2.7 GB decoded.
The header is read as the decoder reads it (a JPEG's markers walked as libjpeg walks them, a PNG's
first chunk, a TIFF's first directory), and where it gives no size the file is refused, not
decoded: bytes that fool this reader must not reach OpenCV's. A tiled TIFF's tile is held whole
while it decodes, so its size counts too.

OpenCV decodes a JPEG that ends early (a camera's upload still being written, a full disk, a copy
cut short) with a warning and its missing rows grey, a frame that would be judged as if it were
real. A JPEG is whole when its end-of-image marker (FF D9) follows the start of its image data;
whatever comes after that marker (the zeros some cameras pad with, a phone's trailer) is left be.
A PNG is whole with its IEND chunk, a WebP with the length its RIFF header gives, a TIFF with its
first directory (written last): OpenCV refuses those cut short itself, and the check only says
why. OpenCV refuses a BMP cut short too.

OpenCV turns a JPEG as its EXIF orientation says (a phone's portrait photo is stored landscape), so
its size as decoded is its header's turned a quarter where that orientation is 5 to 8 (`Header.turned`).
Other formats' orientation, which OpenCV's versions honour differently, is not read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import numpy as np

KINDS = "JPEG, PNG, WebP, BMP or TIFF"  # the formats read here, as said to the user

_SOS, _EOI = 0xDA, 0xD9
_NOT_FILL = re.compile(rb"[^\xff]")  # a marker's code, after its 0xFF and any fill bytes
_MAX_MARKERS = 10_000  # before the image data; a camera writes tens
_NO_LENGTH = {0x01, *range(0xD0, 0xD9)}  # TEM, the restart markers and SOI carry no length
_SOF = {*range(0xC0, 0xD0)} - {0xC4, 0xC8, 0xCC}  # every start of frame: DHT, JPG and DAC are not
_TIFF_SIZES = (256, 257, 322, 323)  # ImageWidth, ImageLength, TileWidth, TileLength
_TIFF_INTEGER_BYTES = {1: 1, 6: 1, 3: 2, 8: 2, 4: 4, 9: 4, 16: 8, 17: 8, 18: 8}  # by field type
_APP1, _EXIF = 0xE1, b"Exif\x00\x00"  # a JPEG's EXIF segment, and how its data starts
_ORIENTATION = 0x0112  # the EXIF tag
_TURNED = range(5, 9)  # the EXIF orientations that turn an image a quarter: shown, its width is its height


@dataclass(frozen=True)
class Header:
    """An image file's format and size (0 where its header gives none), why it is not whole (None
    where it is), and a tiled TIFF's tile."""

    kind: str
    width: int
    height: int
    cut: str | None = None
    tile: tuple[int, int] = (0, 0)
    turned: bool = False  # decoded, it is turned a quarter: ``height`` x ``width`` (a JPEG's EXIF orientation)

    @property
    def pixels(self) -> int:
        """The most pixels its decoder holds at once: the image, or a tile larger than it."""
        return max(self.width * self.height, self.tile[0] * self.tile[1])

    @property
    def size(self) -> str:
        """As the user is told it: ``WxH``, and a tiled TIFF's tile."""
        tile = f" in tiles of {self.tile[0]}x{self.tile[1]}" if self.tile != (0, 0) else ""
        return f"{self.width}x{self.height}{tile}"


def read_header(data: bytes) -> Header | None:
    """The header of the image file ``data`` holds; None for a format not read here (`KINDS`)."""
    if data.startswith(b"\xff\xd8\xff"):  # as OpenCV tells a JPEG
        return _jpeg(data)
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return _png(data)
    if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        return _webp(data)
    if data.startswith(b"BM"):
        return _bmp(data)
    if data[:4] in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"):
        return _tiff(data)
    return None


def _jpeg(data: bytes) -> Header:
    """Its markers walked as libjpeg walks them (bytes before a marker and fill bytes skipped): the
    size from its start of frame, then its end-of-image marker looked for from the end. Each scan
    over bytes is done in C, and a header of more markers than any camera writes gives no size:
    hostile bytes cost no more than reading them. Its first EXIF segment says whether it is turned."""
    width = height = 0
    turned: bool | None = None
    pos = 2
    for _ in range(_MAX_MARKERS):
        if (pos := data.find(b"\xff", pos)) < 0 or (after := _NOT_FILL.search(data, pos)) is None:
            return Header("JPEG", width, height, "it ends before its image data", turned=bool(turned))
        marker, pos = data[after.start()], after.start() + 1
        if marker == _SOS:
            whole = data.rfind(b"\xff\xd9", pos) >= 0
            cut = None if whole else "it ends before its end-of-image marker"
            return Header("JPEG", width, height, cut, turned=bool(turned))
        if marker == _EOI:
            return Header("JPEG", width, height, "it ends before its image data", turned=bool(turned))
        if marker and marker not in _NO_LENGTH:
            if pos + 7 > len(data):
                return Header("JPEG", width, height, "it ends before its image data", turned=bool(turned))
            length = max(2, int.from_bytes(data[pos : pos + 2], "big"))
            if marker in _SOF:  # libjpeg refuses a second one: the larger is taken, to be safe
                height = max(height, int.from_bytes(data[pos + 3 : pos + 5], "big"))
                width = max(width, int.from_bytes(data[pos + 5 : pos + 7], "big"))
            elif marker == _APP1 and turned is None and data.startswith(_EXIF, pos + 2):
                turned = _exif_turns(data[pos + 2 + len(_EXIF) : pos + length])
            pos += length
    return Header("JPEG", 0, 0)


def _exif_turns(tiff: bytes) -> bool:
    """Whether EXIF data (a TIFF structure) turns its image a quarter, read as OpenCV's EXIF reader
    reads it: the first orientation tag of the first directory, its value the first 16 bits of the
    entry's value, whatever the type it claims."""
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return False
    order: Literal["little", "big"] = "little" if tiff[:2] == b"II" else "big"
    first = int.from_bytes(tiff[4:8], order)
    if int.from_bytes(tiff[2:4], order) != 42 or first + 2 > len(tiff):
        return False
    entries = min(int.from_bytes(tiff[first : first + 2], order), (len(tiff) - first - 2) // 12)
    fields = np.frombuffer(tiff, np.dtype(np.uint16).newbyteorder("<" if order == "little" else ">"), entries * 6, first + 2)
    tags = np.flatnonzero(fields[0::6] == _ORIENTATION)
    return bool(tags.size) and int(fields[6 * int(tags[0]) + 4]) in _TURNED


def _png(data: bytes) -> Header:
    if len(data) < 24:
        return Header("PNG", 0, 0, "it ends before its IHDR chunk")
    if data[12:16] != b"IHDR":  # libpng takes no other first chunk
        return Header("PNG", 0, 0)
    end = data.rfind(b"IEND", 33) + 8  # the chunk's type and CRC: it holds no data
    cut = None if 8 <= end <= len(data) else "it ends before its IEND chunk"
    return Header("PNG", int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big"), cut)


def _webp(data: bytes) -> Header:
    """The size of its first chunk: the canvas (VP8X), a lossless (VP8L) or a lossy (VP8) image."""
    cut = None if len(data) >= 8 + int.from_bytes(data[4:8], "little") else "it is shorter than its RIFF header says"
    if len(data) < 30:
        return Header("WebP", 0, 0, cut or "it ends before its size")
    chunk = data[12:16]
    if chunk == b"VP8X":
        width, height = (1 + int.from_bytes(data[at : at + 3], "little") for at in (24, 27))
    elif chunk == b"VP8L" and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        width, height = (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    elif chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        width, height = (int.from_bytes(data[at : at + 2], "little") & 0x3FFF for at in (26, 28))
    else:
        width = height = 0
    return Header("WebP", width, height, cut)


def _bmp(data: bytes) -> Header:
    """As OpenCV reads it: 16-bit sides after a 12-byte info header, 32-bit (a negative height is
    top-down) after one of 36 bytes or more, none after another."""
    if len(data) < 26:
        return Header("BMP", 0, 0, "it ends before its size")
    info = int.from_bytes(data[14:18], "little")
    if info == 12:
        return Header("BMP", int.from_bytes(data[18:20], "little"), int.from_bytes(data[20:22], "little"))
    if info >= 36:
        width, height = (abs(int.from_bytes(data[at : at + 4], "little", signed=True)) for at in (18, 22))
        return Header("BMP", width, height)
    return Header("BMP", 0, 0)


def _tiff(data: bytes) -> Header:
    """The sizes in its first directory (the image OpenCV decodes), a classic TIFF's or a BigTIFF's;
    the largest where a tag is given twice."""
    order: Literal["little", "big"] = "little" if data[:2] == b"II" else "big"
    big = data[2:4] in (b"+\x00", b"\x00+")
    offset, count_bytes, entry = (8, 8, 20) if big else (4, 2, 12)
    if len(data) < 4 + 4 * big + offset:
        return Header("TIFF", 0, 0, "it ends before its image directory")
    first = int.from_bytes(data[4 + 4 * big : 4 + 4 * big + offset], order)
    start = first + count_bytes
    entries = int.from_bytes(data[first:start], order)
    if start > len(data) or start + entries * entry > len(data):
        return Header("TIFF", 0, 0, "it ends before its image directory")
    fields = np.frombuffer(
        data, np.dtype(np.uint16).newbyteorder("<" if order == "little" else ">"), entries * entry // 2, start
    )
    rows = fields.reshape(entries, entry // 2)
    sizes = dict.fromkeys(_TIFF_SIZES, 0)
    for index in np.flatnonzero(np.isin(rows[:, 0], _TIFF_SIZES)):
        tag, kind = int(rows[index, 0]), int(rows[index, 1])
        length = _TIFF_INTEGER_BYTES.get(kind, offset + 1)
        if length > offset:  # not a number, or one not held in the entry: no size libtiff takes
            return Header("TIFF", 0, 0)
        at = start + int(index) * entry + 4 + offset
        sizes[tag] = max(sizes[tag], int.from_bytes(data[at : at + length], order))
    return Header("TIFF", sizes[256], sizes[257], tile=(sizes[322], sizes[323]))
