"""edged.tools.reference: docs/configuration.md is generated from the settings models, current, complete,
and its defaults are what the models default to, written as a TOML file takes them."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic import BaseModel, TypeAdapter
from pydantic.fields import FieldInfo

from edged.config import ProviderConfig, Settings
from edged.settings.sources import KINDS, SourceBase
from edged.tools.reference import reference_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 on older boards
    import tomli as tomllib

pytestmark = pytest.mark.unit

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def _sections(text: str) -> dict[str, str]:
    """Each ``## section`` of the reference by name, with everything up to the next one."""
    parts = re.split(r"^## (\S+)\n", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _row(section: str, key: str, after: str = "") -> list[str]:
    """The cells of ``key``'s row, the first after ``after`` in the section's text."""
    text = section[section.index(after) :]
    line = next(line for line in text.splitlines() if line.startswith(f"| `{key}` |"))
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]


def test_the_committed_reference_is_current() -> None:
    assert REFERENCE.read_text() == reference_text(), "run `edged config-reference --out docs/configuration.md`"


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _keys_of(model: type[BaseModel], path: str) -> Iterator[tuple[str, FieldInfo]]:
    for name, field in model.model_fields.items():
        if not (model in KINDS.values() and name == "type"):  # the kind's name; SourceBase describes the key
            yield f"{path}.{name}", field
        for nested in _models_in(field.annotation):
            if nested not in _sections_models():  # a camera's [source.inspect]: the keys of [inspect]
                yield from _keys_of(nested, f"{path}.{name}")


def _sections_models() -> set[type[BaseModel]]:
    return {model for field in Settings.model_fields.values() for model in _models_in(field.annotation)}


def every_key() -> Iterator[tuple[str, FieldInfo]]:
    """Every key of the configuration, as ``section.key`` (a camera kind's as ``source.key``), nested ones too."""
    for name, field in Settings.model_fields.items():
        yield name, field
        for model in [SourceBase, *KINDS.values()] if name == "source" else _models_in(field.annotation):
            yield from _keys_of(model, name)


def test_every_setting_has_a_description() -> None:
    missing = [key for key, field in every_key() if not (field.description or "").strip()]
    assert missing == []


def test_every_key_of_every_section_and_camera_kind_has_a_row_in_its_section() -> None:
    sections = _sections(reference_text())
    keys = [key for key, _ in every_key() if "." in key]
    assert {"source.camera_id", "source.url", "source.pipeline", "runtime.providers.name", "mqtt.url"} <= set(keys)
    assert set(sections) == set(Settings.model_fields)
    for key in keys:
        section, leaf = key.split(".")[0], key.split(".")[-1]
        assert f"| `{leaf}` |" in sections[section], key
    for kind, model in KINDS.items():  # each kind's own keys under its own heading
        for name in set(model.model_fields) - set(SourceBase.model_fields):
            _row(sections["source"], name, after=f'### `type = "{kind}"`')


def test_types_bounds_and_requirement_are_said_in_words() -> None:
    sections = _sections(reference_text())
    assert _row(sections["model"], "conf")[1:3] == ["number, above 0, at most 1", "`0.25`"]
    assert _row(sections["model"], "path")[1:3] == ["path", "required"]
    assert _row(sections["model"], "labels")[2] == "not set"
    assert _row(sections["mqtt"], "qos_events")[1] == "one of `0`, `1`, `2`"
    assert _row(sections["source"], "camera_id")[1] == "string, 1 to 64 characters, matching `^[A-Za-z0-9_.-]+$`"
    assert _row(sections["source"], "type")[1:3] == [
        "one of " + ", ".join(f'`"{kind}"`' for kind in KINDS),
        "required",
    ]
    assert _row(sections["runtime"], "providers")[1] == "`[[runtime.providers]]` tables, at least 1 item"
    assert "#### `[[runtime.providers]]`" in sections["runtime"]
    assert _row(sections["source"], "inspect")[1] == "a table with the keys of [`[inspect]`](#inspect)"
    assert "`[model]`. Required." in sections["model"] and "`[mqtt]`. Optional." in sections["mqtt"]


def test_a_default_computed_on_the_board_is_described_not_taken_from_this_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    here = reference_text()
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/elsewhere")
    assert reference_text() == here
    assert _row(_sections(here)["evidence"], "dir")[2].startswith("`evidence/` in the service's state directory")


def _tables() -> list[tuple[str, str, dict[str, FieldInfo]]]:
    """Each table of keys in the reference: its section, the heading it follows, and its keys' fields."""
    tables = [("source", "### Every camera kind", {k: f for k, f in SourceBase.model_fields.items() if k != "type"})]
    for kind, model in KINDS.items():
        own = {k: f for k, f in model.model_fields.items() if k not in SourceBase.model_fields}
        tables.append(("source", f'### `type = "{kind}"`', own))
    for name, field in Settings.model_fields.items():
        section = [a for a in (field.annotation, *get_args(field.annotation)) if isinstance(a, type)]
        tables += [(name, "", a.model_fields) for a in section if issubclass(a, BaseModel)]
    tables.append(("runtime", "#### `[[runtime.providers]]`", ProviderConfig.model_fields))
    return tables


def test_every_default_shown_is_toml_that_reads_back_as_the_models_default() -> None:
    sections = _sections(reference_text())
    checked = 0
    for section, heading, fields in _tables():
        for name, field in fields.items():
            shown = _row(sections[section], name, after=heading)[2]
            assert shown, f"{section}.{name}: no default shown"
            if not re.fullmatch(r"`[^`]+`", shown):  # required, not set, or computed on the board
                continue
            value = tomllib.loads(f"v = {shown.strip('`')}")["v"]
            default = field.get_default(call_default_factory=True)
            assert TypeAdapter(field.annotation).validate_python(value) == default, f"{section}.{name}: {shown}"
            checked += 1
    assert checked > 80
