"""Still images: a folder or glob read with `read_image` in sorted order, looped and paced like a camera,
or, with ``pace = false``, each one handed to the model in turn (a folder to run the model over). Each
pass lists the images anew, so a folder that changes while it is read is read as it is.

Unreadable images (a JPEG still being written among them) are skipped, logged once each with why,
and counted; a folder where nothing decodes raises ``SourceError`` instead of spinning. Each frame
carries the name of its file (`frame_name`).
"""

from __future__ import annotations

import errno
import fnmatch
import glob
import logging
import os
import stat
from pathlib import Path
from typing import ClassVar, Literal

import cv2
import numpy as np

from edged.errors import ImageError, SourceError, out_of_room, printable
from edged.files import FileTooLarge, NotRegularFile, read_regular
from edged.settings.sources import JPEG_MAX_SIDE, MAX_SIDE, ImagesSourceConfig
from edged.sources.base import MAX_PIXELS, PIXEL_LIMIT
from edged.sources.image_header import KINDS, Header, read_header

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")
# The largest image decoded is the largest frame edged takes (`MAX_PIXELS`, `MAX_SIDE`), well below
# the 2^30 pixels (3.2 GB and more) OpenCV allows, which a file of a few kilobytes can claim and a
# 4 GB board cannot hold; a 96 KB PNG of 1000000x33 pixels, within MAX_PIXELS, took edged to 2.6 GB.
MAX_FILE_BYTES = 8 * MAX_PIXELS  # such an image uncompressed, 4 channels of 16 bits
# How much of a file `image_size` reads first: a PNG's, BMP's or WebP's size is in its first bytes,
# most JPEGs' within 4 KiB; one after a larger block (a phone's EXIF thumbnail) is read 16 times as
# far, and so on, until it is found.
HEADER_BYTES = 1 << 12


def is_image_file(path: Path) -> bool:
    """Named as an image, and a file or a link: a link to nothing (a git-annex or DVC data set whose
    content was never fetched) is listed, so that reading it says so instead of leaving it out."""
    return path.suffix.lower() in IMAGE_SUFFIXES and (path.is_file() or path.is_symlink())


def list_images(pattern: str) -> list[str]:
    """The image files named by ``pattern``: a folder (known suffixes only), a glob, or one file; sorted."""
    path = Path(pattern)
    if path.is_dir():
        return sorted(str(p) for p in path.iterdir() if is_image_file(p))
    if any(c in pattern for c in "*?["):
        return sorted(p for p in _glob(pattern) if os.path.isfile(p))
    if path.is_file():
        return [pattern]
    raise SourceError(f"image folder {pattern} does not exist (check source.path: a folder, a glob or a file)")


def _glob(pattern: str) -> list[str]:
    """``glob.glob(pattern, recursive=True)``, but a ``**`` pattern walks each folder once. glob's
    ``**`` follows links to folders, so a link back to a folder above (``latest -> .``) listed each
    image once per level (40), and two such links made the listing exponential: the camera's open
    never returned. A folder reached by a link and by its own path is listed under the first met,
    in sorted order."""
    parts = Path(pattern).parts
    if "**" not in parts:
        return glob.glob(pattern)
    fixed = next(i for i, part in enumerate(parts) if any(c in part for c in "*?["))
    root, wanted = os.path.join(*parts[:fixed]) if fixed else os.curdir, parts[fixed:]
    found: list[str] = []
    seen: set[tuple[int, int]] = set()
    for folder, folders, files in os.walk(root, followlinks=True):
        folders.sort()  # the first path met to a folder is the one kept
        try:
            status = os.stat(folder)
        except OSError:
            folders.clear()
            continue
        if (status.st_dev, status.st_ino) in seen:
            folders.clear()
            continue
        seen.add((status.st_dev, status.st_ino))
        at = Path(os.path.relpath(folder, root)).parts if folder != root else ()
        found += [os.path.normpath(os.path.join(folder, n)) for n in files if _matches((*at, n), wanted)]
    return found


def _matches(parts: tuple[str, ...], wanted: tuple[str, ...]) -> bool:
    """Whether a path's ``parts`` match the glob's segments as glob matches them: ``**`` any number of
    folders, a hidden name only by a segment that starts with a dot, case as written."""
    if not wanted:
        return not parts
    if wanted[0] == "**":
        return _matches(parts, wanted[1:]) or (bool(parts) and not parts[0].startswith(".") and _matches(parts[1:], wanted))
    return (
        bool(parts)
        and (not parts[0].startswith(".") or wanted[0].startswith("."))
        and fnmatch.fnmatchcase(parts[0], wanted[0])
        and _matches(parts[1:], wanted[1:])
    )


def read_image(path: str | Path, flags: int = cv2.IMREAD_COLOR) -> np.ndarray:
    """The image file at ``path``, read once and decoded from memory by OpenCV; `ImageError` saying
    why where it cannot be, or must not be (`edged.sources.image_header`): a JPEG cut short, which
    OpenCV decodes with its missing rows grey, a header claiming more than `MAX_PIXELS`, a side
    longer than `MAX_SIDE` (a JPEG's than `JPEG_MAX_SIDE`) or no size, a file larger than
    `MAX_FILE_BYTES`, a format other than those of `IMAGE_SUFFIXES` (its size is not known before it
    is decoded).

    Reading the bytes in Python also spares OpenCV's binding a file name that is not UTF-8 (Python
    holds its bytes as lone surrogates), on which it crashes with SIGSEGV.
    """
    try:
        data = read_regular(path, MAX_FILE_BYTES)  # a link to a pipe or a device among the images holds nothing up
    except NotRegularFile:
        raise ImageError(str(path), "not a regular file: a pipe, a device or a folder") from None
    except FileTooLarge as e:
        raise ImageError(str(path), f"{e.size / 1e6:.0f} MB, more than any image of {PIXEL_LIMIT} takes") from None
    except OSError as e:
        nothing = e.errno == errno.ENOENT and os.path.islink(path)  # not a loop of links (ELOOP)
        why = "a link to nothing: fetch its content" if nothing else e.strerror or str(e)
        raise ImageError(str(path), why) from e
    header = read_header(data)
    if header is None:
        raise ImageError(str(path), "empty" if not data else f"not a {KINDS} image")
    if header.cut is not None:
        why = f"truncated {header.kind}: {header.cut}; is it still being written, or was its copy cut short?"
        raise ImageError(str(path), why)
    if (refused := _size_problem(header)) is not None:
        raise ImageError(str(path), refused)
    try:
        image = cv2.imdecode(np.frombuffer(data, np.uint8), flags)
    except cv2.error:
        image = None
    if image is None:
        raise ImageError(str(path), f"a corrupt {header.kind} that OpenCV cannot decode")
    return image


def image_size(path: str) -> tuple[int, int] | None:
    """The width and height `read_image` would decode ``path`` at, from its header alone
    (`HEADER_BYTES` read, then more while they give no size), for a look at many images without
    decoding them; None for one `read_image` refuses before decoding: not a regular file, too large,
    no size, more pixels or a longer side than edged decodes. A JPEG that its EXIF orientation turns
    a quarter (`Header.turned`) is decoded with its sides swapped: taken unturned, a phone's portrait
    photo seemed to fit an ``inspect.roi`` it does not, and the reverse."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a pipe among the images holds nothing up
        try:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode) or status.st_size > MAX_FILE_BYTES:
                return None
            data = os.read(fd, HEADER_BYTES)
            header = read_header(data)
            while header is not None and not header.width * header.height and len(data) < status.st_size:
                if not (more := os.read(fd, 15 * len(data))):
                    break  # it was cut short since
                data += more
                header = read_header(data)
        finally:
            os.close(fd)
    except OSError:
        return None
    if header is None or _size_problem(header) is not None:
        return None
    return (header.height, header.width) if header.turned else (header.width, header.height)


def _size_problem(header: Header) -> str | None:
    """Why an image of ``header`` is not decoded, for its size: none given, more pixels than
    `MAX_PIXELS`, a side longer than `MAX_SIDE`, or a JPEG's than `JPEG_MAX_SIDE` (which libjpeg
    decodes no further, and OpenCV then calls corrupt); None where it is."""
    if not header.width * header.height:
        return f"its {header.kind} header gives no image size"
    if header.pixels > MAX_PIXELS:
        return f"its {header.kind} header claims {header.size} pixels, over the {PIXEL_LIMIT} edged decodes"
    if max(header.width, header.height) > MAX_SIDE:
        return f"its {header.kind} header claims {header.size} pixels, a side longer than the {MAX_SIDE} edged decodes"
    if header.kind == "JPEG" and max(header.width, header.height) > JPEG_MAX_SIDE:
        return f"its JPEG header claims {header.size} pixels, a side longer than the {JPEG_MAX_SIDE} a JPEG holds"
    return None


def frame_names(pattern: str, paths: list[str]) -> list[str]:
    """The names the frames of ``paths`` (`list_images` of ``pattern``) carry: a folder's images their
    file name, a glob's the path it matched, which says where. A name that is not UTF-8 is shown with
    U+FFFD where its odd bytes were: messages are UTF-8 JSON."""
    folder = os.path.isdir(pattern)
    return [os.fsencode(os.path.basename(p) if folder else p).decode(errors="replace") for p in paths]


def _into(out: np.ndarray | None, image: np.ndarray) -> np.ndarray:
    """``image`` copied into ``out`` when the shapes match, else ``image`` itself (a new size)."""
    if out is not None and out.shape == image.shape and out.dtype == image.dtype:
        np.copyto(out, image)
        return out
    return image


class ImagesSource:
    """Still images read with `read_image` in sorted order; unreadable ones are skipped and counted."""

    frame_sizes_vary: ClassVar[bool] = True  # a folder may hold images of any size, each one processed

    def __init__(self, cfg: ImagesSourceConfig) -> None:
        self._cfg = cfg
        self.channel_order: Literal["bgr", "rgb"] = cfg.channel_order
        self._paths: list[str] = []
        self._names: list[str] = []
        self._next = 0
        self._last = ""
        self._reported: set[str] = set()
        self._skipped = 0

    @property
    def skipped(self) -> int:
        """Unreadable images met so far, counted on every pass although each is logged only once."""
        return self._skipped

    def open(self) -> None:
        self._list()
        self._next = 0
        log.info(
            "image source %s: %d images %s, loop=%s",
            self._cfg.path,
            len(self._paths),
            f"at {self._cfg.fps:.1f} fps" if self._cfg.pace else "each taken by the model in turn",
            self._cfg.loop,
            extra={"CAMERA": self._cfg.camera_id},
        )

    def _list(self) -> None:
        """The images at ``path`` as they are now; `SourceError` where there are none."""
        self._paths = list_images(self._cfg.path)
        if not self._paths:
            kinds = " ".join(sorted(IMAGE_SUFFIXES))
            raise SourceError(f"no images found at {self._cfg.path} (looked for {kinds}; check source.path)")
        self._names = frame_names(self._cfg.path, self._paths)

    def read(self, out: np.ndarray | None) -> np.ndarray | None:
        """The next image that can be read. Each pass after the first lists the images again, so those
        added, renamed or replaced since are read and those removed are not looked for; `SourceError`
        once a whole pass's images could not be read, with the last one's reason."""
        failed, why = 0, ""
        while failed < len(self._paths):
            if self._next == len(self._paths):
                if not self._cfg.loop:
                    return None
                self._relist()
                failed = 0
            path, self._last = self._paths[self._next], self._names[self._next]
            self._next += 1
            try:
                image = read_image(path)
            except ImageError as e:
                if out_of_room(e.__cause__):  # the process's want, not the image's: none skipped, the camera retried
                    raise SourceError(f"cannot read {printable(path)}: {e.why}") from e
                self._skip(path, e.why)
                failed, why = failed + 1, f"{printable(path)}: {e.why}"
                continue
            return _into(out, image)
        raise SourceError(
            f"none of the {len(self._paths)} images at {self._cfg.path} could be read (the last, {why}; each is logged once)"
        )

    def _relist(self) -> None:
        """A new pass: the images listed again, and said when their number changed."""
        before = len(self._paths)
        self._list()
        self._next = 0
        if len(self._paths) != before:
            log.info(
                "image source %s: %d images now (%d before this pass)",
                self._cfg.path,
                len(self._paths),
                before,
                extra={"CAMERA": self._cfg.camera_id},
            )

    def _skip(self, path: str, why: str) -> None:
        self._skipped += 1
        if path not in self._reported:
            self._reported.add(path)
            log.warning(
                "skipping unreadable image %s (%s)",
                printable(path),
                why,
                extra={"CAMERA": self._cfg.camera_id},
            )

    def frame_name(self) -> str:
        """The file of the image the last ``read`` returned: its name in a folder, the matched path for a glob."""
        return self._last

    def pace(self) -> float | None:
        return 1.0 / self._cfg.fps if self._cfg.pace else None

    def keeps_every_frame(self) -> bool:
        """With ``pace = false`` every image is processed: the next is read once the model took this one."""
        return not self._cfg.pace

    def close(self) -> None:
        """Nothing to release: `read_image` opens and closes each file itself."""
