"""The Debian package: build it, inspect it, lint it, install it into a throw-away root.

The install goes through dpkg itself (``dpkg --root`` with chroot-less maintainer scripts), so the
conffile is registered, postinst creates the user (with systemd-sysusers, the branch postinst
takes for another root), byte-compiles the venv and enables the unit, and purge removes it all,
the keys ``edged keygen`` made in /etc/edged/keys included.
The installed ``edged check`` then runs on the installed venv, model and config.

Building takes about half a minute and lintian about as long again, so the package is built once
per run (the ``deb`` fixture in tests/conftest.py, shared with tests/test_systemd_units.py).
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.packaging

REPO = Path(__file__).resolve().parent.parent
BUILD_DEB = REPO / "packaging" / "build-deb"
VENV = "/usr/lib/edged/venv"


def _debian_python() -> str | None:
    """/usr/bin/python3 as its Debian package installs it, or None."""
    python = Path("/usr/bin/python3")
    if not python.exists() or shutil.which("dpkg") is None:
        return None
    real = python.resolve()
    if subprocess.run(["dpkg", "-S", str(real)], capture_output=True).returncode != 0:
        return None
    return real.name  # e.g. python3.11


DEBIAN_PYTHON = _debian_python()
MISSING = [tool for tool in ("dpkg-deb", "dpkg-shlibdeps", "lintian") if shutil.which(tool) is None]
needs_debian_tools = pytest.mark.skipif(
    bool(MISSING) or DEBIAN_PYTHON is None,
    reason=f"needs Debian's python3 and {', '.join(MISSING) or 'dpkg-dev, lintian'} (apt install python3 dpkg-dev lintian)",
)


def _version() -> str:
    match = re.search(r'^__version__ = "([^"]+)"$', (REPO / "edged" / "__init__.py").read_text(), re.M)
    assert match
    return match.group(1)


def _arch() -> str:
    return subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()


def _run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]


# Every file and link outside the venv, and a few in it, with its mode.
EXPECTED_MODES = {
    "/usr/bin/edged": "lrwxrwxrwx",
    f"{VENV}/bin/edged": "-rwxr-xr-x",
    f"{VENV}/pyvenv.cfg": "-rw-r--r--",
    "/etc/edged/edged.toml": "-rw-r--r--",
    "/lib/systemd/system/edged.service": "-rw-r--r--",
    "/lib/systemd/system/edged@.service": "-rw-r--r--",
    "/usr/lib/sysusers.d/edged.conf": "-rw-r--r--",
    "/usr/share/edged/models/demo.onnx": "-rw-r--r--",
    "/usr/share/edged/models/demo.labels": "-rw-r--r--",
    "/usr/share/doc/edged/copyright": "-rw-r--r--",
    "/usr/share/doc/edged/changelog.gz": "-rw-r--r--",
    "/usr/share/doc/edged/README.Debian": "-rw-r--r--",
    "/usr/share/doc/edged/examples/modbus-port-502.conf": "-rw-r--r--",
    "/usr/share/lintian/overrides/edged": "-rw-r--r--",
}


@pytest.fixture(scope="module")
def contents(deb: Path) -> dict[str, tuple[str, str, str]]:
    """Path -> (mode string, owner/group, symlink target or '')."""
    listing = _run(["dpkg-deb", "--contents", str(deb)], check=True).stdout
    entries = {}
    for line in listing.splitlines():
        mode, owner, _size, _date, _time, rest = line.split(maxsplit=5)
        name, _, target = rest.partition(" -> ")
        entries[name.removeprefix(".").rstrip("/") or "/"] = (mode, owner, target)
    return entries


@pytest.fixture(scope="module")
def unpacked(deb: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("unpacked")
    _run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root


def _field(deb: Path, name: str) -> str:
    return _run(["dpkg-deb", "--field", str(deb), name], check=True).stdout.strip()


# ---- build-deb itself --------------------------------------------------------------------------


def test_missing_inputs_fail_the_build_with_their_names(tmp_path: Path) -> None:
    fake = tmp_path / "repo"
    (fake / "packaging").mkdir(parents=True)
    shutil.copy(BUILD_DEB, fake / "packaging" / "build-deb")
    (fake / "edged").mkdir()
    (fake / "edged" / "__init__.py").write_text('__version__ = "1.0"\n')
    proc = _run([str(fake / "packaging" / "build-deb"), "--output-dir", str(tmp_path / "out")], timeout=60)
    assert proc.returncode == 1
    assert "missing input file(s)" in proc.stderr
    for name in ("models/demo.onnx", "models/demo.labels", "config/edged.toml", "pyproject.toml"):
        assert name in proc.stderr
    assert "edged/__init__.py" not in proc.stderr
    assert not (tmp_path / "out").exists()


# ---- the .deb ----------------------------------------------------------------------------------


@needs_debian_tools
def test_file_name_and_control_fields(deb: Path) -> None:
    version, arch = _version(), _arch()
    assert deb.name == f"edged_{version}_{arch}.deb"
    assert _field(deb, "Package") == "edged"
    assert _field(deb, "Version") == version
    assert _field(deb, "Architecture") == arch
    depends = [d.strip().split()[0] for d in _field(deb, "Depends").split(",")]
    # The venv is bound to the interpreter it was built with.
    assert DEBIAN_PYTHON in depends
    for needed in ("python3-systemd", "adduser", "libc6"):
        assert needed in depends
    assert _field(deb, "Recommends") == "python3-paho-mqtt (>= 2.0)"  # paho 2 for the [mqtt] output
    assert int(_field(deb, "Installed-Size")) > 50_000  # KiB: the venv with ORT, OpenCV, NumPy


@needs_debian_tools
def test_only_the_config_is_a_conffile(deb: Path) -> None:
    assert _run(["dpkg-deb", "--info", str(deb), "conffiles"], check=True).stdout.split() == ["/etc/edged/edged.toml"]


@needs_debian_tools
def test_expected_paths_modes_and_owner(contents: dict[str, tuple[str, str, str]]) -> None:
    assert {path: contents[path][0] for path in EXPECTED_MODES if path in contents} == EXPECTED_MODES
    assert contents["/usr/bin/edged"][2] == "../lib/edged/venv/bin/edged"
    assert {owner for _mode, owner, _target in contents.values()} == {"root/root"}
    assert [p for p in contents if "__pycache__" in p or p.endswith((".pyc", ".pyo"))] == []
    site = [p for p in contents if "/site-packages/" in p]
    assert any(p.endswith("/site-packages/edged/cli.py") for p in site)
    assert any("/site-packages/onnxruntime/" in p for p in site)
    assert [p for p in site if contents[p][0].startswith("-") and "x" in contents[p][0]] == []


@needs_debian_tools
def test_packaged_files_are_the_repository_files(unpacked: Path) -> None:
    pairs = {
        "etc/edged/edged.toml": "config/edged.toml",
        "lib/systemd/system/edged.service": "systemd/edged.service",
        "lib/systemd/system/edged@.service": "systemd/edged@.service",
        "usr/lib/sysusers.d/edged.conf": "systemd/edged.sysusers.conf",
        "usr/share/doc/edged/examples/modbus-port-502.conf": "systemd/modbus-port-502.conf",
        "usr/share/edged/models/demo.onnx": "models/demo.onnx",
        "usr/share/edged/models/demo.labels": "models/demo.labels",
    }
    for packaged, source in pairs.items():
        assert (unpacked / packaged).read_bytes() == (REPO / source).read_bytes(), packaged


@needs_debian_tools
def test_venv_is_relocated_to_its_installed_path(unpacked: Path) -> None:
    venv = unpacked / VENV.lstrip("/")
    cfg = dict(line.split(" = ", 1) for line in (venv / "pyvenv.cfg").read_text().splitlines())
    assert cfg["include-system-site-packages"] == "true"
    assert cfg["home"] == "/usr/bin"
    assert os.readlink(venv / "bin" / DEBIAN_PYTHON) == f"/usr/bin/{DEBIAN_PYTHON}"
    assert (venv / "bin" / "edged").read_text().splitlines()[0] == f"#!{VENV}/bin/python"
    for text_file in [
        venv / "pyvenv.cfg",
        venv / "bin" / "activate",
        *venv.glob("bin/*"),
        *venv.glob("lib/python*/site-packages/*.dist-info/RECORD"),
    ]:
        if text_file.is_file() and not text_file.is_symlink():
            assert "edged-deb." not in text_file.read_text(errors="replace"), text_file
    # systemd-python comes from Debian's python3-systemd, not from the venv.
    assert list(venv.glob("lib/python*/site-packages/systemd")) == []


@needs_debian_tools
def test_changelog_and_copyright(unpacked: Path) -> None:
    doc = unpacked / "usr" / "share" / "doc" / "edged"
    first = gzip.decompress((doc / "changelog.gz").read_bytes()).decode().splitlines()[0]
    assert first == f"edged ({_version()}) unstable; urgency=medium"
    copyright_text = (doc / "copyright").read_text()
    assert "Licence: Apache-2.0" in copyright_text
    assert "/usr/share/common-licenses/Apache-2.0" in copyright_text
    for bundled in ("onnxruntime", "opencv-python-headless", "numpy", "pyzmq", "pydantic"):
        assert re.search(rf"^  {re.escape(bundled)} \S+: ", copyright_text, re.M), bundled


@needs_debian_tools
def test_lintian_reports_no_errors(deb: Path, contents: dict[str, tuple[str, str, str]]) -> None:
    # Left out: the checks that read every byte of the bundled libraries (a third of lintian's time)
    # and can find no error in this package. binaries/spelling gives a tag of severity info; the
    # JavaScript and PHP library finders and files/unicode/trojan warnings or pedantic ones only;
    # libraries/embedded gives embedded-library, which the package's overrides accept for the venv,
    # and outside the venv the package has no compiled file (a new file there fails this test first).
    def files_outside_venv(modes: dict[str, str]) -> set[str]:
        return {p for p, mode in modes.items() if mode.startswith("-") and not p.startswith(f"{VENV}/")}

    packaged = files_outside_venv({path: mode for path, (mode, _, _) in contents.items()})
    assert packaged == files_outside_venv(EXPECTED_MODES)
    skipped = ["binaries/spelling", "libraries/embedded", "files/unicode/trojan"]
    skipped += ["languages/javascript/embedded", "languages/php/embedded", "languages/php/pear/embedded"]
    # The suite's package is built uncompressed (tests/conftest.py), which lintian rightly calls an error.
    uncompressed = "uses-no-compression-for-control-tarball,uses-no-compression-for-data-tarball"
    options = ["--tag-display-limit", "0", "--dont-check-part", ",".join(skipped), "--suppress-tags", uncompressed]
    proc = _run(["lintian", *options, str(deb)], timeout=600)
    errors = [line for line in proc.stdout.splitlines() if line.startswith("E:")]
    assert errors == []
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- installing it -----------------------------------------------------------------------------


@needs_debian_tools
@pytest.mark.skipif(os.geteuid() != 0, reason="dpkg --root must run as root to set file owners")
@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="needs systemd-sysusers (apt install systemd)")
def test_dpkg_installs_configures_runs_and_purges(deb: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    admin = root / "var" / "lib" / "dpkg"
    for sub in ("info", "updates", "triggers"):
        (admin / sub).mkdir(parents=True)
    (admin / "status").touch()
    (admin / "available").touch()
    (root / "etc").mkdir()
    dpkg = ["dpkg", f"--root={root}", f"--log={root}/dpkg.log", "--force-script-chrootless", "--force-depends"]

    proc = _run([*dpkg, "--install", str(deb)], timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    status = _run([*dpkg, "--status", "edged"], check=True).stdout
    assert "Status: install ok installed" in status
    assert re.search(r"^ /etc/edged/edged\.toml [0-9a-f]{32}$", status, re.M)

    # postinst: the user, its camera group, bytecode, the enabled (not started) unit.
    passwd = (root / "etc" / "passwd").read_text().splitlines()
    assert [line.split(":")[5:] for line in passwd if line.startswith("edged:")] == [["/var/lib/edged", "/usr/sbin/nologin"]]
    video = [line for line in (root / "etc" / "group").read_text().splitlines() if line.startswith("video:")]
    assert "edged" in video[0].split(":")[3].split(",")
    pyc = next((root / VENV.lstrip("/")).glob("lib/python*/site-packages/edged/__pycache__/cli.*.pyc"))
    assert pyc.stat().st_size > 0
    wants = root / "etc" / "systemd" / "system" / "multi-user.target.wants" / "edged.service"
    assert os.readlink(wants) == "/lib/systemd/system/edged.service"

    # The installed entry point on the installed venv, config and model. The config names the
    # model by its absolute installed path, which here lies under the root.
    config = tmp_path / "edged.toml"
    config.write_text(
        (root / "etc" / "edged" / "edged.toml").read_text().replace("/usr/share/edged/", f"{root}/usr/share/edged/")
    )
    python = root / VENV.lstrip("/") / "bin" / "python"
    entry = root / VENV.lstrip("/") / "bin" / "edged"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    where = _run(
        [str(python), "-c", "import edged; print(edged.__file__)"], env=env, cwd=tmp_path, timeout=60, check=True
    ).stdout.strip()
    assert where.startswith(f"{root}{VENV}/lib/")
    version = _run([str(python), str(entry), "--version"], env=env, cwd=tmp_path, timeout=60)
    assert version.stdout.strip() == f"edged {_version()}"
    check = _run([str(python), str(entry), "check", "--config", str(config)], env=env, cwd=tmp_path, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.splitlines()[-1] == "ok"
    assert f"{root}/usr/share/edged/models/demo.onnx" in check.stdout

    # The key setup README.Debian gives, with the installed command: the publisher's pair and an
    # allowed subscriber's public key, which purge must take away with the rest of /etc/edged.
    keys = root / "etc" / "edged" / "keys"
    keygen = _run([str(python), str(entry), "keygen", str(keys)], env=env, cwd=tmp_path, timeout=60)
    assert keygen.returncode == 0, keygen.stderr
    subscriber = _run([str(python), str(entry), "keygen", str(tmp_path / "line3"), "--name", "line3"], env=env, timeout=60)
    assert subscriber.returncode == 0, subscriber.stderr
    shutil.copy(tmp_path / "line3" / "line3.key", keys / "clients")
    assert sorted(p.name for p in keys.rglob("*")) == ["clients", "line3.key", "server.key", "server.key_secret"]

    # Purge: no file of the package, no bytecode, no state, no keys, no enablement left behind, and
    # none of an optional feature's package as pip put it into the venv (README.Debian).
    (root / "var" / "lib" / "edged").mkdir(parents=True)
    (root / "var" / "lib" / "edged" / "engine.cache").write_text("x")
    site = next((root / VENV.lstrip("/")).glob("lib/python*/site-packages"))
    for extra in ("asyncua/__init__.py", "asyncua-2.1.0.dist-info/RECORD"):
        (site / extra).parent.mkdir(exist_ok=True)
        (site / extra).write_text("")
    (root / VENV.lstrip("/") / "bin" / "uals").write_text(f"#!{VENV}/bin/python\n")
    proc = _run([*dpkg, "--purge", "edged"], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for gone in (
        "/usr/lib/edged",
        "/etc/edged/keys",
        "/etc/edged",
        "/var/lib/edged",
        "/usr/share/edged",
        "/usr/bin/edged",
        "/lib/systemd/system/edged.service",
    ):
        assert not os.path.lexists(root / gone.lstrip("/")), gone
    assert not os.path.lexists(wants)
