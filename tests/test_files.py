"""Reading a file that may be a pipe, a device or too large, without waiting or reading without end;
writing a command's output whole or not at all, and never over one of its inputs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from edged.errors import OutputFileError, UsageError
from edged.files import (
    FileTooLarge,
    MadeFolders,
    NotRegularFile,
    read_regular,
    refuse_overwriting,
    write_whole,
    write_with,
)

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


def test_a_write_that_fails_leaves_the_old_file_and_nothing_beside_it(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    out.write_text("the old report")

    def half(path: Path) -> None:
        path.write_text("half of the new")
        raise OSError(28, "No space left on device")

    with pytest.raises(OutputFileError, match=r"cannot write .*report\.json: No space left on device"):
        write_with(out, half)
    assert out.read_text() == "the old report" and [p.name for p in tmp_path.iterdir()] == ["report.json"]
    write_whole(out, "the new report")
    assert out.read_text() == "the new report" and [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_a_write_into_a_folder_that_takes_no_file_is_an_output_error(tmp_path: Path) -> None:
    with pytest.raises(OutputFileError, match="cannot write"):
        write_whole(tmp_path / "missing" / "report.json", "{}")
    os.mkfifo(tmp_path / "pipe")
    for device in (Path("/dev/full"), tmp_path / "pipe"):  # moved over, the device or pipe would be replaced
        with pytest.raises(OutputFileError, match="not a regular file"):
            write_whole(device, "{}")
    assert Path("/dev/full").is_char_device() and (tmp_path / "pipe").is_fifo()


def test_an_output_that_is_an_input_or_another_output_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "signing.pem"
    key.write_text("secret")
    os.link(key, tmp_path / "hard.pem")
    os.symlink(key, tmp_path / "soft.pem")
    for out in (key, tmp_path / "hard.pem", tmp_path / "soft.pem", tmp_path / "." / "signing.pem"):
        with pytest.raises(UsageError, match=f"--out {out} is the file of --key: writing it would destroy it"):
            refuse_overwriting({"--out": out}, {"--key": key, "--labels": None})
    with pytest.raises(UsageError, match=r"--report .* is the file of --out"):
        refuse_overwriting({"--out": tmp_path / "new", "--report": tmp_path / "new"}, {})
    refuse_overwriting({"--out": tmp_path / "new", "--report": None}, {"--key": key, "--missing": tmp_path / "gone"})


def test_the_folders_a_try_made_are_removed_but_those_taken_since(tmp_path: Path) -> None:
    """A folder the service made its own (systemd gave it to its user) or saved in while ``sudo edged
    check`` ran is the service's: removing it broke the service."""
    with MadeFolders() as made:
        made.parents(tmp_path / "a" / "b", mode=0o750)
        for name in ("kept", "taken", "empty"):
            made.mkdir(tmp_path / "a" / name)
        with pytest.raises(FileExistsError):
            made.parents(tmp_path / "a" / "b")
        (tmp_path / "a" / "kept" / "frame.jpg").write_bytes(b"")  # saved in meanwhile
        if os.geteuid() == 0:
            os.chown(tmp_path / "a" / "taken", 65534, 65534)  # given to the service's user meanwhile
        assert (tmp_path / "a" / "b").stat().st_mode & 0o777 == 0o750
    left = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert left == (["kept", "taken"] if os.geteuid() == 0 else ["kept"])
    assert (tmp_path / "a" / "taken").stat().st_uid == 65534 or os.geteuid() != 0


def test_folders_made_until_exit_go_at_the_exit_unless_kept(tmp_path: Path) -> None:
    """A reload still loading when edged stops is never tried: the folders it made went nowhere. One that
    took over keeps its own, even empty."""
    made = """
import sys
from pathlib import Path
from edged.files import MadeFolders
loading, took_over = MadeFolders(until_exit=True), MadeFolders(until_exit=True)
loading.mkdir(Path(sys.argv[1]) / "loading")
took_over.mkdir(Path(sys.argv[1]) / "took-over")
took_over.keep()
"""
    subprocess.run([sys.executable, "-c", made, str(tmp_path)], check=True)
    assert [p.name for p in tmp_path.iterdir()] == ["took-over"]
