"""The configuration reference, ``docs/configuration.md``, generated from the settings models.

The models are the one source of truth for every key: its type, default, bounds and description
are read from them here, so the reference cannot drift from what `edged.config.load_config`
accepts (a test compares the committed file with `reference_text`). ``edged config-reference``
prints it.
"""

from __future__ import annotations

import json
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from edged.config import ENV_PREFIX, Settings
from edged.settings.sources import KINDS, SourceBase

DISCRIMINATOR = "type"  # the key of [source] that picks the camera kind, and with it the other keys


def reference_text() -> str:
    """The whole reference as Markdown: an introduction, then every table and its keys in config order."""
    return "\n".join([*_introduction(), *_source_tables(), *_section_tables()]).rstrip("\n") + "\n"


# ---- the document -----------------------------------------------------------------------------


def _introduction() -> Iterator[str]:
    yield "# Configuration reference"
    yield ""
    yield (
        "<!-- Generated from the settings models by `edged config-reference --out docs/configuration.md`: "
        "edit the models' descriptions, not this file. -->"
    )
    yield ""
    yield (
        "edged reads one TOML file (`edged run --config PATH`, default `/etc/edged/edged.toml`; "
        "[config/edged.toml](../config/edged.toml) is an annotated example). Every table below is a "
        "`[section]` of that file, and every key is written as shown. An unknown key is an error, "
        "not a setting silently ignored; `edged check --config PATH` lists every problem at once."
    )
    yield ""
    yield (
        f"Relative paths are relative to the configuration file. Any key can be overridden by an "
        f"environment variable `{ENV_PREFIX}<SECTION>__<KEY>` (e.g. `{ENV_PREFIX}MODEL__CONF=0.4`; "
        "lists and tables as JSON). A key that is *not set* has no value in the file: the "
        "description says what edged does then."
    )
    yield ""
    yield "| table | what it holds |"
    yield "|---|---|"
    for name, field in Settings.model_fields.items():
        yield f"| [`{_table_header(name)}`](#{name}) | {_cell(_description(field))} |"
    yield ""


def _source_tables() -> Iterator[str]:
    field = Settings.model_fields["source"]
    default = ", ".join(f"`{camera.type}`" for camera in field.get_default(call_default_factory=True))
    yield "## source"
    yield ""
    yield (
        f"{_description(field)} Each camera has a `camera_id` of its own. `type` picks the camera kind: the "
        "keys every kind has come first, then each kind's own. A key of another kind is an error "
        f"naming the keys this kind has. Without any, edged runs one {default} camera."
    )
    yield ""
    yield "### Every camera kind"
    yield ""
    yield from _key_table(SourceBase, "source", kinds=True)
    for kind, model in KINDS.items():
        yield f"### `type = {json.dumps(kind)}`"
        yield ""
        own = [name for name in model.model_fields if name not in SourceBase.model_fields]
        yield from _key_table(model, "source", only=own)


def _section_tables() -> Iterator[str]:
    for name, field in Settings.model_fields.items():
        if name == "source":
            continue
        model = _models_in(field.annotation)[0]
        yield f"## {name}"
        yield ""
        presence = "Required." if field.is_required() else "Optional."
        yield f"`{_table_header(name)}`. {presence} {_description(field)}"
        yield ""
        yield from _key_table(model, name)


def _key_table(model: type[BaseModel], path: str, *, only: list[str] | None = None, kinds: bool = False) -> Iterator[str]:
    """The keys of ``model``'s table at ``path``, then the tables nested in it that have keys of their own."""
    nested: list[tuple[str, type[BaseModel], bool]] = []
    yield "| key | type | default | description |"
    yield "|---|---|---|---|"
    for name, field in model.model_fields.items():
        if only is not None and name not in only:
            continue
        if kinds and name == DISCRIMINATOR:
            kind_list = ", ".join(f'`"{kind}"`' for kind in KINDS)
            yield f"| `{name}` | one of {kind_list} | required | {_cell(_description(field))} |"
            continue
        for table in _models_in(field.annotation):
            if not _is_section(table):
                nested.append((name, table, get_origin(_bare(field.annotation)) in (list, tuple)))
        kind = _type_words(field.annotation, field.metadata, f"{path}.{name}")
        yield f"| `{name}` | {_cell(kind)} | {_cell(_default_words(field))} | {_cell(_description(field))} |"
    yield ""
    for name, table, many in nested:
        header = f"[[{path}.{name}]]" if many else f"[{path}.{name}]"
        yield f"#### `{header}`"
        yield ""
        yield from _key_table(table, f"{path}.{name}")


# ---- one key ----------------------------------------------------------------------------------


def _description(field: FieldInfo) -> str:
    return field.description or ""


def _table_header(name: str) -> str:
    return "[source] or [[source]]" if name == "source" else f"[{name}]"


def _sentence(doc: str) -> str:
    return " ".join(doc.split()).replace("``", "`")


def _cell(text: str) -> str:
    """Text fit for one cell of a Markdown table."""
    return " ".join(text.split()).replace("|", "\\|")


def _is_section(model: type[BaseModel]) -> bool:
    """Whether ``model`` is a top-level section of its own, documented there (a camera's ``inspect`` table)."""
    return any(model in _models_in(field.annotation) for field in Settings.model_fields.values())


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _bare(annotation: Any) -> Any:
    """``annotation`` without ``None`` and without its ``Annotated`` wrapper."""
    if get_origin(annotation) is Annotated:
        return _bare(get_args(annotation)[0])
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) in (Union, types.UnionType) and len(args) == 1:
        return _bare(args[0])
    return annotation


def _type_words(annotation: Any, metadata: list[Any], path: str) -> str:
    """What a key takes, in words: its type as written in TOML, then its bounds."""
    words = _words(annotation, path)
    bounds = _bounds(metadata, annotation)
    return f"{words}, {bounds}" if bounds else words


def _words(annotation: Any, path: str) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        base, *extra = args
        bounds = _bounds([m for item in extra for m in (item.metadata if isinstance(item, FieldInfo) else [item])], base)
        words = _words(base, path)
        return f"{words} ({bounds})" if bounds else words
    if origin in (Union, types.UnionType):
        choices = list(dict.fromkeys(_words(a, path) for a in args if a is not type(None)))
        return " or ".join(choices) if len(choices) < 3 else ", ".join(choices[:-1]) + " or " + choices[-1]
    if origin is Literal:
        return "one of " + ", ".join(f"`{_toml(a)}`" for a in args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"list of {_words(args[0], path)}"
    if origin is tuple:
        return "[" + ", ".join(_words(a, path) for a in args) + "]"
    if origin is list:
        item = args[0]
        if _models_in(item) and not _is_section(_models_in(item)[0]):
            return f"`[[{path}]]` tables"
        return f"list of {_words(item, path)}"
    if origin is dict:
        return f"table of {_words(args[0], path)} = {_words(args[1], path)}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if _is_section(annotation):
            section = next(name for name, f in Settings.model_fields.items() if annotation in _models_in(f.annotation))
            return f"a table with the keys of [`[{section}]`](#{section})"
        return f"a `[{path}]` table"
    return _SCALARS.get(annotation, getattr(annotation, "__name__", str(annotation)))


_SCALARS: dict[Any, str] = {bool: "true or false", int: "integer", float: "number", str: "string", Path: "path"}


def _bounds(metadata: list[Any], annotation: Any) -> str:
    """A key's constraints in words: ``above 0, at most 1``, ``1 to 64 characters``, a pattern."""
    words: list[str] = []
    lengths: dict[str, int] = {}
    for item in metadata:
        if isinstance(item, annotated_types.Gt):
            words.append(f"above {item.gt}")
        elif isinstance(item, annotated_types.Ge):
            words.append(f"at least {item.ge}")
        elif isinstance(item, annotated_types.Lt):
            words.append(f"below {item.lt}")
        elif isinstance(item, annotated_types.Le):
            words.append(f"at most {item.le}")
        elif isinstance(item, annotated_types.MinLen):
            lengths["min"] = item.min_length
        elif isinstance(item, annotated_types.MaxLen):
            lengths["max"] = item.max_length
        elif getattr(item, "pattern", None) is not None:
            words.append(f"matching `{item.pattern}`")
    if lengths:
        words.insert(0, _length(lengths.get("min"), lengths.get("max"), "character" if _bare(annotation) is str else "item"))
    return ", ".join(words)


def _length(low: int | None, high: int | None, unit: str) -> str:
    if low is not None and high is not None:
        span = f"{low} to {high}"
    else:
        span = f"at least {low}" if low is not None else f"at most {high}"
    return f"{span} {unit}{'' if span.endswith(' 1') else 's'}"


def _default_words(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    factory = field.default_factory
    if factory is not None and _computed_elsewhere(factory):
        return _sentence((factory.__doc__ or "").strip())
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "not set"
    return f"`{_toml(value)}`"


def _computed_elsewhere(factory: Callable[..., Any]) -> bool:
    """A named function (not a lambda or a type) whose docstring says how it computes a default from the
    machine: say how, not what it gave here. One without a docstring (a fixed list) shows its value."""
    named = not isinstance(factory, type) and getattr(factory, "__name__", "<lambda>") != "<lambda>"
    return named and bool((factory.__doc__ or "").strip())


def _toml(value: Any) -> str:
    """``value`` as it is written in a TOML file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))
    if isinstance(value, BaseModel):
        given = value.model_dump(exclude_defaults=True)
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in given.items()) + " }"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }" if value else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)
