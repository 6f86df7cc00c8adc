"""What an optional feature says when its package is missing, and README.Debian's install of it.

Each optional section of the configuration needs one more Python package (a pyproject extra). When
it is missing, edged names the command that installs it, for a checkout and for the .deb's
virtualenv; README.Debian gives the same command. All three follow the extra's requirement in
pyproject.toml, so that a raised minimum (asyncua 2.0) reaches every one of them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from edged.config import tomllib
from edged.engines import INSTALL_OPENVINO
from edged.modbus import INSTALL_PYMODBUS
from edged.mqtt import INSTALL_PAHO
from edged.opcua import INSTALL_ASYNCUA, opcua_problems
from edged.reject import INSTALL_GPIOD
from edged.settings.opcua import OpcuaConfig

REPO = Path(__file__).resolve().parent.parent
VENV_PIP = "sudo pip --python /usr/lib/edged/venv/bin/python install"
HINTS = {
    "mqtt": INSTALL_PAHO,
    "opcua": INSTALL_ASYNCUA,
    "modbus": INSTALL_PYMODBUS,
    "gpio": INSTALL_GPIOD,
    "openvino": INSTALL_OPENVINO,
}


def _extra(name: str) -> str:
    (requirement,) = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"][name]
    return str(requirement)


@pytest.mark.parametrize("extra", sorted(HINTS))
def test_a_missing_package_names_the_extra_and_the_install_readme_debian_gives(extra: str) -> None:
    command = f"{VENV_PIP} '{_extra(extra)}'"
    assert f".venv/bin/python -m pip install -e '.[{extra}]'" in HINTS[extra]
    assert command in HINTS[extra]
    assert command in (REPO / "packaging" / "debian" / "README.Debian").read_text()


def test_an_asyncua_older_than_2_is_refused_with_the_version_found(monkeypatch: pytest.MonkeyPatch) -> None:
    asyncua = pytest.importorskip("asyncua")
    monkeypatch.setattr(asyncua, "__version__", "1.1.8")  # passed the import, then stopped the server at start
    assert opcua_problems(OpcuaConfig()) == [
        f"opcua: an [opcua] section needs asyncua 2.0 or later, this Python has 1.1.8: {INSTALL_ASYNCUA}"
    ]


def test_without_asyncua_an_opcua_section_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "asyncua", None)  # as if asyncua were not installed
    (problem,) = opcua_problems(OpcuaConfig())
    assert problem.startswith("opcua: an [opcua] section needs asyncua 2.0 or later, which this Python cannot import")
    assert problem.endswith(INSTALL_ASYNCUA)
