"""A board upgraded in place from edged 0.4.0 reads its configuration as 0.4.0 read it.

dpkg keeps an edited /etc/edged/edged.toml as it is, and the new daemon starts on it: a key
renamed or removed since stops the line with exit 78 (systemd does not restart it), and a default
changed since changes what the board does unseen. ``tests/data/upgrade/0.4.0`` holds what 0.4.0
shipped and knew: its ``config/*.toml`` as released, ``keys.json`` (every key its settings had,
with its default) and ``settings.json`` (what it read from those files), both written from 0.4.0
by `settings_keys` and `leaves` below. A key dropped or a default changed on purpose is said in
the CHANGELOG for the boards that upgrade, and taken out of ``keys.json`` with it.
"""

from __future__ import annotations

import json
import os
import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from edged.config import Settings, load_config
from edged.errors import ConfigError

DATA = Path(__file__).parent / "data" / "upgrade" / "0.4.0"
SHIPPED = ("edged.toml", "demo.toml")
DEMO_MODEL = Path(__file__).parents[1] / "models" / "demo.onnx"
REQUIRED, COMPUTED = "(required)", "(computed)"  # a key without a default, one whose default is made when read
MACHINE_PATHS = ("model.path", "model.labels")  # where this checkout is: not what the file says


def _models(annotation: object) -> list[type[BaseModel]]:
    """The settings tables an annotation can hold, in order: through unions, tuples, lists, Annotated."""
    found: list[type[BaseModel]] = []
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            found.append(arg)
        elif arg is not annotation:
            found += [model for model in _models(arg) if model not in found]
    return found


def _default(field: FieldInfo) -> object:
    if field.is_required():
        return REQUIRED
    if field.default_factory is not None:
        return COMPUTED
    try:
        return json.loads(json.dumps(field.default))
    except TypeError:
        return repr(field.default)


def settings_keys(model: type[BaseModel], prefix: str = "", seen: tuple[type[BaseModel], ...] = ()) -> dict[str, object]:
    """Every key of ``model`` a configuration file can set, dotted, with its default; a camera
    kind's keys as ``source[KIND].KEY``."""
    keys: dict[str, object] = {}
    for name, field in model.model_fields.items():
        path = prefix + name
        keys[path] = _default(field)
        for table in _models(field.annotation):
            if table in seen:
                continue
            kind = table.model_fields.get("type") if not prefix and name == "source" else None
            keys.update(settings_keys(table, f"{path}[{kind.default}]." if kind else f"{path}.", (*seen, table)))
    return keys


def leaves(value: object, prefix: str = "") -> dict[str, object]:
    """Settings as ``model_dump(mode="json")`` gives them, one entry per value, dotted (lists by index)."""
    items: list[tuple[str, object]]
    if isinstance(value, dict):
        items = [(str(key), item) for key, item in value.items()]
    elif isinstance(value, list):
        items = [(str(i), item) for i, item in enumerate(value)]
    else:
        return {prefix: value}
    found: dict[str, object] = {prefix: {} if isinstance(value, dict) else []} if not value else {}
    for key, item in items:
        found.update(leaves(item, f"{prefix}.{key}" if prefix else str(key)))
    return found


@pytest.fixture(autouse=True)
def _as_the_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The files read as the board's service reads them, with systemd's folders, whatever this shell has set.
    Its runtime directory is /run/edged, where 0.4.0's socket is (missing here until a service ran)."""
    for name in ("STATE_DIRECTORY", "CACHE_DIRECTORY"):
        (tmp_path / name).mkdir()
        monkeypatch.setenv(name, str(tmp_path / name))
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    for name in [name for name in os.environ if name.startswith("EDGED_")]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize("name", SHIPPED)
def test_the_configuration_files_0_4_0_shipped_load_with_no_problem_but_the_files_this_machine_lacks(name: str) -> None:
    problems: list[str] = []
    try:
        load_config(DATA / name)
    except ConfigError as e:
        problems = e.problems
    for problem in problems:
        missing = re.search(r" file (/\S+) does not exist", problem)
        assert missing and not Path(missing[1]).exists(), problem


@pytest.mark.parametrize("name", SHIPPED)
def test_the_configuration_files_0_4_0_shipped_are_read_as_0_4_0_read_them(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDGED_MODEL__PATH", str(DEMO_MODEL))
    monkeypatch.setenv("EDGED_MODEL__LABELS", str(DEMO_MODEL.with_suffix(".labels")))
    read = leaves(load_config(DATA / name).model_dump(mode="json"))
    then = json.loads((DATA / "settings.json").read_text())[name]
    differ = {key: (value, read.get(key, "(no such key)")) for key, value in then.items() if read.get(key, ...) != value}
    assert not differ, f"{name}: the values 0.4.0 read, and what this edged reads (then, now): {differ}"


def test_every_key_0_4_0_read_is_still_read_with_the_default_it_had() -> None:
    known: dict[str, object] = json.loads((DATA / "keys.json").read_text())
    now = settings_keys(Settings)
    gone = sorted(set(known) - set(now))
    assert not gone, f"keys edged 0.4.0 read that this edged refuses (exit 78 on an upgraded board): {gone}"
    changed = {key: (default, now[key]) for key, default in known.items() if now[key] != default}
    assert not changed, f"defaults changed since 0.4.0 (then, now), each a change on every upgraded board: {changed}"
