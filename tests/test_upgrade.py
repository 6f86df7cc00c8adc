"""Upgrading and downgrading the installed .deb while edged runs, under a real systemd.

One container (tests/nspawn.py) is booted, and one scenario runs in it from start to end, the way
a line's board lives through new versions: the package built from this tree is installed, the
operator edits /etc/edged/edged.toml, runs edged.service and an enabled edged@cam1.service, and
has keys, a verdict journal, evidence and an OPC UA certificate. Then, with no terminal:

- ``dpkg -i`` of a newer version whose packaged edged.toml changed too stops at dpkg's conffile
  prompt (end of file on stdin), leaving the package unpacked and the old processes running;
  ``dpkg --force-confdef --force-confold --configure --pending`` finishes it;
- a newer version that refuses the operator's configuration leaves both units failed with
  status=78/CONFIG, not restarting, and dpkg still succeeds;
- the older version installed over it (a downgrade) brings both units back;
- a unit stopped by hand stays stopped through an upgrade (made with ``apt-get install``), and so
  does a failed one that is not enabled.

Every version change restarts each running unit once, after the new files are in place: the new
process maps no file dpkg has replaced. Keys, journal, evidence and certificate survive each step.

The other versions are the tree's own package with another version string (and, for the newer
ones, the changes described above) patched into an unpacked copy and packed again, a few seconds
each. The whole scenario takes about a minute after the .deb is built.

Skipped, with the reason, where no container can be booted (see tests/test_systemd_units.py).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from nspawn import ROOTFS, BootFailed, Container, booted, unavailable, wait_until

pytestmark = [pytest.mark.packaging, pytest.mark.systemd]

CONFIG = "/etc/edged/edged.toml"
INSTANCE_CONFIG = "/etc/edged/cam1.toml"
UNITS = ("edged.service", "edged@cam1.service")
VENV_SITE = "usr/lib/edged/venv/lib/python3*/site-packages"
# What a board's operator keeps beside the package: the verdict journal, evidence and the OPC UA
# server's certificate under the state directories; `edged keygen` writes the keys.
STATE = {
    "/var/lib/edged/journal.sqlite": "verdicts",
    "/var/lib/edged/evidence/cam0/2026-01-02/images/part-1.jpg": "jpeg",
    "/var/lib/edged/opcua/server.der": "certificate",
    "/var/lib/edged/opcua/server.pem": "key",
    "/var/lib/edged/cam1/journal.sqlite": "cam1 verdicts",
}
KEYS = "/etc/edged/keys"
# A dpkg run with nothing on its standard input, as a fleet tool runs it.
UNATTENDED = ("env", "DEBIAN_FRONTEND=noninteractive", "dpkg")
KEEP_CONFIG = ("--force-confdef", "--force-confold")
# The tree's package, a newer version, and a newer one that refuses the operator's configuration.
OLD, NEWER, REFUSING = "edged_old.deb", "edged_newer.deb", "edged_refusing.deb"


def _repack(deb: Path, path: Path, version: str, *, conffile_note: str = "", refuse_fps_over: int | None = None) -> None:
    """``deb`` as version ``version`` in ``path``: the control file, edged's ``__version__`` and md5sums changed.

    ``conffile_note`` is appended to the packaged edged.toml, a change of the package's own to the
    conffile. ``refuse_fps_over`` lowers the synthetic camera's fps limit in the packaged code, a
    new version that refuses a configuration the older accepted.
    """
    root = path.parent / f"root-{version}"
    subprocess.run(["dpkg-deb", "--raw-extract", str(deb), str(root)], check=True)
    control = root / "DEBIAN" / "control"
    control.write_text(re.sub(r"^Version: .*$", f"Version: {version}", control.read_text(), count=1, flags=re.M))
    (init,) = root.glob(f"{VENV_SITE}/edged/__init__.py")
    init.write_text(re.sub(r"^__version__ = .*$", f'__version__ = "{version}"', init.read_text(), count=1, flags=re.M))
    if conffile_note:
        conffile = root / CONFIG.lstrip("/")
        conffile.write_text(conffile.read_text() + conffile_note)
    if refuse_fps_over is not None:
        (sources,) = root.glob(f"{VENV_SITE}/edged/settings/sources.py")
        text, count = re.subn(
            r"(fps: float = Field\(15\.0, gt=0, le=)240,", rf"\g<1>{refuse_fps_over},", sources.read_text()
        )
        assert count == 1, "the synthetic source's fps field changed: update this test's patch"
        sources.write_text(text)
    md5sums = root / "DEBIAN" / "md5sums"
    lines = (line.split("  ", 1) for line in md5sums.read_text().splitlines())
    md5sums.write_text("".join(f"{hashlib.md5((root / name).read_bytes()).hexdigest()}  {name}\n" for _, name in lines))
    subprocess.run(
        ["dpkg-deb", "-Znone", "--root-owner-group", "--build", str(root), str(path)], check=True, capture_output=True
    )
    shutil.rmtree(root)


@pytest.fixture(scope="module")
def container(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    reason = unavailable(ROOTFS)
    if reason:
        pytest.skip(reason)
    deb: Path = request.getfixturevalue("deb")  # not an argument: pytest would build it before the container could skip
    debs = tmp_path_factory.mktemp("upgrade-debs")
    try:
        os.link(deb, debs / OLD)
    except OSError:
        shutil.copy(deb, debs / OLD)
    version = subprocess.run(
        ["dpkg-deb", "--field", str(deb), "Version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    _repack(deb, debs / NEWER, f"{version}+upgrade1", conffile_note="# a line the newer package added\n")
    _repack(deb, debs / REFUSING, f"{version}+upgrade2", refuse_fps_over=5)
    log = tmp_path_factory.mktemp("nspawn") / "nspawn.log"
    try:
        with booted(ROOTFS, log, {debs: "/mnt/deb"}) as booted_container:
            yield booted_container
    except BootFailed as e:
        pytest.skip(str(e))


def _dpkg(container: Container, *args: str) -> subprocess.CompletedProcess[str]:
    """dpkg run as a fleet tool runs it: no terminal, an empty standard input, no debconf questions."""
    return container.run(*UNATTENDED, *args, stdin="", timeout=600)


def _state(container: Container) -> str:
    """Owner, mode and sha256 of every kept file: the state files and the keys."""
    keys = container.ok("find", KEYS, "-type", "f").split()
    paths = sorted([*STATE, *keys])
    return container.ok("stat", "--format=%U:%G %a %n", *paths) + container.ok("sha256sum", *paths)


def _units(container: Container) -> dict[str, dict[str, str]]:
    return {unit: container.show(unit, "ActiveState", "SubState", "MainPID", "NRestarts") for unit in UNITS}


def _replaced_files_mapped(container: Container, pid: str) -> list[str]:
    """Files of the package that process ``pid`` maps and dpkg has since replaced: old code still running."""
    maps = container.ok("cat", f"/proc/{pid}/maps").splitlines()
    return sorted({line.split(maxsplit=5)[-1] for line in maps if "/usr/lib/edged/" in line and line.endswith("(deleted)")})


def _is_active(container: Container, unit: str) -> bool:
    return container.show(unit, "ActiveState")["ActiveState"] == "active"


def _logged(container: Container, cursor: str, unit: str, pattern: str) -> bool:
    """Whether ``unit``'s journal since ``cursor`` (edged's lines and the manager's about it) has ``pattern``."""
    return re.search(pattern, container.journal(cursor, f"--unit={unit}")) is not None


def _assert_restarted_once_onto_the_new_files(container: Container, cursor: str, before: dict[str, dict[str, str]]) -> None:
    for unit in UNITS:
        assert wait_until(partial(_is_active, container, unit), 120), unit
        now = container.show(unit, "MainPID", "NRestarts")
        assert now["MainPID"] not in ("0", before[unit]["MainPID"]), unit
        assert now["NRestarts"] == "0", unit  # a start by the package, not systemd's Restart=
        assert _replaced_files_mapped(container, now["MainPID"]) == [], unit
        started = rf"Started {re.escape(unit)}\b"
        assert wait_until(partial(_logged, container, cursor, unit, started), 30), unit
        assert len(re.findall(started, container.journal(cursor, f"--unit={unit}"))) == 1, unit


def test_upgrade_and_downgrade_restart_what_runs_keep_the_config_and_state(container: Container) -> None:
    old, newer, refusing = (f"/mnt/deb/{name}" for name in (OLD, NEWER, REFUSING))
    old_version = container.ok("dpkg-deb", "--field", old, "Version").strip()

    # ---- the board as an operator set it up ----
    installed = _dpkg(container, "--install", old)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    packaged = container.ok("cat", CONFIG)
    edited, count = re.subn(r"^fps = 15\.0 ", "fps = 10.0 ", packaged, count=1, flags=re.M)
    assert count == 1
    container.write(CONFIG, edited)
    instance, count = re.subn(r"^camera_id = \"cam0\"", 'camera_id = "cam1"', edited, count=1, flags=re.M)
    instance = instance.replace("ipc:///run/edged/detections.sock", "ipc:///run/edged/cam1/detections.sock")
    assert count == 1
    container.write(INSTANCE_CONFIG, instance)
    container.ok("systemctl", "start", "edged.service")
    container.ok("systemctl", "enable", "--now", "edged@cam1.service")
    container.ok("edged", "keygen", KEYS)
    for path, content in STATE.items():
        container.ok("install", "-D", "--owner=edged", "--group=edged", "--mode=0640", "/dev/null", path)
        container.write(path, content)
    state = _state(container)
    running = _units(container)
    assert {unit["ActiveState"] for unit in running.values()} == {"active"}

    # ---- a newer version, its packaged config changed too: dpkg stops at the conffile prompt ----
    cursor = container.journal_cursor()
    prompted = _dpkg(container, "--install", newer)
    assert prompted.returncode == 1
    assert "end of file on stdin at conffile prompt" in prompted.stderr
    assert container.ok("dpkg-query", "--show", "--showformat=${Status}", "edged") == "install ok unpacked"
    # Not configured, so not restarted: the old processes run on, from the replaced files.
    assert _units(container) == running
    assert _replaced_files_mapped(container, running["edged.service"]["MainPID"]) != []
    assert container.ok("cat", CONFIG) == edited
    # What README.Debian tells an unattended upgrade to run, here to finish the interrupted one.
    configured = _dpkg(container, *KEEP_CONFIG, "--configure", "--pending")
    assert configured.returncode == 0, configured.stdout + configured.stderr
    assert "Keeping old config file as default" in configured.stdout + configured.stderr
    assert container.ok("cat", CONFIG) == edited
    assert container.ok("cat", f"{CONFIG}.dpkg-dist").endswith("# a line the newer package added\n")
    _assert_restarted_once_onto_the_new_files(container, cursor, running)
    assert container.ok("edged", "--version").strip() == f"edged {old_version}+upgrade1"
    assert _state(container) == state

    # ---- a newer version that refuses the running configuration ----
    running = _units(container)
    cursor = container.journal_cursor()
    refused = _dpkg(container, *KEEP_CONFIG, "--install", refusing)
    assert refused.returncode == 0, refused.stdout + refused.stderr
    assert container.ok("dpkg-query", "--show", "--showformat=${Status}", "edged") == "install ok installed"
    assert "Could not execute" not in refused.stderr
    failed = {"ActiveState": "failed", "SubState": "failed", "MainPID": "0", "NRestarts": "0"}
    assert _units(container) == {unit: failed for unit in UNITS}
    for unit in UNITS:
        assert (
            f"edged: warning: {unit} is not running after the change from version {old_version}+upgrade1" in refused.stderr
        )
        config = CONFIG if unit == "edged.service" else INSTANCE_CONFIG
        assert (
            f'edged: {unit} exited with 78: this version refuses its configuration or model; "edged check --config {config}"'
            in refused.stderr
        )
        assert container.show(unit, "ExecMainStatus")["ExecMainStatus"] == "78"
        assert wait_until(partial(_logged, container, cursor, unit, r"source\.fps: .* less than or equal to 5"), 30)
        journal = container.journal(cursor, f"--unit={unit}")
        assert "status=78/CONFIG" in journal
        assert "Scheduled restart job" not in journal
    assert _state(container) == state

    # ---- back to the version that accepts it: a downgrade brings both units back ----
    cursor = container.journal_cursor()
    downgraded = _dpkg(container, *KEEP_CONFIG, "--install", old)
    assert downgraded.returncode == 0, downgraded.stdout + downgraded.stderr
    assert "downgrading edged" in downgraded.stderr
    _assert_restarted_once_onto_the_new_files(container, cursor, running)
    assert container.ok("edged", "--version").strip() == f"edged {old_version}"
    assert container.ok("cat", CONFIG) == edited
    assert _state(container) == state

    # ---- a unit stopped by hand stays stopped through an upgrade, a failed one not enabled too ----
    container.ok("systemctl", "stop", "edged.service")
    assert container.run("systemctl", "start", "edged@cam2.service").returncode != 0  # no /etc/edged/cam2.toml
    cam2 = container.show("edged@cam2.service", "ActiveState", "InvocationID")
    assert cam2["ActiveState"] == "failed"
    instance_pid = container.show("edged@cam1.service", "MainPID")["MainPID"]
    # Through apt this time, with the options README.Debian gives for an unattended upgrade.
    upgraded = container.run(
        "env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "--yes",
        *(f"--option=Dpkg::Options::={option}" for option in KEEP_CONFIG), newer,
        stdin="", timeout=600,
    )  # fmt: skip
    assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
    assert container.ok("edged", "--version").strip() == f"edged {old_version}+upgrade1"
    assert container.show("edged.service", "ActiveState")["ActiveState"] == "inactive"
    assert container.show("edged@cam2.service", "ActiveState", "InvocationID") == cam2
    assert "cam2" not in upgraded.stdout + upgraded.stderr
    instance_now = container.show("edged@cam1.service", "ActiveState", "MainPID")
    assert instance_now["ActiveState"] == "active"
    assert instance_now["MainPID"] not in ("0", instance_pid)
    assert _replaced_files_mapped(container, instance_now["MainPID"]) == []
    assert _state(container) == state
    assert container.ok("cat", CONFIG) == edited
    assert container.ok("cat", INSTANCE_CONFIG) == instance
