"""``scripts/setup``: what it says once it has succeeded, and the shared test rootfs made under a lock.

Its installs are run by ``scripts/test`` itself; here its functions run alone, extracted from the
script, with stand-ins for debootstrap and chroot on PATH.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "scripts" / "setup"


def _function(name: str) -> str:
    """The text of the shell function ``name`` in scripts/setup."""
    script = SETUP.read_text()
    start = script.index(f"{name}() {{")
    return script[start : script.index("\n}\n", start) + 3]


@pytest.mark.unit
def test_a_successful_setup_ends_by_saying_how_to_run_edged(tmp_path: Path) -> None:
    assert SETUP.read_text().rstrip().splitlines()[-1] == "how_to_run", "the last thing setup does, after every install"
    said = subprocess.run(
        ["bash", "-c", f"{_function('how_to_run')}how_to_run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    assert f"Run it as {tmp_path}/.venv/bin/edged," in said
    assert f"    . {tmp_path}/.venv/bin/activate\n    edged --help\n" in said


# Stands in for debootstrap: counts its runs, makes the target, and holds until the test lets it finish.
DEBOOTSTRAP = """#!/bin/sh
target=$4  # after --variant, --include and the codename
echo "$target" >> "$EDGED_FAKE/runs"
mkdir -p "$target"
touch "$EDGED_FAKE/started"
i=0
while [ ! -e "$EDGED_FAKE/release" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
"""


@pytest.mark.integration
@pytest.mark.skipif(
    not re.search(r"^VERSION_CODENAME=\S", Path("/etc/os-release").read_text(), re.MULTILINE),
    reason="no release codename: setup makes no test rootfs here",
)
def test_a_second_setup_waits_for_the_test_rootfs_another_is_making_and_keeps_it(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"debootstrap": DEBOOTSTRAP, "chroot": "#!/bin/sh\n"}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    rootfs = tmp_path / "cache" / "rootfs"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "EDGED_FAKE": str(tmp_path)}
    env["EDGED_TEST_ROOTFS"] = str(rootfs)
    command = ["bash", "-c", f"set -euo pipefail\n{_function('make_test_rootfs')}make_test_rootfs"]
    outputs = [tmp_path / "first.out", tmp_path / "second.out"]
    procs = []
    try:
        with outputs[0].open("w") as out:
            procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT))
        assert wait_for(lambda: (tmp_path / "started").exists(), timeout_s=30), outputs[0].read_text()
        with outputs[1].open("w") as out:
            procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT))
        assert wait_for(lambda: "waiting for another setup" in outputs[1].read_text(), timeout_s=30), outputs[1].read_text()
        (tmp_path / "release").touch()
        assert [proc.wait(60) for proc in procs] == [0, 0], [o.read_text() for o in outputs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert (tmp_path / "runs").read_text().splitlines() == [f"{rootfs}.partial"]  # debootstrap ran once
    assert (rootfs / ".edged-test-packages").read_text().startswith("systemd,")
    assert f"making the test rootfs {rootfs} (" in outputs[0].read_text()
    assert f"making the test rootfs {rootfs} (" not in outputs[1].read_text()
