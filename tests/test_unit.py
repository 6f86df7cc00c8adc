"""The unit that runs a configuration, as `edged check` run as root sees it: which unit, what its
sandbox leaves writable (from ``systemctl show``, drop-ins included), and what its user may write."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from edged.unit import Unit, unit_for

pytestmark = pytest.mark.unit

# `systemctl show` of the packaged edged.service with a drop-in adding ReadWritePaths=-/srv/evidence.
SHOWN = """LoadState=loaded
User=
Group=
SupplementaryGroups=video
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
ReadWritePaths=-/srv/evidence /mnt/ssd
StateDirectory=edged
CacheDirectory=edged
RuntimeDirectory=edged
LogsDirectory=
"""


def test_the_packaged_units_are_those_that_read_etc_edged() -> None:
    assert unit_for(Path("/etc/edged/edged.toml")) == "edged.service"
    assert unit_for(Path("/etc/edged/cam1.toml")) == "edged@cam1.service"
    assert unit_for(Path("/etc/edged/sub/cam1.toml")) is None
    assert unit_for(Path("/home/me/edged.toml")) is None


@pytest.mark.parametrize(
    ("folder", "problem"),
    [
        ("/var/lib/edged/evidence", None),  # StateDirectory=
        ("/var/cache/edged/openvino", None),
        ("/run/edged/cam1", None),
        ("/tmp/evidence", None),  # PrivateTmp=
        ("/srv/evidence/cam0", None),  # ReadWritePaths=, "-" or not
        ("/mnt/ssd", None),
        (
            "/srv/evidence2",
            "edged.service's ProtectSystem=strict keeps /srv/evidence2 read-only: add "
            "ReadWritePaths=/srv/evidence2 with systemctl edit edged.service",
        ),
        ("/var/lib/other", "ProtectSystem=strict keeps /var/lib/other read-only"),
        ("/etc/edged/evidence", "ProtectSystem=strict keeps /etc/edged/evidence read-only"),
        ("/home/me/evidence", "edged.service's ProtectHome=yes hides /home/me/evidence from it"),
        ("/root/evidence", "ProtectHome=yes hides /root/evidence"),
    ],
)
def test_a_folder_outside_what_the_sandbox_leaves_writable_is_named_with_the_fix(folder: str, problem: str | None) -> None:
    unit = Unit.parse("edged.service", SHOWN)
    assert unit is not None
    said = unit.cannot_write(Path(folder))
    assert said is None if problem is None else (said is not None and problem in said), said


def test_without_a_sandbox_every_folder_is_left_to_the_user_and_no_unit_is_none() -> None:
    unit = Unit.parse("edged.service", SHOWN.replace("ProtectSystem=strict", "ProtectSystem=no"))
    assert unit is not None and unit.cannot_write(Path("/srv/anywhere")) is None
    assert Unit.parse("edged@cam9.service", "LoadState=not-found\nUser=\n") is None


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder every user can reach (pytest's own folders are root's alone), removed after."""
    folder = Path(tempfile.mkdtemp(prefix="edged-unit-", dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


@pytest.mark.skipif(os.geteuid() != 0, reason="asking as another user needs root, as sudo edged check is")
def test_a_folder_root_may_write_and_the_units_user_may_not_is_named_with_the_fix(shared: Path) -> None:
    unit = Unit.parse("edged.service", SHOWN.replace("User=\n", "User=nobody\n").replace("strict", "no"))
    assert unit is not None
    evidence = shared / "evidence"
    evidence.mkdir(mode=0o755)  # root's, as `sudo mkdir` leaves it
    said = unit.cannot_write(evidence / "cam0")  # still to be made: its folder above is asked
    assert said == f"edged.service runs as nobody, who may not write in {evidence}: chown nobody {evidence}, or give another"
    os.chown(evidence, 65534, -1)
    assert unit.cannot_write(evidence / "cam0") == said  # asked once in a check, however many cameras write there
    again = Unit.parse("edged.service", SHOWN.replace("User=\n", "User=nobody\n").replace("strict", "no"))
    assert again is not None and again.cannot_write(evidence / "cam0") is None  # the next check's


def test_the_check_takes_on_the_state_and_runtime_directories_systemd_gives_the_service() -> None:
    """The service's evidence, journal, certificate and ipc sockets default to these: a check in a shell,
    without them, tried folders beside the configuration the service never writes."""
    unit = Unit.parse("edged@cam1.service", SHOWN.replace("=edged\n", "=edged/cam1\n"))
    assert unit is not None
    assert unit.environment() == {"STATE_DIRECTORY": "/var/lib/edged/cam1", "RUNTIME_DIRECTORY": "/run/edged/cam1"}
    bare = Unit.parse("edged.service", "LoadState=loaded\nUser=edged\n")
    assert bare is not None and bare.environment() == {}


@pytest.mark.skipif(os.geteuid() != 0, reason="asking as another user needs root, as sudo edged check is")
def test_a_folder_in_a_directory_systemd_has_still_to_make_is_the_services_to_write() -> None:
    """Before the first start /var/lib/edged is not there: systemd makes it for the service's user."""
    absent = f"edged-unit-{os.getpid()}"
    assert not Path("/var/lib", absent).exists()
    shown = SHOWN.replace("User=\n", "User=nobody\n").replace("StateDirectory=edged", f"StateDirectory={absent}")
    unit = Unit.parse("edged.service", shown.replace("strict", "no"))
    assert unit is not None
    assert unit.cannot_write(Path("/var/lib", absent, "evidence")) is None
    said = unit.cannot_write(Path("/var/lib", f"{absent}-not-its-own", "evidence"))
    assert said is not None and "who may not write in /var/lib:" in said
