"""A fake of libgpiod's v2 Python binding (``gpiod`` 2.x), for tests at the import boundary.

It mirrors the parts of gpiod 2.5 edged uses, as the real binding behaves:

- ``Chip(path)`` on a path that is not there raises FileNotFoundError (ENOENT), on a file that is
  no GPIO chip OSError (ENOTTY); ``get_info()`` gives ``ChipInfo(name, label, num_lines)``;
- ``line_offset_from_id`` returns an int offset as it is unless out of range (ValueError "line
  offset of out range"), and looks a name up, raising OSError ENOENT for an unknown one;
- ``get_line_info(line)`` gives a ``LineInfo`` with ``name``, ``used`` and ``consumer`` (another
  process's request's too, with a record file);
- ``request_lines(config, consumer, output_values)`` requests the lines as configured; a line
  another process holds raises OSError EBUSY; the request's ``set_value``/``get_value`` take an
  offset or a name and a ``Value``; ``release`` frees the lines, after which use raises
  ``RequestReleasedError``; the physical level follows ``active_low``;
- ``gpiod.request_lines(path, ...)`` opens the chip, requests and closes it.

The chips are ``CHIPS`` (path -> `FakeChip`), which a test fills; a daemon started as a
subprocess reads them from the JSON file named by ``$FAKE_GPIOD`` (``{"chips": {path: {"label",
"lines", "held"}}, "record": file, "stall": file}``; while the stall file exists, a request waits).
Every level a requested line takes is recorded, as ``RECORD`` entries and, with a record file, as
lines ``monotonic_ns path offset level`` (level 1/0 physical, ``released`` when the request lets
go), written and flushed at once. With a record
file a line has one holder across the processes, as the kernel keeps it: a request claims a file
per line beside the record, naming its process and consumer, and a line another live process holds raises
EBUSY (a holder that died, SIGKILL included, holds nothing).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta

from . import exception, line
from . import line as _l  # the real package exports its enums from gpiod.line only
from .exception import ChipClosedError, RequestReleasedError

__version__ = "2.5.0"
api_version = "2.2.0"

__all__ = [
    "CHIPS",
    "RECORD",
    "Chip",
    "ChipClosedError",
    "ChipInfo",
    "FakeChip",
    "LineInfo",
    "LineRequest",
    "LineSettings",
    "RequestReleasedError",
    "exception",
    "is_gpiochip_device",
    "line",
    "request_lines",
]


@dataclass
class FakeChip:
    """One chip: its label, its lines' names (their count is the chip's), lines held by another process
    (offset -> its consumer), and the requests of this process (offset -> request)."""

    label: str
    lines: list[str]
    held: dict[int, str] = field(default_factory=dict)
    requested: dict[int, tuple[LineRequest, str]] = field(default_factory=dict)


CHIPS: dict[str, FakeChip] = {}
RECORD: list[tuple[int, str, int, int | None]] = []  # (monotonic ns, chip path, offset, physical level or None: released)
RECORD_FILE: str | None = None  # where every process using this fake appends the levels, from $FAKE_GPIOD
STALL_FILE: str | None = None  # while this file exists, a request waits: a chip slow to answer (an expander on I2C)
_lock = threading.Lock()


def _load() -> None:
    global RECORD_FILE, STALL_FILE
    spec_path = os.environ.get("FAKE_GPIOD")
    if not spec_path:
        return
    with open(spec_path) as f:
        spec = json.load(f)
    for path, chip in spec.get("chips", {}).items():
        held = {int(k): v for k, v in chip.get("held", {}).items()}
        CHIPS[path] = FakeChip(chip.get("label", ""), list(chip["lines"]), held)
    RECORD_FILE = spec.get("record")
    STALL_FILE = spec.get("stall")


def _hold_file(path: str, offset: int) -> str | None:
    return f"{RECORD_FILE}.held-{path.replace('/', '_')}-{offset}" if RECORD_FILE is not None else None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _holder(hold: str) -> tuple[int, str] | None:
    """The PID and consumer name a claim names; None where it is let go of (or being written)."""
    try:
        with open(hold) as f:
            pid, _, consumer = f.read().partition(" ")
        return int(pid), consumer
    except (OSError, ValueError):
        return None


def _claim(path: str, offsets: Iterable[int], consumer: str) -> None:
    """Hold ``offsets`` for this process in the name ``consumer``, across the processes sharing the
    record; EBUSY where another live one does."""
    claimed: list[int] = []
    for offset in offsets:
        hold = _hold_file(path, offset)
        if hold is None:
            return
        mine = f"{hold}.{os.getpid()}"
        with open(mine, "w") as f:
            f.write(f"{os.getpid()} {consumer}")
        try:
            while True:
                try:
                    os.link(mine, hold)  # the claim appears whole, naming its holder
                    break
                except FileExistsError:
                    claim = _holder(hold)
                    if claim is None:
                        continue  # let go of meanwhile
                    holder = claim[0]
                    if holder == os.getpid() or _alive(holder):
                        _let_go(path, claimed)
                        raise OSError(errno.EBUSY, "Device or resource busy") from None
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(hold)  # its holder is gone
        finally:
            os.unlink(mine)
        claimed.append(offset)


def _let_go(path: str, offsets: Iterable[int]) -> None:
    for offset in offsets:
        hold = _hold_file(path, offset)
        if hold is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(hold)


def _record(path: str, offset: int, level: int | None) -> None:
    t = time.monotonic_ns()
    with _lock:
        RECORD.append((t, path, offset, level))
        if RECORD_FILE is not None:  # one append per level, so that the processes' lines never mix
            with open(RECORD_FILE, "a") as f:
                f.write(f"{t} {path} {offset} {'released' if level is None else level}\n")


@dataclass(frozen=True, repr=False)
class ChipInfo:
    name: str
    label: str
    num_lines: int


@dataclass(frozen=True, repr=False)
class LineInfo:
    offset: int
    name: str
    used: bool
    consumer: str
    direction: _l.Direction
    active_low: bool


@dataclass(repr=False)
class LineSettings:
    direction: _l.Direction = _l.Direction.AS_IS
    edge_detection: _l.Edge = _l.Edge.NONE
    bias: _l.Bias = _l.Bias.AS_IS
    drive: _l.Drive = _l.Drive.PUSH_PULL
    active_low: bool = False
    debounce_period: timedelta = timedelta()
    event_clock: _l.Clock = _l.Clock.MONOTONIC
    output_value: _l.Value = _l.Value.INACTIVE


def is_gpiochip_device(path: str) -> bool:
    return path in CHIPS


class Chip:
    def __init__(self, path: str) -> None:
        if path not in CHIPS:
            if not os.path.exists(path):
                raise FileNotFoundError(errno.ENOENT, "No such file or directory")
            raise OSError(errno.ENOTTY, "Inappropriate ioctl for device")
        self._path: str | None = path

    def __bool__(self) -> bool:
        return self._path is not None

    def __enter__(self) -> Chip:
        self._check_closed()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_closed(self) -> FakeChip:
        if self._path is None:
            raise ChipClosedError()
        return CHIPS[self._path]

    def close(self) -> None:
        self._path = None

    @property
    def path(self) -> str:
        self._check_closed()
        assert self._path is not None
        return self._path

    def get_info(self) -> ChipInfo:
        chip = self._check_closed()
        return ChipInfo(os.path.basename(self.path), chip.label, len(chip.lines))

    def line_offset_from_id(self, id: str | int) -> int:
        chip = self._check_closed()
        if not isinstance(id, int):
            if id in chip.lines:
                return chip.lines.index(id)
            try:
                offset = int(id)
            except ValueError:
                raise OSError(errno.ENOENT, "No such file or directory") from None
        else:
            offset = id
        if offset >= len(chip.lines):
            raise ValueError("line offset of out range")
        return offset

    def get_line_info(self, line: int | str) -> LineInfo:
        chip = self._check_closed()
        offset = self.line_offset_from_id(line)
        with _lock:
            own = chip.requested.get(offset)
        hold = _hold_file(self.path, offset)
        other = _holder(hold) if own is None and hold is not None else None
        if other is not None and not _alive(other[0]):
            other = None  # a holder that died holds nothing
        consumer = own[1] if own else other[1] if other else chip.held.get(offset, "")
        used = own is not None or other is not None or offset in chip.held
        direction = _l.Direction.OUTPUT if own else _l.Direction.INPUT
        return LineInfo(offset, chip.lines[offset], used, consumer, direction, False)

    def request_lines(
        self,
        config: dict[Iterable[int | str] | int | str, LineSettings | None],
        consumer: str | None = None,
        event_buffer_size: int | None = None,
        output_values: dict[int | str, _l.Value] | None = None,
    ) -> LineRequest:
        chip = self._check_closed()
        while STALL_FILE is not None and os.path.exists(STALL_FILE):
            time.sleep(0.01)
        wanted: dict[int, LineSettings] = {}
        for lines, settings in config.items():
            for one in (lines,) if isinstance(lines, (int, str)) else lines:
                offset = self.line_offset_from_id(one) if isinstance(one, str) else one
                if offset >= len(chip.lines):
                    raise OSError(errno.EINVAL, "Invalid argument")
                wanted[offset] = settings or LineSettings()
        for offset, value in (output_values or {}).items():
            wanted[self.line_offset_from_id(offset)].output_value = value
        with _lock:
            if any(offset in chip.held or offset in chip.requested for offset in wanted):
                raise OSError(errno.EBUSY, "Device or resource busy")
        _claim(self.path, wanted, consumer or "?")
        request = LineRequest(self.path, wanted, {chip.lines[o]: o for o in wanted if chip.lines[o]})
        with _lock:
            for offset in wanted:
                chip.requested[offset] = (request, consumer or "?")
        for offset, settings in wanted.items():
            if settings.direction is _l.Direction.OUTPUT:
                request._drive(offset, settings.output_value)
        return request

    def fileno(self) -> int:
        raise NotImplementedError


class LineRequest:
    def __init__(self, path: str, settings: dict[int, LineSettings], names: dict[str, int]) -> None:
        self._path: str | None = path
        self._settings = settings
        self._name_map = names
        self._values = {offset: _l.Value.INACTIVE for offset in settings}

    def __bool__(self) -> bool:
        return self._path is not None

    def __enter__(self) -> LineRequest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _check_released(self) -> str:
        if self._path is None:
            raise RequestReleasedError()
        return self._path

    def _line_to_offset(self, line: int | str) -> int:
        if isinstance(line, int):
            return line
        if (offset := self._name_map.get(line)) is None:
            raise ValueError(f"unknown line name: {line}")
        return offset

    def _drive(self, offset: int, value: _l.Value) -> None:
        path = self._check_released()
        self._values[offset] = value
        _record(path, offset, int(bool(value)) ^ int(self._settings[offset].active_low))

    def release(self) -> None:
        path = self._check_released()
        chip = CHIPS[path]
        with _lock:
            for offset in self._settings:
                chip.requested.pop(offset, None)
        for offset in self._settings:
            _record(path, offset, None)
        _let_go(path, self._settings)
        self._path = None

    @property
    def offsets(self) -> list[int]:
        self._check_released()
        return list(self._settings)

    def get_value(self, line: int | str) -> _l.Value:
        self._check_released()
        return self._values[self._line_to_offset(line)]

    def get_values(self, lines: Iterable[int | str] | None = None) -> list[_l.Value]:
        self._check_released()
        return [self._values[self._line_to_offset(one)] for one in (lines or self._settings)]

    def set_value(self, line: int | str, value: _l.Value) -> None:
        self.set_values({line: value})

    def set_values(self, values: dict[int | str, _l.Value]) -> None:
        self._check_released()
        for one, value in values.items():
            offset = self._line_to_offset(one)
            if offset not in self._settings:
                raise ValueError(f"line {one} not requested")
            self._drive(offset, value)


def request_lines(
    path: str,
    config: dict[Iterable[int | str] | int | str, LineSettings | None],
    consumer: str | None = None,
    event_buffer_size: int | None = None,
    output_values: dict[int | str, _l.Value] | None = None,
) -> LineRequest:
    with Chip(path) as chip:
        return chip.request_lines(config, consumer, event_buffer_size, output_values)


_load()
