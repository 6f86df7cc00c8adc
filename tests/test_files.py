"""Reading a file that may be a pipe, a device or too large, without waiting or reading without end."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edged.files import FileTooLarge, NotRegularFile, read_regular

pytestmark = pytest.mark.unit


def test_a_regular_file_within_the_bound_is_read_whole(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"12345")
    assert read_regular(tmp_path / "f", 5) == b"12345"


def test_a_pipe_a_device_and_a_folder_are_refused_without_waiting(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")  # no writer: a blocking open would wait for ever
    os.symlink("/dev/zero", tmp_path / "zero")
    for path in (tmp_path / "pipe", tmp_path / "zero", tmp_path):
        with pytest.raises(NotRegularFile, match="is not a regular file"):
            read_regular(path, 1 << 20)


def test_a_file_over_the_bound_is_refused_with_its_size(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"123456")
    with pytest.raises(FileTooLarge) as refused:
        read_regular(tmp_path / "f", 5)
    assert refused.value.size == 6


def test_a_missing_file_is_an_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "missing", 5)
