"""The systemd units: systemd's own verifier and security scorer, plus the directives the daemon
and the package rely on.

``systemd-analyze verify`` needs the units' dependencies (sysinit.target, ...) and an executable
at every Exec path, so it runs against a throw-away root: the host's unit directory, the two units
and stub executables. No running systemd is needed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from edged.config import PublishConfig
from edged.errors import EXIT_CONFIG

pytestmark = pytest.mark.packaging

REPO = Path(__file__).resolve().parent.parent
UNIT_DIR = REPO / "systemd"
UNITS = ("edged.service", "edged@.service")
MAX_EXPOSURE = 2.5

ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed (apt install systemd)")

Unit = dict[str, list[tuple[str, str]]]


def parse_unit(text: str) -> Unit:
    """Sections to (key, value) pairs in file order; repeated keys stay separate entries."""
    sections: Unit = {}
    current: list[tuple[str, str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert not line.endswith("\\"), f"line continuations are not used here: {raw!r}"
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        assert current is not None, f"directive outside a section: {raw!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {raw!r}"
        current.append((key.strip(), value.strip()))
    return sections


def values(unit: Unit, section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def value(unit: Unit, section: str, key: str) -> str:
    found = values(unit, section, key)
    assert len(found) == 1, f"[{section}] {key}= expected once, found {found}"
    return found[0]


@pytest.fixture(scope="module")
def units() -> dict[str, Unit]:
    return {name: parse_unit((UNIT_DIR / name).read_text()) for name in UNITS}


def _host_unit_dir() -> Path:
    for candidate in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")):
        if (candidate / "multi-user.target").exists():
            return candidate
    pytest.skip("no systemd unit directory with multi-user.target on this host (apt install systemd)")


@pytest.fixture(scope="module")
def analyze_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with the host's units, ours, and a stub at every path our Exec lines name."""
    root = tmp_path_factory.mktemp("unit-root")
    (root / "usr" / "lib" / "systemd").mkdir(parents=True)
    (root / "usr" / "bin").mkdir()
    (root / "lib").symlink_to("usr/lib")
    (root / "bin").symlink_to("usr/bin")
    shutil.copytree(_host_unit_dir(), root / "usr" / "lib" / "systemd" / "system", symlinks=True)
    for name in UNITS:
        shutil.copy(UNIT_DIR / name, root / "usr" / "lib" / "systemd" / "system" / name)
    for exe in ("usr/bin/edged", "usr/bin/kill"):
        stub = root / exe
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)
    return root


def _verify(root: Path, unit: str) -> tuple[int, list[str]]:
    assert ANALYZE is not None
    proc = subprocess.run([ANALYZE, "verify", f"--root={root}", unit], capture_output=True, text=True, timeout=60)
    lines = (proc.stdout + proc.stderr).splitlines()
    # Complaints about our units name them; anything else is about the host's units.
    return proc.returncode, [line for line in lines if "edged" in line]


def _exposure(root: Path, unit: str) -> float:
    assert ANALYZE is not None
    proc = subprocess.run(
        [ANALYZE, "security", "--offline=yes", f"--root={root}", unit], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    assert match, f"no overall exposure in:\n{proc.stdout}\n{proc.stderr}"
    return float(match.group(1))


# ---- systemd's own checks ----------------------------------------------------------------------


@needs_analyze
@pytest.mark.parametrize("unit", ["edged.service", "edged@cam0.service"])
def test_systemd_analyze_verify_is_clean(analyze_root: Path, unit: str) -> None:
    rc, complaints = _verify(analyze_root, unit)
    assert complaints == []
    assert rc == 0


@needs_analyze
def test_verify_harness_reports_a_broken_unit(analyze_root: Path, tmp_path: Path) -> None:
    """The filter above must not hide real problems: a typo, a bad value, a missing binary."""
    broken = (UNIT_DIR / "edged.service").read_text()
    broken = broken.replace("WatchdogSec=10s", "WatchdogSec=ten\nWatchdogSecs=10s")
    broken = broken.replace("ExecStart=/usr/bin/edged", "ExecStart=/usr/bin/edged-missing")
    unit_path = analyze_root / "usr" / "lib" / "systemd" / "system" / "edged-broken.service"
    unit_path.write_text(broken)
    try:
        _rc, complaints = _verify(analyze_root, "edged-broken.service")
    finally:
        unit_path.unlink()
    text = "\n".join(complaints)
    assert "WatchdogSecs" in text
    assert "ten" in text
    assert "edged-missing" in text


@needs_analyze
@pytest.mark.parametrize("unit", ["edged.service", "edged@cam0.service"])
def test_security_exposure_is_at_most_2_5(analyze_root: Path, unit: str) -> None:
    assert _exposure(analyze_root, unit) <= MAX_EXPOSURE


@needs_analyze
def test_security_score_notices_a_weaker_sandbox(analyze_root: Path) -> None:
    """The parsed score moves with the unit: dropping the sandbox pushes it well over the limit."""
    weak = "\n".join(
        line
        for line in (UNIT_DIR / "edged.service").read_text().splitlines()
        if not line.startswith(("Protect", "SystemCall", "Restrict", "Private", "CapabilityBoundingSet", "User=", "Group="))
    )
    unit_path = analyze_root / "usr" / "lib" / "systemd" / "system" / "edged-weak.service"
    unit_path.write_text(weak)
    try:
        assert _exposure(analyze_root, "edged-weak.service") > 5.0
    finally:
        unit_path.unlink()


@needs_analyze
@pytest.mark.parametrize("unit", ["edged.service", "edged@.service"])
def test_the_modbus_port_502_drop_in_adds_only_the_bind_capability_and_verifies_clean(analyze_root: Path, unit: str) -> None:
    drop_in = parse_unit((UNIT_DIR / "modbus-port-502.conf").read_text())
    assert drop_in == {
        "Service": [("CapabilityBoundingSet", "CAP_NET_BIND_SERVICE"), ("AmbientCapabilities", "CAP_NET_BIND_SERVICE")]
    }
    folder = analyze_root / "usr" / "lib" / "systemd" / "system" / f"{unit}.d"
    folder.mkdir()
    try:
        shutil.copy(UNIT_DIR / "modbus-port-502.conf", folder / "modbus-port-502.conf")
        rc, complaints = _verify(analyze_root, unit.replace("@", "@cam0"))
        assert complaints == [] and rc == 0
        assert _exposure(analyze_root, unit.replace("@", "@cam0")) <= MAX_EXPOSURE
        assert ANALYZE is not None
        scored = subprocess.run(
            [ANALYZE, "security", "--offline=yes", f"--root={analyze_root}", unit.replace("@", "@cam0")],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert "Service process receives ambient capabilities" in scored  # the drop-in took effect
    finally:
        shutil.rmtree(folder)


# ---- what the daemon and the package rely on ---------------------------------------------------


@pytest.mark.parametrize("name", UNITS)
def test_notify_watchdog_and_restart_policy(units: dict[str, Unit], name: str) -> None:
    u = units[name]
    assert value(u, "Service", "Type") == "notify"
    assert value(u, "Service", "NotifyAccess") == "main"
    assert value(u, "Service", "WatchdogSec") == "10s"
    assert value(u, "Service", "TimeoutStopSec") == "5s"
    assert value(u, "Service", "Restart") == "on-failure"
    assert value(u, "Service", "RestartSec") == "2s"
    assert value(u, "Service", "ExecReload") == "/bin/kill -HUP $MAINPID"
    # A bad config or model exits with EX_CONFIG, which must not restart-loop.
    assert EXIT_CONFIG == 78
    assert str(EXIT_CONFIG) in value(u, "Service", "RestartPreventExitStatus").split()
    # The rate limit is a [Unit] setting; in [Service] systemd ignores it.
    assert value(u, "Unit", "StartLimitIntervalSec") == "120s"
    assert value(u, "Unit", "StartLimitBurst") == "5"
    assert values(u, "Service", "StartLimitIntervalSec") == []
    assert value(u, "Install", "WantedBy") == "multi-user.target"


@pytest.mark.parametrize("name", UNITS)
def test_descriptor_limit_leaves_room_for_many_subscribers(units: dict[str, Unit], name: str) -> None:
    """One descriptor per subscriber connection: systemd's default 1024 ran out at about a thousand."""
    assert int(value(units[name], "Service", "LimitNOFILE")) >= 16384


def test_exec_start_runs_the_packaged_binary_on_the_packaged_config(units: dict[str, Unit]) -> None:
    assert value(units["edged.service"], "Service", "ExecStart") == "/usr/bin/edged run --config /etc/edged/edged.toml"
    assert value(units["edged@.service"], "Service", "ExecStart") == "/usr/bin/edged run --config /etc/edged/%i.toml"


@pytest.mark.parametrize("name", UNITS)
def test_devices_user_and_sandbox(units: dict[str, Unit], name: str) -> None:
    u = units[name]
    assert value(u, "Service", "User") == "edged"
    assert "video" in value(u, "Service", "SupplementaryGroups").split()
    assert value(u, "Service", "DevicePolicy") == "closed"
    device_allow = values(u, "Service", "DeviceAllow")
    assert "char-video4linux rw" in device_allow
    # Device paths are not globbed by systemd: /dev/video* would silently match nothing.
    assert not [d for d in device_allow if "*" in d]
    assert value(u, "Service", "CapabilityBoundingSet") == ""
    assert value(u, "Service", "NoNewPrivileges") == "yes"
    assert value(u, "Service", "ProtectSystem") == "strict"
    assert value(u, "Service", "ProtectHome") == "yes"
    assert value(u, "Service", "PrivateTmp") == "yes"
    assert value(u, "Service", "ProtectKernelTunables") == "yes"
    assert value(u, "Service", "SystemCallArchitectures") == "native"
    assert values(u, "Service", "SystemCallFilter") == ["@system-service", "~@privileged"]
    assert value(u, "Service", "UMask") == "0027"
    assert value(u, "Service", "MemoryMax") == "1G"
    assert value(u, "Service", "ConfigurationDirectory") == "edged"
    assert value(u, "Service", "RuntimeDirectoryMode") == "0750"
    assert set(value(u, "Service", "RestrictAddressFamilies").split()) <= {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    # Not set on purpose (see the comments in the unit).
    assert values(u, "Service", "MemoryDenyWriteExecute") == []
    assert values(u, "Service", "PrivateDevices") == []


@pytest.mark.parametrize("name", UNITS)
def test_environment_sets_no_config_overrides(units: dict[str, Unit], name: str) -> None:
    """EDGED_* variables override config keys (and unknown ones are errors), so the unit sets none."""
    env = " ".join(values(units[name], "Service", "Environment")).split()
    assert "PYTHONUNBUFFERED=1" in env
    assert [e for e in env if e.startswith("EDGED_")] == []


def test_runtime_directory_holds_the_default_ipc_endpoint(units: dict[str, Unit]) -> None:
    runtime = value(units["edged.service"], "Service", "RuntimeDirectory")
    assert runtime == "edged"
    assert "ipc:///run/edged/detections.sock" in PublishConfig().endpoints
    assert value(units["edged.service"], "Service", "StateDirectory") == "edged"
    assert value(units["edged.service"], "Service", "CacheDirectory") == "edged"


def test_instances_get_their_own_directories(units: dict[str, Unit]) -> None:
    u = units["edged@.service"]
    assert value(u, "Service", "RuntimeDirectory") == "edged/%i"
    assert value(u, "Service", "StateDirectory") == "edged/%i"
    assert value(u, "Service", "CacheDirectory") == "edged/%i"
    # Instances live below /run/edged, so the plain unit must not delete it when it stops.
    assert value(units["edged.service"], "Service", "RuntimeDirectoryPreserve") == "yes"


def test_instance_unit_has_the_same_sandbox(units: dict[str, Unit]) -> None:
    """edged@.service is a copy of edged.service except for the per-instance lines."""
    per_instance = {
        "Description",
        "ExecStart",
        "StateDirectory",
        "CacheDirectory",
        "RuntimeDirectory",
        "RuntimeDirectoryPreserve",
    }

    def shared(u: Unit) -> dict[str, list[tuple[str, str]]]:
        return {s: [(k, v) for k, v in entries if k not in per_instance] for s, entries in u.items()}

    plain, template = shared(units["edged.service"]), shared(units["edged@.service"])
    assert plain.keys() == template.keys() == {"Unit", "Service", "Install"}
    for section in plain:
        assert plain[section] == template[section], section


def test_sysusers_entry_matches_the_unit_user(units: dict[str, Unit]) -> None:
    lines = [
        line.split()
        for line in (UNIT_DIR / "edged.sysusers.conf").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    user = value(units["edged.service"], "Service", "User")
    assert [ln[:3] for ln in lines if ln[0] == "u"] == [["u", user, "-"]]
    assert "/var/lib/edged" in [ln[-1] for ln in lines if ln[0] == "u"]
    groups = {ln[2] for ln in lines if ln[0] == "m" and ln[1] == user}
    assert groups == set(value(units["edged.service"], "Service", "SupplementaryGroups").split())
