"""Inference threads that fit the process's CPUs: sysfs topology faked as a directory tree,
affinity and cpusets real, with a real ONNX Runtime session in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from onnx_models import colour_probe

from edged.cpus import allowed_cpus, format_cpus, parse_cpus, physical_cores, plan_threads

pytestmark = pytest.mark.integration


def sysfs(root: Path, online: str, siblings: dict[int, str]) -> Path:
    """A /sys/devices/system/cpu tree: the online list and each CPU's SMT siblings."""
    (root / "online").parent.mkdir(parents=True, exist_ok=True)
    (root / "online").write_text(online + "\n")
    for cpu, listed in siblings.items():
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(listed + "\n")
    return root


@pytest.fixture
def smt(tmp_path: Path) -> Path:
    """Two cores with two hardware threads each, numbered as x86 does: 0 and 2 share a core."""
    return sysfs(tmp_path / "smt", "0-3", {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})


@pytest.fixture
def arm(tmp_path: Path) -> Path:
    """A Raspberry Pi: four cores, no SMT."""
    return sysfs(tmp_path / "arm", "0-3", {cpu: str(cpu) for cpu in range(4)})


@pytest.mark.parametrize(("text", "cpus"), [("0", {0}), ("0-3", {0, 1, 2, 3}), ("0-1,4,6-7\n", {0, 1, 4, 6, 7})])
def test_cpu_lists_parse_and_format_as_the_kernel_writes_them(text: str, cpus: set[int]) -> None:
    assert parse_cpus(text) == cpus
    assert format_cpus(cpus) == text.strip()


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "0-"])
def test_a_garbled_cpu_list_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpus(text)


def test_smt_siblings_count_as_one_core(smt: Path, arm: Path) -> None:
    assert physical_cores({0, 1, 2, 3}, smt) == 2
    assert physical_cores({0, 2}, smt) == 1
    assert physical_cores({0, 1}, smt) == 2
    assert physical_cores({1, 2, 3}, arm) == 3


def test_a_cpu_without_topology_counts_as_its_own_core(tmp_path: Path) -> None:
    assert physical_cores({0, 1, 5}, sysfs(tmp_path / "bare", "0-7", {})) == 3


def test_an_unrestricted_process_keeps_onnxruntimes_default(smt: Path) -> None:
    plan = plan_threads(0, frozenset({0, 1, 2, 3}), smt)
    assert plan.intra_op_threads == 0 and plan.warning is None
    assert "default" in plan.summary and "0-3" in plan.summary


@pytest.mark.parametrize(("cpus", "threads"), [({0, 1, 2}, 2), ({1, 3}, 1), ({0}, 1)])
def test_a_restricted_process_gets_one_thread_per_physical_core_of_its_cpus(smt: Path, cpus: set[int], threads: int) -> None:
    plan = plan_threads(0, frozenset(cpus), smt)
    assert plan.intra_op_threads == threads and plan.warning is None
    assert f"({format_cpus(cpus)} of 0-3)" in plan.summary


def test_a_board_shared_by_two_instances(arm: Path) -> None:
    assert plan_threads(0, frozenset({0, 1}), arm).intra_op_threads == 2
    assert plan_threads(0, frozenset({2, 3}), arm).intra_op_threads == 2


def test_a_configured_count_is_kept_and_warned_about_only_beyond_the_cpus(arm: Path) -> None:
    fits = plan_threads(2, frozenset({2, 3}), arm)
    assert fits.intra_op_threads == 2 and fits.warning is None
    crowded = plan_threads(4, frozenset({2, 3}), arm)
    assert crowded.intra_op_threads == 4
    assert crowded.warning is not None
    assert "intra_op_threads = 4" in crowded.warning and "2 CPU(s) (2-3 of 0-3)" in crowded.warning


def test_without_an_online_list_the_process_cpus_are_taken_as_all(tmp_path: Path) -> None:
    assert plan_threads(0, frozenset({0, 1}), tmp_path / "missing").intra_op_threads == 0


def test_this_process_cpus_are_its_affinity() -> None:
    assert allowed_cpus() == frozenset(os.sched_getaffinity(0))


# ---- the real thing: ONNX Runtime's threads inside a child process's CPUs ---------------------

CHILD = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    if sys.argv[2].isdigit():  # before any import starts a thread
        os.sched_setaffinity(0, {int(sys.argv[2])})
    else:
        Path(sys.argv[2], "cgroup.procs").write_text(str(os.getpid()))
    import numpy as np
    from edged.config import RuntimeConfig
    from edged.engine import Engine
    engine = Engine(Path(sys.argv[1]), RuntimeConfig())
    engine.bind(np.zeros((1, 3, 64, 64), np.float32)).run()
    allowed = {}
    for task in os.listdir("/proc/self/task"):
        for line in Path(f"/proc/self/task/{task}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                allowed[task] = line.split(":", 1)[1].strip()
    print(json.dumps({"threads": engine.threads.intra_op_threads, "allowed": allowed}))
""")


def run_child(model: Path, confine: str) -> tuple[dict[str, object], str]:
    """The child confines itself (a CPU number for its affinity, or a cgroup to join), then runs."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), confine], capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def spare_cpus() -> list[int]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs a process allowed on two CPUs or more")
    return cpus


def test_onnxruntime_threads_stay_on_the_cpu_the_process_was_given(tmp_path: Path) -> None:
    cpu = spare_cpus()[0]  # ONNX Runtime's default pins its first worker to the next core
    result, _ = run_child(colour_probe(tmp_path / "probe.onnx"), str(cpu))
    assert result["threads"] == 1
    assert set(result["allowed"].values()) == {str(cpu)}  # type: ignore[union-attr]


@pytest.fixture
def one_cpu_cpuset() -> Iterator[tuple[Path, int]]:
    """A real cpuset cgroup (v1 or v2) holding one CPU; skipped where this process cannot make one."""
    cpu = spare_cpus()[0]
    for root in (Path("/sys/fs/cgroup/cpuset"), Path("/sys/fs/cgroup")):
        group = root / f"edged-test-{os.getpid()}"
        try:
            group.mkdir()
        except OSError:
            continue
        if not (group / "cgroup.procs").exists():  # a plain directory: no cgroup filesystem here
            group.rmdir()
            continue
        try:
            mems = group / "cpuset.mems"  # v1 leaves a new group's memory nodes empty
            if mems.exists() and not mems.read_text().strip():
                parent = root / "cpuset.mems"
                mems.write_text(parent.read_text() if parent.exists() else "0")
            (group / "cpuset.cpus").write_text(str(cpu))
        except OSError:
            group.rmdir()
            continue
        try:
            yield group, cpu
        finally:
            group.rmdir()
        return
    pytest.skip("cannot create a cpuset cgroup here (needs root and a cpuset controller)")


def test_inside_a_cpuset_onnxruntime_pins_nothing_and_says_nothing(tmp_path: Path, one_cpu_cpuset: tuple[Path, int]) -> None:
    group, cpu = one_cpu_cpuset
    result, stderr = run_child(colour_probe(tmp_path / "probe.onnx"), str(group))
    assert result["threads"] == 1
    assert set(result["allowed"].values()) == {str(cpu)}  # type: ignore[union-attr]
    assert "pthread_setaffinity_np" not in stderr


def test_lanes_share_the_cores_with_the_pool_by_default_and_a_count_that_crowds_them_is_warned_about(
    arm: Path, smt: Path
) -> None:
    """Each lane runs on its own thread besides the pool's: n pool threads for k lanes keep
    n - 1 + k busy, so the default leaves the pool what the lanes do not take."""
    two = plan_threads(0, frozenset({0, 1, 2, 3}), arm, lanes=2)
    assert two.intra_op_threads == 3 and two.warning is None
    assert "with 2 inference lanes on the 4 physical core(s) of CPUs 0-3" in two.summary
    assert plan_threads(0, frozenset({0, 1, 2, 3}), smt, lanes=2).intra_op_threads == 1  # two cores, SMT siblings
    many = plan_threads(0, frozenset({0, 1, 2, 3}), arm, lanes=8)
    assert many.intra_op_threads == 1 and many.warning is not None
    assert "runtime.inference_lanes = 8 on 4 physical core(s)" in many.warning and "set at most 4" in many.warning
    assert plan_threads(3, frozenset({0, 1, 2, 3}), arm, lanes=2).warning is None  # 2 pool workers + 2 lanes: 4
    crowded = plan_threads(4, frozenset({0, 1, 2, 3}), arm, lanes=2).warning
    assert crowded is not None and "intra_op_threads = 4 with 2 inference lanes" in crowded
