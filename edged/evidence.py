"""Evidence images: the frames worth keeping, saved for audit and to label and retrain the model.

Per saved frame, three files under ``DIR/CAMERA/YYYY-MM-DD/`` (the day of capture, UTC):
``images/STEM.jpg`` (the frame as captured, not annotated; ``STEM.png`` for a frame with a side
longer than a JPEG holds, `JPEG_MAX_SIDE`), ``labels/STEM.txt`` (the detections
in YOLO format, ``class cx cy w h`` normalised) and ``messages/STEM.json`` (the detections message
as published); for an anomaly model also ``maps/STEM.png``, its anomaly map (grey, 0..255 for the
normalised 0..1, at the model's input size). ``images/`` beside ``labels/`` is the layout ultralytics training and
``edged eval --data`` read as it is, and labelling tools import as YOLO pre-annotations; each
folder of a detector or segmenter also has a ready ``data.yaml`` (ultralytics: the folder, the model's
class names in order, every path quoted, as YAML reads an unquoted day folder as a date; a
classifier's trains from a day's ``images/``, and an anomaly model's would take its maps for
training images), and every folder ``classes.txt`` (one name per line, as labelling tools import
YOLO) and ``dataset.json`` (the model's task and names).
A label file holds every detection, those outside the zones too: an object the line ignores there
is still an object to learn. A classification model's frame has no label file: its image is filed
under its best class, ``images/CLASS/STEM.jpg``, so that ``images/`` is an ultralytics
classification folder (one folder per class: ``yolo classify train data=DIR/CAMERA/DAY/images``
splits it).

A folder is the dataset of one model, by its task and class names: a label's class id means a name
only beside the names it was written with. So the camera folder holds the evidence of the model
first saved there, and a model of another task or other names (a reload, or a restart with another
model) saves to a folder of its own beside it, ``DIR/CAMERA@TASK-HASH/`` (`dataset_name`), laid out
the same; nothing saved is moved or described anew, and a model brought back finds its folder
again. The folder is picked on the loop from what the camera folder held when the writer started,
so the path handed to the journal is where the image goes. Each camera's folder is its own: cameras
whose folders the drive takes for one (ids alike but for case on a FAT or exFAT drive, a link from one
to the other) are refused at start and at a reload (`EvidenceOutput.shared`), and by their writers
where a drive mounted since makes them so; a classifier whose class folders such a drive would take
for one saves nothing there (`merged_classes`).

Which frames are kept is a pure function of the policy (`should_save`), decided on the loop before
the frame is copied, so a frame that will not be saved costs nothing. Encoding and writing happen on
one background thread behind a small bounded queue: a full queue drops the frame and counts it,
never blocking inference. A disk that is full, read-only, missing or not ours is logged once per
burst and counted; inference goes on. Retention (`max_bytes`, oldest first, and `max_age_days`)
covers every folder of the camera together; it is enforced at start-up, which also removes what a
power cut left half written, and after every save from a running total, never by rescanning the
tree per frame. A frame's age counts from its image's time, which a step of the wall clock forward
moves on by as much, whether edged runs or is stopped in the same boot (`EvidenceStore.follow_clock`:
the camera folder's ``.edged-clock.json`` holds the boot and clock the images are stamped on). A
day folder dated before 2026 (`EPOCH_DAY`) was stamped by a clock not yet set: its frames go last
for room, and by age only once a clock set right in their boot gave them their time.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import queue
import re
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache, partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import cv2
import numpy as np

from edged.errors import printable
from edged.files import MadeFolders, read_regular
from edged.identity import CLOCK_EPOCH_NS, boot_id
from edged.lograte import Failures
from edged.messages import EvidenceReport, Task, Verdict
from edged.output import NO_REPORT, FrameReport, Output, OutputReport, Services
from edged.settings.evidence import DEFAULT_NOTE, EvidenceConfig, SavePolicy
from edged.settings.service_dirs import service_dirs
from edged.settings.sources import JPEG_MAX_SIDE

if TYPE_CHECKING:
    from edged.config import Settings

    # A type only: the camera kinds' settings name [evidence]'s, so this module loads before edged.sources.
    from edged.sources.base import Frame
    from edged.task import TaskResult

log = logging.getLogger(__name__)

QUEUE_FRAMES = 4  # frames waiting for the writer: bounds the memory a slow disk can take (4 copies)
IDLE_WAKE_S = 60.0  # the writer wakes this often without frames, so age pruning runs on a quiet line
RATE_WINDOW_S = 60.0
STEP_S = 3600.0  # a step of the wall clock forward by more moves the saved images' times (`EvidenceStore.follow_clock`)
STOP_WAIT_S = 1.0  # at stop, time left to each writer to finish its queue (a few ms per frame)
SUBFOLDERS = ("images", "labels", "messages")
MAPS = "maps"  # an anomaly model's map, made only for frames that have one
SIDECAR_FOLDERS = (*SUBFOLDERS, MAPS)
IDENTITY = "dataset.json"  # in each dataset folder: the task and class names of the model whose evidence it is
CLOCK_RECORD = ".edged-clock.json"  # in the camera folder: the boot and clock its images were stamped on (`follow_clock`)
# Beside the saved frames: in each dataset folder, written at its first save; the camera folder's CLOCK_RECORD.
DATASET_FILES = ("data.yaml", "classes.txt", IDENTITY, CLOCK_RECORD)
EPOCH_S = CLOCK_EPOCH_NS / 1e9  # an image whose time is earlier was stamped by a clock not yet set: its age is unknown
EPOCH_DAY = f"{datetime.fromtimestamp(EPOCH_S, tz=timezone.utc):%Y-%m-%d}"  # a day folder named earlier holds such frames
# The tasks whose dataset ultralytics trains from a data.yaml of the whole folder: a classifier's trains
# from a day's images/, and an anomaly model's would take its maps/ for training images.
YAML_TASKS = ("detect", "segment")
SUFFIXES = {"images": ".jpg", "labels": ".txt", "messages": ".json", MAPS: ".png"}
SAVED_SUFFIXES = (".jpg", ".png")  # a saved frame's image: JPEG, or PNG where a side is past JPEG's (`image_suffix`)
_DAY = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")  # what a part id may not bring into a file name
_FILE_MODE = 0o640


@dataclass(frozen=True, slots=True)
class EvidenceFrame:
    """What the writer saves of one frame; ``image`` is the caller's own copy, ``message`` the JSON
    published for it (None when the frame was not published: no sidecar then)."""

    camera_id: str
    frame_id: int
    capture_time_ns: int
    image: np.ndarray
    channel_order: Literal["bgr", "rgb"]
    label: str  # the dataset label file (`edged.task.TaskResult.dataset_label`)
    message: bytes | None
    names: tuple[str, ...]  # the model's class names, by class id (`edged.model.LoadedModel.class_names`)
    task: Task  # the model's: with ``names``, which dataset the frame belongs to
    dataset: str  # the dataset folder under the evidence folder (`EvidenceStore.dataset_for`)
    part_id: str | None = None  # the request's, in request mode
    image_class: str | None = None  # a classifier's: the class folder under images/ (no label file then)
    heatmap: np.ndarray | None = None  # the caller's copy of `edged.task.TaskResult.heatmap`: maps/STEM.png


def should_save(save: SavePolicy, verdict: Verdict | None, found: int, near: int) -> bool:
    """Whether a frame with ``found`` detections and ``near`` near misses is evidence under ``save``.

    Without a verdict (no inspection configured) a frame is ``ng`` when it has a detection.
    ``ng+near`` adds frames with a near miss, a score the decoder found within ``near_margin``
    below its class's threshold (`edged.decode.Detections.near`): what the model is unsure about
    is what is worth labelling. The decoder alone compares scores with thresholds, so a score is
    never judged twice, once in float32 and once in float64. A frame a classifier is uncertain of
    is kept as an NG one is: its best class is the one to check and relabel.
    """
    if save == "all":
        return True
    if verdict in ("ng", "uncertain") or (verdict is None and found > 0):
        return True
    return save == "ng+near" and near > 0


def day_and_stem(camera_id: str, capture_time_ns: int, frame_id: int, part_id: str | None = None) -> tuple[str, str]:
    """The day folder and file stem of a frame: names sort by capture time, so oldest first is name
    order; a request's part id ends the stem (as letters, digits and ``_ . -``, at most 64), so a
    part's pictures are found by name."""
    when = datetime.fromtimestamp(capture_time_ns / 1e9, tz=timezone.utc)
    stem = f"{camera_id}_{when:%Y%m%dT%H%M%S}{when.microsecond // 1000:03d}_{frame_id}"
    if part_id:
        stem += "_" + _UNSAFE.sub("_", part_id)[:64]
    return f"{when:%Y-%m-%d}", stem


def class_folder(name: str) -> str:
    """A class name as a folder under ``images/``: letters, digits and ``_ . -``, at most 64. A name
    that must change to be one ends in ``-`` and 8 hex digits of its hash: changed alone, two classes
    (``傷`` and ``凹``, ``a b`` and ``a_b``, two long names alike in their first 64) shared a folder,
    and a classification dataset made of it trained both as one class."""
    folder = _UNSAFE.sub("_", name)[:64]
    if folder == name and folder.strip("."):
        return folder
    digest = hashlib.sha256(name.encode(errors="surrogatepass")).hexdigest()[:8]
    return f"{folder[:55] if folder.strip('.') else '_'}-{digest}"


@lru_cache(maxsize=4)
def alike_classes(names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """The pairs of class names whose folders (`class_folder`) differ only in case, or in dots at the end:
    one folder on a drive that ignores case (FAT, exFAT), which drops such dots too, where a classifier's
    frames of the one would be filed as the other's."""
    first: dict[str, str] = {}  # a folder in lower case, its dots at the end dropped: the first class filed there
    pairs = []
    for name in names:
        folded = class_folder(name).lower().rstrip(".")
        if folded in first:
            pairs.append((first[folded], name))
        else:
            first[folded] = name
    return tuple(pairs)


def merged_classes(dataset: Path, task: Task, names: tuple[str, ...]) -> str | None:
    """Why a classifier's frames cannot be filed by class in ``dataset`` (a folder holding its ``dataset.json``):
    two classes' folders differ only in case (`alike_classes`) and the drive takes ``DATASET.JSON`` for
    ``dataset.json``, so it would take them for one. None where they stay apart."""
    pairs = alike_classes(names)
    if not pairs or not same_file(dataset / IDENTITY, dataset / IDENTITY.upper()):
        return None
    a, b = pairs[0]
    return (
        f"classes {printable(a)} and {printable(b)} of the {task} model would share one folder under images/, for "
        "the drive takes names that differ only in case, or in dots at the end, for one (a FAT or exFAT file "
        "system): a frame of the one "
        "would be filed as the other's, so none of this model is saved; rename one of the classes, or point "
        "evidence.dir at a drive that tells case apart (ext4)"
    )


def image_suffix(width: int, height: int) -> str:
    """The file suffix a frame of this size is saved as: ``.jpg``, or ``.png`` for a frame with a side
    longer than `JPEG_MAX_SIDE` (an image of up to 65535 pixels on a side), which no JPEG can hold:
    it would fail to save every time it came. PNG keeps the frame as it was captured, and ultralytics
    and ``edged eval`` read it from ``images/`` as they read a JPEG."""
    return ".png" if max(width, height) > JPEG_MAX_SIDE else ".jpg"


def _images(day: Path) -> list[Path]:
    """A day's images, ``images/*.jpg`` and a classifier's ``images/CLASS/*.jpg`` (or ``.png``,
    `image_suffix`), temp files included."""
    images = day / "images"
    if not images.is_dir():
        return []
    found: list[Path] = []
    for path in images.iterdir():
        found.extend(path.iterdir() if path.is_dir() else [path])
    return found


def data_yaml(camera_id: str, names: tuple[str, ...]) -> str:
    """An ultralytics dataset file for a camera folder: every image under it, ``names`` in class order.

    Every string is quoted (JSON's quoting is YAML's): YAML reads an unquoted ``2026-12-03`` as a date.
    No ``path`` key: ultralytics then takes the file's own folder, so a copied-out folder still works.
    """
    lines = [
        f"# The evidence of camera {camera_id} as an ultralytics dataset: every image under this folder,",
        "# its labels in the labels/ folder beside its images/ folder. The labels are the model's",
        "# predictions: correct them before training on them. To use one day's folder, quote it:",
        '# val: "2026-12-03" (unquoted, YAML reads it as a date).',
        'train: "."',
        'val: "."',
        f"nc: {len(names)}",
        "names:",
        *(f"  {class_id}: {_yaml_quoted(name)}" for class_id, name in enumerate(names)),
    ]
    return "\n".join(lines) + "\n"


# What YAML's reader takes as it is in a file, less its line breaks (U+0085, U+2028, U+2029).
_YAML_UNPRINTABLE = re.compile("[^\x20-\x7e\xa0-\u2027\u202a-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _yaml_quoted(text: str) -> str:
    """``text`` as a YAML double-quoted string: JSON's quoting, with what is past U+FFFF written as
    itself, for JSON writes it as two surrogate escapes that PyYAML (ultralytics' reader) reads as
    two lone surrogates, which no output can then encode (an emoji class name); what YAML does
    not take as it is, escaped."""
    return _YAML_UNPRINTABLE.sub(lambda m: f"\\u{ord(m[0]):04x}", json.dumps(text, ensure_ascii=False))


Identity = tuple[str | None, tuple[str, ...]]  # a model's task and class names; task None: a folder an older edged wrote
_MAX_RECORD_BYTES = 1 << 20  # a dataset.json or classes.txt: thousands of class names take kilobytes
_UNREADABLE: Identity = ("", ())  # a dataset.json or classes.txt that cannot be read: no model's task, so no model's folder


def dataset_name(camera_id: str, task: Task, names: tuple[str, ...]) -> str:
    """The dataset folder of a model whose task or class names are not those of the camera folder's:
    ``CAMERA@TASK-HASH`` beside it, the hash of the task and names, so that the same model finds its
    folder again and no camera id (no ``@`` in it) names it."""
    digest = hashlib.sha256(json.dumps([task, list(names)]).encode()).hexdigest()[:8]
    return f"{camera_id}@{task}-{digest}"


def recorded_identity(folder: Path) -> Identity | None:
    """The model whose evidence a dataset folder holds: its ``dataset.json``; for a folder an older
    edged wrote, without one, the names of its ``classes.txt`` (task unknown); None for a folder
    with neither, which is anyone's. One that cannot be read as either (malformed, or a file edged's
    user may not read) matches no model, so frames go to a folder of their own rather than fail."""
    try:
        record = json.loads(_read_record(folder / IDENTITY))
        return str(record["task"]), tuple(str(name) for name in record["names"])
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError):
        return _UNREADABLE
    try:
        # As an editor may leave it: a byte-order mark, CRLF line ends, blank lines after the names.
        return None, tuple(_read_record(folder / "classes.txt").decode("utf-8-sig").rstrip("\r\n").splitlines())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return _UNREADABLE


def _read_record(path: Path) -> bytes:
    """A dataset folder's ``dataset.json`` or ``classes.txt``; ValueError for one that is no regular
    file (a pipe would hold up the loop that reads it) or larger than any model's names take."""
    return read_regular(path, _MAX_RECORD_BYTES)


def _matches(recorded: Identity, task: Task, names: tuple[str, ...]) -> bool:
    """Whether a folder recorded as ``recorded`` is the dataset of a model of ``task`` and ``names``."""
    return recorded[1] == names and recorded[0] in (None, task)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def _is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` at ``path`` whole or not at all: a temp file in the same folder, fsync, rename."""
    temp = _temp_name(path)
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, _FILE_MODE)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def _size(path: Path) -> int:
    """The bytes of the file at ``path``; 0 for none, or a folder put where one goes (not edged's bytes)."""
    try:
        found = path.stat()
    except FileNotFoundError:
        return 0
    return found.st_size if stat.S_ISREG(found.st_mode) else 0


def _today(now_s: float) -> str:
    return f"{datetime.fromtimestamp(now_s, tz=timezone.utc):%Y-%m-%d}"


def _ordered(days: Iterable[str], today: str) -> deque[str]:
    """Day folders in the order retention deletes them. First those dated after ``today``: stamped
    by a clock since stepped back from a wrong future, so saved before any frame stamped now. Last
    those dated before `EPOCH_DAY`: stamped by a clock not yet set, of an age unknown, and maybe the
    newest (the frames of a boot where the clock was wrong, saved before NTP set it)."""
    return deque(sorted(days, key=lambda day: (2 if day < EPOCH_DAY else 0 if day > today else 1, day)))


def _remove_empty(days: Iterable[Path]) -> None:
    """Remove the folders of days whose frames are all gone (a classifier's class folders too)."""
    for day in days:
        if (day / "images").is_dir():
            for folder in (day / "images").iterdir():
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
        for sub in SIDECAR_FOLDERS:
            if (day / sub).is_dir() and not any((day / sub).iterdir()):
                (day / sub).rmdir()
        if day.is_dir() and not any(day.iterdir()):
            day.rmdir()


def _recorded_clock(path: Path) -> tuple[str, float] | None:
    """The boot and clock (`_wall_less_boot_clock`) a camera's images were last stamped on, as its
    `CLOCK_RECORD` says; None where it says nothing readable (none yet: an older edged's folder), or
    no time: NaN, which Python's JSON reader takes, would make every step of the clock compared
    with it NaN, and none would be followed."""
    try:
        record = json.loads(read_regular(path, _MAX_RECORD_BYTES))
        boot, clock = str(record["boot_id"]), float(record["wall_less_boot_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (boot, clock) if math.isfinite(clock) else None


class EvidenceStore:
    """One camera's evidence folders: the layout, atomic saves, and retention from a running total.

    Each folder is the dataset of one model, by its task and class names: the camera folder that of
    the first model saved there (``dataset.json`` says which), ``CAMERA@TASK-HASH`` beside it that of
    any other (`dataset_name`), so a label file is always described by the names of the model that
    wrote it, and a classifier's folders never land in a detector's dataset. Retention counts them
    all as the camera's. Every method may raise OSError (a full, read-only, missing or foreign
    directory); the writer counts it. A save writes the label and the message before the image and
    makes both durable first, so a power cut leaves at worst a label without its image (removed at
    the next `open`), never an image without its label; deleting goes the other way round.
    """

    def __init__(
        self, root: Path, camera_id: str, max_bytes: int, max_age_days: float, others: Mapping[str, Path] | None = None
    ) -> None:
        """``others``: the other cameras' evidence folders, by camera id, which the camera folder must not
        be (`shared_with`): one the drive had not mounted at start is compared as `open` makes it."""
        self.root = root
        self.camera_id = camera_id
        self.folder = root / camera_id
        self._others = others or {}
        self.max_bytes = max_bytes
        self.max_age_s = max_age_days * 86400.0
        self.total_bytes = 0
        self.boot_id = boot_id()
        self.clock_s = _wall_less_boot_clock()  # the clock the images saved since are stamped on (`follow_clock`)
        self._recorded = False  # CLOCK_RECORD holds this boot and `clock_s`, or cannot (a folder: said once)
        self._undated_due: float | None = None  # the earliest time of an image set right in a day before EPOCH_DAY
        self._days: deque[str] = deque()  # day folders of every dataset, in the order they go (`_ordered`)
        self._oldest: deque[tuple[Path, Path]] = deque()  # the first day to go's (day folder, image), loaded by `prune`
        self._datasets: set[str] = set()  # the camera's dataset folders under root
        self._described: set[str] = set()  # datasets checked and described since `open`
        try:  # read here, once, so that `dataset_for` on the loop never touches the disk
            self.primary = recorded_identity(self.folder)  # the camera folder's model
        except OSError:
            self.primary = None  # checked again by the save: a folder that holds another model's is refused
        self.opened = False

    def dataset_for(self, task: Task, names: tuple[str, ...]) -> str:
        """The dataset folder, under root, of a model of ``task`` and ``names``: the camera folder
        when it is that model's (or no model's yet: it becomes this one's), else `dataset_name`."""
        primary = self.primary
        if primary is None or (primary[0] is None and primary[1] == names):
            self.primary = primary = (task, names)
        return self.camera_id if primary == (task, names) else dataset_name(self.camera_id, task, names)

    def open(self) -> None:
        """Scan the camera's folders once: remove temp files and half-written sets, total the rest,
        follow a step of the clock since the images were stamped (`follow_clock`), prune. A camera
        folder that is another camera's too (`shared_with`) is refused: nothing is saved there."""
        self.root.mkdir(exist_ok=True)
        self.folder.mkdir(exist_ok=True)
        if (problem := shared_with(self.camera_id, self.folder, self._others)) is not None:
            raise OSError(errno.EEXIST, problem, str(self.folder))
        recorded = _recorded_clock(self.folder / CLOCK_RECORD)
        mine = f"{self.camera_id}@"
        datasets = {p.name for p in self.root.iterdir() if p.name.startswith(mine) and p.is_dir()} | {self.camera_id}
        total, days = 0, set()
        for dataset in sorted(datasets):
            folder = self.root / dataset
            total += sum(_size(folder / name) for name in DATASET_FILES)
            for day in (p.name for p in folder.iterdir() if _DAY.match(p.name) and p.is_dir()):
                total += self._clean_day(folder / day)
                days.add(day)
        self.total_bytes, self._days, self._oldest = total, _ordered(days, _today(time.time())), deque()
        self._datasets, self._described = datasets, set()  # described again at their next save
        self._undated_due = self._earliest_undated()
        self.opened = True
        self._recorded = recorded is not None and recorded[0] == self.boot_id
        self.clock_s = recorded[1] if recorded is not None and self._recorded else _wall_less_boot_clock()
        self.follow_clock()
        self.prune(time.time())

    def _clean_day(self, day: Path) -> int:
        """Delete a day's temp files and labels or messages without an image; its remaining bytes."""
        images = _images(day)
        stems = {p.stem for p in images if not _is_temp(p.name)}
        total = 0
        for sub in SIDECAR_FOLDERS:
            folder = day / sub
            if not folder.is_dir():
                continue
            for path in images if sub == "images" else list(folder.iterdir()):
                if _is_temp(path.name) or path.stem not in stems:
                    path.unlink(missing_ok=True)
                else:
                    total += _size(path)
        return total

    def save(self, frame: EvidenceFrame, jpeg_quality: int) -> None:
        day, stem = day_and_stem(frame.camera_id, frame.capture_time_ns, frame.frame_id, frame.part_id)
        dataset = self._dataset(frame)
        if frame.image_class is not None and (problem := merged_classes(dataset, frame.task, frame.names)):
            raise OSError(errno.EEXIST, problem, str(dataset))
        folder = dataset / day
        self._make_folders(folder)
        image = frame.image if frame.channel_order == "bgr" else cv2.cvtColor(frame.image, cv2.COLOR_RGB2BGR)
        suffix = image_suffix(image.shape[1], image.shape[0])
        params = [cv2.IMWRITE_JPEG_QUALITY, jpeg_quality] if suffix == ".jpg" else []
        ok, encoded = cv2.imencode(suffix, image, params)
        if not ok:
            raise OSError(errno.EINVAL, f"OpenCV could not encode frame {frame.frame_id} as {suffix[1:].upper()}")
        images = folder / "images"
        sidecars = []
        if frame.image_class is None:
            sidecars.append((folder / "labels" / f"{stem}.txt", frame.label.encode()))
        else:
            images = self._class_folder(images, frame.image_class)
        if frame.message is not None:
            sidecars.append((folder / "messages" / f"{stem}.json", frame.message))
        if frame.heatmap is not None:
            ok, png = cv2.imencode(".png", frame.heatmap)
            if not ok:
                raise OSError(errno.EINVAL, f"OpenCV could not encode the map of frame {frame.frame_id} as PNG")
            (folder / MAPS).mkdir(exist_ok=True)
            sidecars.append((folder / MAPS / f"{stem}.png", png.tobytes()))
        image_path, image_bytes = images / f"{stem}{suffix}", encoded.tobytes()
        written: list[Path] = []
        try:
            for path, data in sidecars:
                write_atomic(path, data)
                written.append(path)
            for parent in {path.parent for path in written}:  # durable before the image exists
                _fsync_dir(parent)
            write_atomic(image_path, image_bytes)
            written.append(image_path)
            _fsync_dir(image_path.parent)
        except BaseException:
            for path in reversed(written):
                path.unlink(missing_ok=True)
            raise
        self.total_bytes += len(image_bytes) + sum(len(data) for _, data in sidecars)
        now = time.time()
        if day not in self._days:
            days = _ordered([*self._days, day], _today(now))
            if self._days and days[0] != self._days[0]:  # a new first to go: the one loaded is not
                self._oldest = deque()
            self._days = days
        if day < EPOCH_DAY and now >= EPOCH_S:  # stamped before a step the clock made since: its time is right
            self._undated_due = min(now, self._undated_due or now)

    def _dataset(self, frame: EvidenceFrame) -> Path:
        """The frame's dataset folder, made if new (a known one deleted under the running daemon: made
        again, and all rescanned), and described at its first save since `open`."""
        folder = self.root / frame.dataset
        if not folder.is_dir():
            if frame.dataset in self._datasets or not self.root.is_dir():
                self.opened = False
                self.open()
            if not folder.is_dir():
                folder.mkdir()
                _fsync_dir(self.root)
                log.info(
                    "evidence of the %s model with classes %s goes to %s, a dataset of its own: %s holds the "
                    "evidence of another model",
                    frame.task,
                    ", ".join(frame.names),
                    folder,
                    self.folder,
                    extra={"CAMERA": frame.camera_id, "STAGE": "evidence"},
                )
            self._datasets.add(frame.dataset)
        if frame.dataset not in self._described:
            self._describe(folder, frame)
        return folder

    def _describe(self, folder: Path, frame: EvidenceFrame) -> None:
        """``dataset.json``, ``data.yaml`` and ``classes.txt`` of the frame's model, once the folder is
        known to be its dataset (or no model's yet); one that holds another model's is refused."""
        recorded = recorded_identity(folder)
        if recorded is not None and not _matches(recorded, frame.task, frame.names):
            if frame.dataset == self.camera_id:
                self.primary = recorded  # the frames offered from now on go to a folder of their own
            held = (
                f"the {recorded[0] or 'a'} model with classes {', '.join(recorded[1])}"
                if recorded != _UNREADABLE
                else f"a model its {IDENTITY} or classes.txt does not name readably"
            )
            raise OSError(
                errno.EEXIST,
                f"the folder holds the evidence of {held}, not of the {frame.task} model with classes "
                f"{', '.join(frame.names)}: the frame is not saved, and the next go to a folder of their own",
                str(folder),
            )
        identity = json.dumps({"task": frame.task, "names": list(frame.names)}) + "\n"
        names = "".join(f"{n}\n" for n in frame.names)
        files = [("classes.txt", names), (IDENTITY, identity)]
        if frame.task in YAML_TASKS:
            files.insert(0, ("data.yaml", data_yaml(frame.camera_id, frame.names)))
        for name, text in files:
            path, data = folder / name, text.encode()
            before = _size(path)
            write_atomic(path, data)
            self.total_bytes += len(data) - before
        _fsync_dir(folder)
        self._described.add(frame.dataset)

    @staticmethod
    def _make_folders(day: Path) -> None:
        """The day's three folders; a new folder's entry is made durable in its parent."""
        for sub in SUBFOLDERS:
            folder = day / sub
            if not folder.is_dir():
                folder.mkdir(parents=True, exist_ok=True)
                _fsync_dir(folder.parent)
                _fsync_dir(folder.parent.parent)

    @staticmethod
    def _class_folder(images: Path, name: str) -> Path:
        """A class's folder under a day's ``images/``; a new one's entry made durable in its parent."""
        folder = images / name
        if not folder.is_dir():
            folder.mkdir(exist_ok=True)
            _fsync_dir(images)
        return folder

    def prune(self, now_s: float) -> int:
        """Delete the oldest sets of every dataset while over ``max_bytes`` or older than
        ``max_age_days``; how many went. An image whose time is before `EPOCH_S` was stamped by a
        clock not yet set and never set right since (`follow_clock`): its age is unknown, and only
        ``max_bytes`` deletes it, after every frame of a known day (`_ordered`)."""
        cutoff = now_s - self.max_age_s if self.max_age_s else None
        today = _today(now_s)
        deleted = 0
        while self._days:
            if not self._oldest and not self._load_oldest(today):
                continue
            day, image = self._oldest[0]
            if self.total_bytes <= self.max_bytes:
                if cutoff is None or day.name < EPOCH_DAY:  # those the clock was set right for: `_age_undated`
                    break
                try:
                    mtime = image.stat().st_mtime
                except FileNotFoundError:
                    self._oldest.popleft()
                    continue
                if not EPOCH_S <= mtime < cutoff:
                    break
            self._delete(day, image)
            self._oldest.popleft()
            deleted += 1
        if cutoff is not None and self._undated_due is not None and self._undated_due < cutoff:
            deleted += self._age_undated(cutoff)
        return deleted

    def follow_clock(self) -> None:
        """A step of the wall clock forward since the images were stamped (NTP setting right a board
        that ran on a clock behind, while edged ran or while it was stopped in the same boot) moves
        their times on by as much, so that the age limit counts from when they were saved and
        deletes none early; a step back is let be (its frames only stay longer, within
        ``max_bytes``). The clock they are stamped on is kept in `CLOCK_RECORD` with the boot's id,
        so that the next start in this boot sees a step made while edged was stopped; an earlier
        boot's clock cannot be compared with this one's."""
        clock = _wall_less_boot_clock()
        step = clock - self.clock_s
        if step > STEP_S:
            moved = self.restamp(time.time() - step, step)
            log.warning(
                "evidence: the wall clock was stepped forward by %.1f days; the times of the %d images saved "
                "before are moved on by as much, so the age limit counts from when they were saved",
                step / 86400,
                moved,
                extra={"CAMERA": self.camera_id, "STAGE": "evidence"},
            )
        if abs(step) > STEP_S:
            self.clock_s, self._recorded = clock, False
        if not self._recorded:
            path = self.folder / CLOCK_RECORD
            data = (json.dumps({"boot_id": self.boot_id, "wall_less_boot_s": self.clock_s}) + "\n").encode()
            before = _size(path)
            try:
                write_atomic(path, data)
                self.total_bytes += len(data) - before
            except IsADirectoryError:  # not the disk: saving goes on, and trying again at every save would wear it
                log.warning(
                    "evidence: %s is a folder, so the clock the images are stamped on cannot be recorded, and a "
                    "step of the clock while edged is stopped will not be followed: remove the folder",
                    path,
                    extra={"CAMERA": self.camera_id, "STAGE": "evidence"},
                )
            self._recorded = True

    def restamp(self, before_s: float, by_s: float) -> int:
        """Move the images saved before ``before_s`` on by ``by_s``: the wall clock was stepped forward
        by as much since (`follow_clock`), and the age limit counts from an image's time. How many moved."""
        moved = 0
        for dataset in sorted(self._datasets):
            for day in self._days:
                for image in _images(self.root / dataset / day):
                    try:
                        stamp = image.stat()
                        if image.suffix in SAVED_SUFFIXES and stamp.st_mtime < before_s:
                            os.utime(image, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + round(by_s * 1e9)))
                            moved += 1
                    except FileNotFoundError:
                        continue
        self._undated_due = self._earliest_undated()
        return moved

    def _undated(self) -> Iterator[tuple[Path, Path, float]]:
        """The images in the day folders dated before `EPOCH_DAY` (day folder, image, time)."""
        for name in [day for day in self._days if day < EPOCH_DAY]:
            for dataset in sorted(self._datasets):
                day = self.root / dataset / name
                for image in _images(day):
                    if image.suffix in SAVED_SUFFIXES:
                        try:
                            mtime = image.stat().st_mtime
                        except FileNotFoundError:
                            continue
                        yield day, image, mtime

    def _earliest_undated(self) -> float | None:
        """The earliest time of an image in a day before `EPOCH_DAY` that the clock was set right for
        (`restamp`), when it is known when it was saved; None where there is none."""
        return min((mtime for _, _, mtime in self._undated() if mtime >= EPOCH_S), default=None)

    def _age_undated(self, cutoff: float) -> int:
        """Delete the frames of the days before `EPOCH_DAY` whose times the clock was set right for
        and are before ``cutoff``. They go last for room, so the walk in `prune` never reaches them;
        it runs only once the earliest is due, and each emptied day is removed."""
        gone = [(day, image) for day, image, mtime in self._undated() if EPOCH_S <= mtime < cutoff]
        for day, image in gone:
            self._delete(day, image)
        for name in {day.name for day, _ in gone}:
            days = [self.root / dataset / name for dataset in sorted(self._datasets)]
            if not any(_images(day) for day in days):
                _remove_empty(days)
                self._days.remove(name)
                self._oldest = deque(entry for entry in self._oldest if entry[0].name != name)
        self._undated_due = self._earliest_undated()
        return len(gone)

    def _load_oldest(self, today: str) -> bool:
        """The first day to go's images of every dataset (`_ordered` as of ``today``), in name (=
        capture) order; an empty day is removed. False when it was."""
        self._days = _ordered(self._days, today)
        days = [self.root / dataset / self._days[0] for dataset in sorted(self._datasets)]
        images = sorted(
            ((day, p) for day in days for p in _images(day) if p.suffix in SAVED_SUFFIXES), key=lambda d: d[1].name
        )
        if images:
            self._oldest.extend(images)
            return True
        _remove_empty(days)
        self._days.popleft()
        return False

    def _delete(self, day: Path, image: Path) -> None:
        """One saved frame, image first, so that no image is ever left without its label."""
        for sub in SIDECAR_FOLDERS:
            path = image if sub == "images" else day / sub / f"{image.stem}{SUFFIXES[sub]}"
            size = _size(path)
            path.unlink(missing_ok=True)
            self.total_bytes = max(0, self.total_bytes - size)


_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "the file size limit is reached",
    errno.EROFS: "the filesystem is read-only (under systemd, a folder outside the state directory needs "
    "ReadWritePaths= in a drop-in)",
    errno.ENOENT: "the folder is missing (its parent must exist: a drive not mounted?)",
    errno.EACCES: "permission denied (the folder must be writable by the service user, edged)",
    errno.EPERM: "permission denied (the folder must be writable by the service user, edged)",
}


def describe(error: OSError) -> str:
    """An OSError as one actionable line."""
    reason = _REASONS.get(error.errno or 0, error.strerror or str(error))
    where = f" ({error.filename})" if error.filename else ""
    return f"{reason}{where}"


def folder_problem(root: Path, camera_id: str) -> str | None:
    """Why camera ``camera_id``'s evidence cannot be saved under ``root``, found by making its folders
    as a save would and creating and removing a file there (``edged check``); None when it can.

    The folders it made are removed again, so the check leaves nothing behind, but for one the service,
    starting meanwhile, has since made its own or saved in (`MadeFolders`). A folder in the service's
    state directory before its first start is tried with that directory made, as systemd will make it.
    """
    folder = root / camera_id
    unmade = root.parent in service_dirs("state") and not root.parent.exists()
    chain = (root.parent, root, folder) if unmade else (root, folder)
    with MadeFolders() as made:
        try:
            for at in chain:
                if not at.is_dir():
                    try:
                        made.mkdir(at)
                    except FileNotFoundError:
                        if at.parent.is_dir():  # /proc and /sys answer so: they hold no folders of ours
                            return f"{at} cannot be made in {at.parent}: that filesystem takes no files"
                        raise
            probe = folder / ".edged-check"
            write_atomic(probe, b"")
            probe.unlink()
        except OSError as e:
            return describe(e)
    return None


def same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are one file or folder on the disk (one is a link to the other, or the drive
    takes both names for one); False where either is not there or cannot be looked at."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def _listed(path: Path) -> bool:
    """Whether ``path`` is an entry of its folder by its own name, not found through another name the
    drive takes for it (`shared_with`); True where the folder cannot be listed."""
    try:
        return path.name in os.listdir(path.parent)
    except (OSError, ValueError):
        return True


def evidence_folders(settings: Settings) -> dict[str, Path]:
    """The evidence folder of each camera that saves evidence, by camera id."""
    return {
        cfg.camera_id: evidence.dir / cfg.camera_id
        for cfg in settings.source
        if (evidence := settings.evidence_for(cfg)) is not None
    }


def shared_with(camera_id: str, folder: Path, others: Mapping[str, Path]) -> str | None:
    """Why camera ``camera_id``'s evidence folder is also one of ``others`` (the other cameras' folders,
    by camera id): their files would mix, and each camera's retention would delete the other's frames
    as its own. None where it is its own, or where either is not there yet (compared again as it is made)."""
    for other, theirs in others.items():
        if not same_file(folder, theirs):
            continue
        if os.path.realpath(folder) == os.path.realpath(theirs):
            links = [path for path in (folder, theirs) if os.path.islink(path)]  # not a link above both (evidence.dir)
            if len(links) == 1:
                link, target = (folder, theirs) if links[0] == folder else (theirs, folder)
                why, fix = f"{link} is a link to {target}", f", or remove the link {link}"
            else:
                why, fix = f"both are links to {os.path.realpath(folder)}", ", or remove one of the links"
        elif not (_listed(folder) and _listed(theirs)):
            why = "the drive takes both names for one (FAT and exFAT ignore case, and a trailing dot)"
            fix = ", or point evidence.dir at a drive that tells case apart (ext4)"
        else:
            why, fix = "one is mounted on the other (a bind mount)", ""
        return (
            f"evidence.dir: {folder} and {theirs}, the evidence folders of cameras {camera_id} and {other}, "
            f"are one folder: {why}; their frames would mix and each camera's retention would delete the "
            f"other's: give one camera another camera_id{fix}"
        )
    return None


def _wall_less_boot_clock() -> float:
    """The wall clock less the clock since boot: constant but for a step (or NTP's slow slewing) of the
    wall clock. The boot clock counts a suspend, as the wall clock does; the monotonic one does not."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


class EvidenceWriter:
    """Decides on the loop which frames are evidence, and saves them on a background thread.

    `offer` runs per frame on the loop: `admit` decides, before any copy, from the policy, the room
    in the queue and the rate limit; only a frame it admits is copied and handed to `submit`.
    """

    def __init__(
        self,
        cfg: EvidenceConfig,
        camera_id: str,
        previous: EvidenceWriter | None = None,
        *,
        default_dir: bool = False,
        others: Mapping[str, Path] | None = None,
    ) -> None:
        """``previous``: the camera's writer that this one replaces on a reload; its counters carry on.
        ``default_dir``: ``cfg.dir`` is the default, not set: an error then says how to set it.
        ``others``: the other cameras' evidence folders (`EvidenceStore`)."""
        self.cfg = cfg
        self.camera_id = camera_id
        self._advice = f"; {DEFAULT_NOTE}" if default_dir else ""
        self.store = EvidenceStore(cfg.dir, camera_id, cfg.max_bytes, cfg.max_age_days, others)
        self._queue: queue.Queue[EvidenceFrame | None] = queue.Queue(QUEUE_FRAMES + 1)  # + the stop sentinel
        self._saves: deque[float] = deque(maxlen=max(cfg.max_per_minute, 1))  # times of the last saves
        self._thread = threading.Thread(target=self._run, name="evidence", daemon=True)
        self._stopping = threading.Event()
        self.saved = self.dropped = self.rate_limited = 0
        if previous is not None:
            self.saved, self.dropped, self.rate_limited = previous.saved, previous.dropped, previous.rate_limited
        self.failures: Failures = Failures(previous.failures if previous is not None else None)
        self._refusing: Literal["dropped", "rate_limited"] | None = None  # said once per burst of refusals
        self._fields = {"CAMERA": camera_id, "STAGE": "evidence"}  # journald fields of its log lines

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Finish the frames queued (at most `QUEUE_FRAMES`) and end the thread, waiting up to ``timeout_s``."""
        self._stopping.set()
        with contextlib.suppress(queue.Full):  # stopped before: its sentinel is still there
            self._queue.put_nowait(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "evidence: stopping while frames are still being written; what is left half written is removed "
                "at the next start",
                extra=self._fields,
            )

    def report(self) -> EvidenceReport:
        """The counters as the status message carries them."""
        return EvidenceReport(
            saved=self.saved,
            dropped=self.dropped,
            errors=self.failures.count,
            rate_limited=self.rate_limited,
            bytes=self.store.total_bytes,
            last_error=self.failures.last,
        )

    # ---- the loop's side ---------------------------------------------------------------------

    def offer(
        self,
        frame: Frame,
        result: TaskResult,
        verdict: Verdict | None,
        message: bytes | None,
        *,
        names: tuple[str, ...],
        task: Task,
        labelled: TaskResult | None = None,
        part_id: str | None = None,
        region: tuple[slice, slice] = (slice(None), slice(None)),
    ) -> Path | None:
        """Save ``frame`` if it is evidence and there is room and rate for it; only then is it copied.
        Returns where its image will be, None when it is not saved.

        ``result`` is what was published, with its near misses under ``ng+near``; the label saved
        and a classifier's class folder are the findings of ``labelled`` (default ``result``: the
        frame's findings before zones dropped some), never the near misses. ``message`` is the
        payload published for the frame, None when it was not published; ``names`` and ``task`` the
        model's, which pick its dataset folder (`EvidenceStore.dataset_for`); ``part_id`` the
        request's, which ends the file names; ``region`` the rows and columns of the frame the model
        saw (a classifier's ``inspect.roi``): the image saved, so a dataset made of it trains on what
        the model is shown.
        """
        if not self.admit(verdict, len(result), result.near_misses()):
            return None
        image = frame.image[region].copy()
        height, width = image.shape[:2]
        findings = labelled if labelled is not None else result
        label, class_id = findings.dataset_label(width, height), findings.dataset_class()
        image_class = None if class_id is None else class_folder(names[class_id])
        heatmap = result.heatmap()
        dataset = self.store.dataset_for(task, names)
        saved = EvidenceFrame(
            self.camera_id,
            frame.frame_id,
            frame.t_wall_ns,
            image,
            frame.channel_order,
            label,
            message,
            names,
            task,
            dataset,
            part_id,
            image_class,
            None if heatmap is None else heatmap.copy(),
        )
        self.submit(saved)
        day, stem = day_and_stem(self.camera_id, frame.t_wall_ns, frame.frame_id, part_id)
        images = self.store.root / dataset / day / "images"
        return (images if image_class is None else images / image_class) / f"{stem}{image_suffix(width, height)}"

    def admit(self, verdict: Verdict | None, found: int, near: int) -> bool:
        """Whether the caller should copy this frame (``found`` detections, ``near`` near misses) and
        `submit` it; a frame refused for room or rate is counted."""
        cfg = self.cfg
        if not should_save(cfg.save, verdict, found, near):
            return False
        if self._queue.qsize() >= QUEUE_FRAMES:
            self.dropped += 1
            if self._refusing != "dropped":
                self._refusing = "dropped"
                log.warning(
                    "evidence: the disk is behind the frames to save (%d queued): frames are dropped and counted",
                    QUEUE_FRAMES,
                    extra=self._fields,
                )
            return False
        now = time.monotonic()
        if cfg.max_per_minute and len(self._saves) == cfg.max_per_minute and now - self._saves[0] < RATE_WINDOW_S:
            self.rate_limited += 1
            if self._refusing != "rate_limited":
                self._refusing = "rate_limited"
                log.info(
                    "evidence.max_per_minute (%d) reached: frames are counted as rate limited, not saved",
                    cfg.max_per_minute,
                    extra=self._fields,
                )
            return False
        self._refusing = None
        if cfg.max_per_minute:
            self._saves.append(now)
        return True

    def submit(self, frame: EvidenceFrame) -> None:
        """Queue a frame `admit` let through; never blocks (there is room: the loop is the only producer)."""
        try:
            self._queue.put_nowait(frame)
        except queue.Full:
            self.dropped += 1

    # ---- the writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        self._attempt(self.store.open)
        while True:
            try:
                frame = self._queue.get(timeout=IDLE_WAKE_S)
            except queue.Empty:
                frame = None
            if frame is not None:
                if self._attempt(partial(self._save, frame)) and self.failures.succeeded():
                    log.info(
                        "evidence saved again in %s after %d error(s)",
                        self.store.folder,
                        self.failures.count,
                        extra=self._fields,
                    )
            elif self._stopping.is_set() and self._queue.empty():
                return
            else:
                self._attempt(self._prune)

    def _save(self, frame: EvidenceFrame) -> None:
        if not self.store.opened:
            self.store.open()
        self.store.follow_clock()
        self.store.save(frame, self.cfg.jpeg_quality)
        self.saved += 1
        self.store.prune(time.time())

    def _prune(self) -> None:
        if self.store.opened:
            self.store.follow_clock()
            self.store.prune(time.time())
        else:
            self.store.open()

    def _attempt(self, action: Callable[[], None]) -> bool:
        """Run ``action``; an error is counted, and logged only when a burst of them starts."""
        try:
            action()
        except (OSError, cv2.error) as e:
            if self.failures.failed(describe(e) if isinstance(e, OSError) else str(e)):
                log.error(
                    "evidence not saved in %s: %s%s; inference goes on, and further failures are counted as "
                    "evidence errors until a save succeeds",
                    self.store.folder,
                    self.failures.last,
                    self._advice,
                    extra=self._fields,
                )
            return False
        return True


class EvidenceOutput(Output):
    """Evidence as an output (`edged.output`): a writer per camera that `Settings.evidence_for` gives
    evidence settings, each in a folder of its own (`shared`)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.writers: dict[str, EvidenceWriter] = {}
        self._folders = evidence_folders(settings)
        for cfg in settings.source:
            self._start(cfg.camera_id)

    @classmethod
    def from_settings(cls, settings: Settings, services: Services) -> EvidenceOutput | None:
        return cls(settings) if any(settings.evidence_for(cfg) for cfg in settings.source) else None

    @staticmethod
    def shared(settings: Settings, made: MadeFolders | None = None) -> str | None:
        """Why two cameras' evidence would go to one folder (`shared_with`: a drive that ignores case, a
        link), found by making each camera's folder as its writer does and comparing them: for a start
        and a reload, which refuse it, and ``edged check``. The folders it made go in ``made``, for a
        check to remove, and a reload should it not take over. None where each has its own, or where one
        cannot be made (its writer says why, and compares it once it is made)."""
        folders = evidence_folders(settings)
        made = MadeFolders() if made is None else made
        for folder in folders.values():
            for at in (folder.parent, folder):
                with contextlib.suppress(OSError, ValueError):  # ValueError: a NUL in the path
                    if not at.is_dir():
                        made.mkdir(at)
        earlier: dict[str, Path] = {}
        for camera_id, folder in folders.items():
            if (problem := shared_with(camera_id, folder, earlier)) is not None:
                return problem
            earlier[camera_id] = folder
        return None

    def _start(self, camera_id: str, previous: EvidenceWriter | None = None) -> None:
        cfg = self.settings.camera(camera_id)
        evidence = self.settings.evidence_for(cfg) if cfg is not None else None
        if cfg is not None and evidence is not None:
            default = self.settings.evidence_dir_default(cfg)
            others = {other: folder for other, folder in self._folders.items() if other != camera_id}
            writer = EvidenceWriter(evidence, camera_id, previous, default_dir=default, others=others)
            self.writers[camera_id] = writer
            writer.start()

    def frame(self, report: FrameReport) -> None:
        writer = self.writers.get(report.camera_id)
        if writer is not None:
            done = report.outcome
            verdict = done.inspected.verdict if done.inspected else None
            model = done.plan.model
            part_id = report.message.part_id if report.message is not None else None
            image = writer.offer(
                done.frame,
                done.result,
                verdict,
                report.payload,
                names=model.class_names,
                task=model.task,
                labelled=done.labelled,
                part_id=part_id,
                region=done.plan.region,
            )
            if image is not None:
                report.saved["evidence"] = str(image)

    def report(self, camera_id: str) -> OutputReport:
        writer = self.writers.get(camera_id)
        return OutputReport(fields={"evidence": writer.report()}) if writer is not None else NO_REPORT

    def reload(self, settings: Settings, services: Services) -> EvidenceOutput | None:
        """A camera whose evidence settings stay keeps its writer; the others' writers stop, and start
        again with the new settings where there are any, their counters carried on."""
        old, self.settings, self._folders = self.settings, settings, evidence_folders(settings)
        replaced: dict[str, EvidenceWriter] = {}
        for camera_id, writer in list(self.writers.items()):
            before, after = old.camera(camera_id), settings.camera(camera_id)
            if after is not None and before is not None and old.evidence_for(before) == settings.evidence_for(after):
                continue
            writer.stop(timeout_s=STOP_WAIT_S)
            replaced[camera_id] = self.writers.pop(camera_id)
        for camera_id in settings.camera_ids():
            if camera_id not in self.writers:
                self._start(camera_id, replaced.get(camera_id))
        return self if self.writers else None

    def drain(self) -> None:
        for writer in self.writers.values():
            writer.stop(timeout_s=STOP_WAIT_S)

    def close(self) -> None:
        self.drain()
