"""edged's memory against its cgroup's limit: cgroup v2 and v1 trees built under tmp_path, this machine's
own, and a real daemon that sees a cgroup tree of its own in a mount namespace."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from daemon import RunningDaemon, free_port, write_config, write_video
from onnx_models import colour_probe
from waiting import wait_for

from edged.memory import CGROUP_MOUNT, PROC_SELF_CGROUP, MemoryWatch, locate
from edged.messages import MemoryReadings

MIB = 2**20
UNIT = "/system.slice/edged.service"
V1_UNLIMITED = "9223372036854771712"  # what v1 says without a limit (2**63 less a 4 KiB page)


def v2_tree(
    tmp_path: Path, *, limit: str = str(100 * MIB), current: int = 50 * MIB, inactive: int = 0, kills: int = 0
) -> tuple[Path, Path]:
    """A systemd service's cgroup v2 files, and the /proc/self/cgroup that names it."""
    proc = tmp_path / "cgroup"
    proc.write_text(f"0::{UNIT}\n")
    mount = tmp_path / "sys-fs-cgroup"
    folder = mount / UNIT.lstrip("/")
    folder.mkdir(parents=True)
    set_v2(folder, limit=limit, current=current, inactive=inactive, kills=kills)
    return proc, mount


def set_v2(folder: Path, *, limit: str, current: int, inactive: int = 0, kills: int = 0) -> None:
    (folder / "memory.max").write_text(f"{limit}\n")
    (folder / "memory.current").write_text(f"{current}\n")
    (folder / "memory.stat").write_text(f"anon {current - inactive}\nfile {inactive}\ninactive_file {inactive}\n")
    (folder / "memory.events").write_text(f"low 0\nhigh 0\nmax 3\noom {kills}\noom_kill {kills}\noom_group_kill 0\n")


def v1_tree(tmp_path: Path, *, limit: str, usage: int, inactive: int = 0) -> tuple[Path, Path]:
    """A hybrid host's files: the memory controller on v1, an empty unified hierarchy beside it."""
    proc = tmp_path / "cgroup"
    proc.write_text(f"12:pids:{UNIT}\n4:memory:{UNIT}\n1:name=systemd:{UNIT}\n0::{UNIT}\n")
    mount = tmp_path / "sys-fs-cgroup"
    (mount / "unified" / UNIT.lstrip("/")).mkdir(parents=True)
    folder = mount / "memory" / UNIT.lstrip("/")
    folder.mkdir(parents=True)
    (folder / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (folder / "memory.usage_in_bytes").write_text(f"{usage}\n")
    # inactive_file is this cgroup's alone; total_inactive_file counts those below it too, as usage does.
    (folder / "memory.stat").write_text(
        f"cache 1\ninactive_file 1\ntotal_cache {inactive}\ntotal_inactive_file {inactive}\n"
    )
    (folder / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    return proc, mount


def said(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "edged.memory"]


def test_cgroup_v2_limit_and_use_less_the_inactive_page_cache(tmp_path: Path) -> None:
    proc, mount = v2_tree(tmp_path, current=60 * MIB, inactive=20 * MIB, kills=0)
    watch = MemoryWatch(locate(proc, mount))
    assert watch.read() == MemoryReadings(limit_bytes=100 * MIB, used_bytes=40 * MIB, cgroup_bytes=60 * MIB, oom_kills=0)


def test_cgroup_v1_memory_controller_on_a_hybrid_host(tmp_path: Path) -> None:
    proc, mount = v1_tree(tmp_path, limit=str(512 * MIB), usage=300 * MIB, inactive=100 * MIB)
    files = locate(proc, mount)
    assert files and files[0].limit == mount / "memory" / UNIT.lstrip("/") / "memory.limit_in_bytes"
    assert MemoryWatch(files).read() == MemoryReadings(
        limit_bytes=512 * MIB, used_bytes=200 * MIB, cgroup_bytes=300 * MIB, oom_kills=2
    )


def test_a_container_s_own_cgroup_at_the_mount_s_root(tmp_path: Path) -> None:
    # Without a cgroup namespace, /proc/self/cgroup names the host's path, which the container's mount lacks;
    # inside one, a process outside its root reads /.. paths: both are looked for at the mount's root.
    for path in ("/docker/0123abcd", "/../../system.slice/other.service"):
        proc = tmp_path / "cgroup"
        proc.write_text(f"0::{path}\n")
        mount = tmp_path / "container"
        mount.mkdir(exist_ok=True)
        set_v2(mount, limit=str(64 * MIB), current=8 * MIB)
        readings = MemoryWatch(locate(proc, mount)).read()
        assert readings is not None and readings.limit_bytes == 64 * MIB, path


@pytest.mark.parametrize(
    "case",
    [
        "v2 max",  # MemoryMax= not set
        "v1 unlimited",
        "no /proc/self/cgroup",
        "no memory controller",  # a v1 host with the memory controller disabled
        "no memory files",  # v2 without the memory controller enabled for the service
        "limit garbage",
        "use below zero",
    ],
)
def test_without_a_limit_or_a_cgroup_to_read_nothing_is_said(
    tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    if case == "v1 unlimited":
        proc, mount = v1_tree(tmp_path, limit=V1_UNLIMITED, usage=300 * MIB)
    else:
        proc, mount = v2_tree(tmp_path, limit="max" if case == "v2 max" else str(100 * MIB), current=99 * MIB)
    folder = mount / UNIT.lstrip("/")
    if case == "no /proc/self/cgroup":
        proc.unlink()
    elif case == "no memory controller":
        proc.write_text(f"4:cpu,cpuacct:{UNIT}\n1:name=systemd:{UNIT}\n")
    elif case == "no memory files":
        (folder / "memory.max").unlink()
    elif case == "limit garbage":
        (folder / "memory.max").write_text("a lot\n")
    elif case == "use below zero":
        (folder / "memory.current").write_text("-1\n")
    watch = MemoryWatch(locate(proc, mount))
    assert [watch.read() for _ in range(3)] == [None] * 3
    assert said(caplog) == []


def test_nearing_the_limit_is_one_warning_and_back_under_80_percent_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="edged.memory")
    proc, mount = v2_tree(tmp_path, current=50 * MIB)
    folder = mount / UNIT.lstrip("/")
    watch = MemoryWatch(locate(proc, mount))
    for mib in (50, 89):
        set_v2(folder, limit=str(100 * MIB), current=mib * MIB)
        watch.read()
    assert said(caplog) == []
    for mib in (95, 97, 85, 80):  # over 90 %: said once; down to 80 %, still near it
        set_v2(folder, limit=str(100 * MIB), current=mib * MIB)
        watch.read()
    ((level, warning),) = said(caplog)
    assert level == logging.WARNING
    for words in ("95 MiB", "95 %", "100 MiB", str(folder / "memory.max"), "MemoryMax=", "smaller model", "fewer cameras"):
        assert words in warning, words
    assert "evidence" in warning and "raise MemoryMax=" in warning
    caplog.clear()
    for mib in (79, 70, 89):  # under 80 %: said once, and back near the limit, not yet again
        set_v2(folder, limit=str(100 * MIB), current=mib * MIB)
        watch.read()
    assert said(caplog) == [(logging.INFO, "memory use back to 79 MiB, 79 % of the 100 MiB limit")]
    caplog.clear()
    set_v2(folder, limit=str(100 * MIB), current=91 * MIB)
    watch.read()
    assert [level for level, _ in said(caplog)] == [logging.WARNING]


def test_a_limit_set_on_a_running_edged_counts_from_the_next_round(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # systemctl set-property edged MemoryMax=100M on a unit started without one.
    proc, mount = v2_tree(tmp_path, limit="max", current=95 * MIB)
    watch = MemoryWatch(locate(proc, mount))
    assert watch.read() is None
    set_v2(mount / UNIT.lstrip("/"), limit=str(100 * MIB), current=95 * MIB)
    readings = watch.read()
    assert readings is not None and readings.limit_bytes == 100 * MIB
    assert [level for level, _ in said(caplog)] == [logging.WARNING]


def test_page_cache_the_kernel_would_drop_does_not_warn(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Evidence written: memory.current near the limit, most of it inactive file pages.
    proc, mount = v2_tree(tmp_path, current=99 * MIB, inactive=60 * MIB)
    readings = MemoryWatch(locate(proc, mount)).read()
    assert readings is not None and (readings.used_bytes, readings.cgroup_bytes) == (39 * MIB, 99 * MIB)
    assert said(caplog) == []


def test_a_file_that_fails_is_not_read_again_and_nothing_is_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    proc, mount = v2_tree(tmp_path, current=50 * MIB, inactive=10 * MIB)
    folder = mount / UNIT.lstrip("/")
    watch = MemoryWatch(locate(proc, mount))
    (folder / "memory.stat").unlink()
    (folder / "memory.events").write_text("oom 0\noom_kill -1\n")  # a count that is none
    assert watch.read() == MemoryReadings(limit_bytes=100 * MIB, used_bytes=50 * MIB, cgroup_bytes=50 * MIB, oom_kills=None)
    set_v2(folder, limit=str(100 * MIB), current=50 * MIB, inactive=10 * MIB, kills=1)  # both back: left alone
    assert watch.read() == MemoryReadings(limit_bytes=100 * MIB, used_bytes=50 * MIB, cgroup_bytes=50 * MIB, oom_kills=None)
    (folder / "memory.current").unlink()
    assert watch.read() is None
    set_v2(folder, limit=str(100 * MIB), current=99 * MIB)  # the use is never read again: no warning either
    assert watch.read() is None
    assert said(caplog) == []


def test_each_rise_of_the_oom_kill_count_is_said_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    proc, mount = v2_tree(tmp_path, current=50 * MIB)
    folder = mount / UNIT.lstrip("/")
    watch = MemoryWatch(locate(proc, mount))
    for kills in (0, 0, 1, 1, 1, 3):
        set_v2(folder, limit=str(100 * MIB), current=50 * MIB, kills=kills)
        readings = watch.read()
        assert readings is not None and readings.oom_kills == kills
    warnings = [message for level, message in said(caplog) if level == logging.WARNING]
    assert len(warnings) == 2 and "ended 1 process(es)" in warnings[0] and "ended 2 process(es)" in warnings[1]
    assert "OOM killer" in warnings[1] and "(3 since the cgroup was made)" in warnings[1]


def test_this_machine_s_own_cgroup_reads_without_error() -> None:
    # Whatever this machine has (v1, v2, hybrid, a container, no limit), reading it raises nothing.
    watch = MemoryWatch(locate(PROC_SELF_CGROUP, CGROUP_MOUNT))
    for _ in range(2):
        readings = watch.read()
        assert readings is None or (0 < readings.limit_bytes and readings.used_bytes <= readings.cgroup_bytes)


def test_the_daemon_says_its_cgroup_s_memory_in_the_status_and_warns_once_near_the_limit(tmp_path: Path) -> None:
    # A real daemon in a mount namespace of its own whose /sys/fs/cgroup is a tree of ours: at 95 % of the
    # limit it warns once while status rounds go by, and says it once when use is back under 80 %.
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a cgroup tree of its own needs root and unshare (mount namespaces)")
    mount = tmp_path / "sys-fs-cgroup"
    mount.mkdir()
    set_v2(mount, limit=str(100 * MIB), current=95 * MIB)  # found at the mount's root, whatever our cgroup's path
    script = 'mount --bind "$1" /sys/fs/cgroup && shift && exec "$@"'
    probe = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(mount), "true"]
    if subprocess.run(probe, capture_output=True, timeout=30).returncode != 0:
        pytest.skip("cannot bind-mount over /sys/fs/cgroup in a mount namespace here")
    colour_probe(tmp_path / "probe.onnx")
    write_video(tmp_path / "clip.avi", [(0, 0, 255)] * 10)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "file", "path": "clip.avi", "loop": True, "realtime": True},
            "model": {"path": "probe.onnx"},
            "publish": {"endpoints": [endpoint], "status_interval_s": 0.1},
            "thermal": {"enabled": False},
        },
    )
    d = RunningDaemon(config, endpoint, wrap=lambda argv: probe[:-1] + argv)
    try:
        status = d.wait_status(lambda s: s.memory is not None)
        assert status.memory == MemoryReadings(
            limit_bytes=100 * MIB, used_bytes=95 * MIB, cgroup_bytes=95 * MIB, oom_kills=0
        )
        d.collect("status", 3)  # more rounds near the limit
        set_v2(mount, limit=str(100 * MIB), current=60 * MIB)
        d.wait_status(lambda s: s.memory is not None and s.memory.used_bytes == 60 * MIB)
        assert wait_for(lambda: "memory use back to 60 MiB" in d.log())
        log = d.log()
        assert log.count("of the 100 MiB limit /sys/fs/cgroup/memory.max sets") == 1, log
        assert d.stop() == 0
    finally:
        d.close()


def test_a_limit_set_above_edged_on_its_slice_or_container_is_the_one_watched(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # MemoryMax= on the slice several edged@ instances share, the unit's own unset: the kernel ends edged at the
    # slice's limit, counted on the slice's use. A looser limit of the unit's own does not hide it.
    proc, mount = v2_tree(tmp_path, limit="max", current=40 * MIB)
    slice_folder = mount / "system.slice"
    set_v2(slice_folder, limit=str(100 * MIB), current=95 * MIB, inactive=0, kills=2)
    watch = MemoryWatch(locate(proc, mount))
    assert watch.read() == MemoryReadings(limit_bytes=100 * MIB, used_bytes=95 * MIB, cgroup_bytes=95 * MIB, oom_kills=2)
    ((_, warning), (_, killed)) = said(caplog)
    assert f"100 MiB limit {slice_folder / 'memory.max'} sets" in warning, warning
    assert "ended 2 process(es)" in killed
    set_v2(mount / UNIT.lstrip("/"), limit=str(200 * MIB), current=40 * MIB)
    readings = watch.read()
    assert readings is not None and readings.limit_bytes == 100 * MIB
