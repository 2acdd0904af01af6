"""The config loader: YAML in, typed dataclasses out, every bad key named.

A config is data (torchtitan style): one dataclass per section, kept beside the code it configures
(corpus/config.py, dedup/config.py, screen/config.py, train/config.py; Ray's and MLflow's in
core/ray_session.py and core/tracking.py), composed into the pipeline's config where the stages are
declared (pipelines/config.py). This module knows none of them: it walks the type hints of whatever
dataclass it is given. Anything a user can get wrong (an unknown key, a wrong type, a value out of range,
a path that matches nothing) raises `ConfigError` with the dotted key and what was expected, which the
CLI turns into exit code 2. `--set a.b=c` overrides go through the same validator, typed by the field
they target. A section checks what it can know by itself in `validate(key)`, which `from_dict` calls as
it builds it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Literal, Sequence, TypeVar

import yaml

from core import storage

Config = TypeVar("Config")


class ConfigError(ValueError):
    """A bad config value; str() is the one line the user sees."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config key '{key}': {message}" if key else message)


def at_least(section: object, key: str, low: float, *names: str) -> None:
    """Each named field of `section` must be >= low (None allowed: 'use the default')."""
    for name in names:
        value = getattr(section, name)
        if value is not None and value < low:
            raise ConfigError(f"{key}.{name}", f"expected a value >= {low}, got {value}")


def positive(section: object, key: str, *names: str) -> None:
    """Each named field of `section` must be > 0 (None allowed: 'use the default')."""
    for name in names:
        value = getattr(section, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{key}.{name}", f"expected a positive number, got {value}")


def no_credentials(section: object, key: str, *names: str) -> None:
    """Each named field of `section` (a URI or a path, or a list of them) must hold no credential (uri_secret): a
    config is copied into MLflow params, manifests and reject rows. The message does not repeat the value."""
    for name in names:
        value = getattr(section, name)
        for i, uri in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(uri, str) and (problem := uri_secret(uri)):
                where = _join(key, name) + (f"[{i}]" if isinstance(value, list) else "")
                raise ConfigError(where, f"a URI with {problem}: give credentials through the environment or the "
                                  "cloud's own configuration (an instance role, ~/.aws), never in the config, which "
                                  "is copied into MLflow and the run's records")


# Azure's file systems name the container before the `@` (abfs://container@account.dfs.core.windows.net/...).
AZURE_CONTAINER_SCHEMES = ("abfs", "abfss", "wasb", "wasbs")
# Query-string names that carry a secret: a SAS token's `sig`, a presigned URL's X-Amz-Signature, X-Amz-Credential
# and X-Amz-Security-Token (X-Goog-* alike), an OAuth `client_secret` or `access_token`, a password, an API key.
SECRET_PARAM = re.compile(r"^sig$|signature|secret|passw|token|credential|key", re.IGNORECASE)


def uri_secret(uri: str) -> str | None:
    """What credential `uri` holds, said without repeating it ("a user or password in it", "a secret in its query
    string ('sig')"), or None. A path holds none; nor does Azure's `container@account` host."""
    if not storage.is_uri(uri):
        return None
    scheme, rest = uri.split("://", 1)
    user, at, _ = re.split(r"[/?#]", rest, maxsplit=1)[0].rpartition("@")
    if at and (":" in user or scheme.lower() not in AZURE_CONTAINER_SCHEMES):
        return "a user or password in it"
    query = rest.partition("?")[2].partition("#")[0]
    for name, _ in urllib.parse.parse_qsl(query):  # `name=value` pairs only: a glob's `?` is no query
        if SECRET_PARAM.search(name):
            return f"a secret in its query string ({name!r})"
    return None


# --------------------------------------------------------------------------- loading


def load(schema: type[Config], path: str | os.PathLike, overrides: Sequence[str] = (),
         checks: Sequence[Callable[[Config], None]] = ()) -> Config:
    """Read YAML into `schema`: the file's name as `name` unless it sets one, `--set key=value` overrides,
    every section validated, then `checks` (rules across sections: each raises ConfigError), then the
    config's own `resolve_paths()`, if it has one."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("", f"config file {str(path)!r} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError("", f"config file {str(path)!r} is not valid YAML: {' '.join(str(exc).split())}") from exc
    if not isinstance(raw, dict):
        raise ConfigError("", f"config file {str(path)!r} must be a mapping of sections, got {type(raw).__name__}")
    if "name" in typing.get_type_hints(schema):
        raw.setdefault("name", path.stem)
    for item in overrides:
        apply_override(schema, raw, item)
    config = from_dict(schema, raw, "")
    for check in checks:
        check(config)
    if hasattr(config, "resolve_paths"):
        config.resolve_paths()
    return config


def apply_override(schema: type, raw: dict, item: str) -> None:
    """`a.b.c=value` (or `sources.0.paths=[...]`): value typed by the field it targets."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError("", f"--set expects dotted.key=value, got {item!r}")
    parts = key.split(".")
    target_type = _type_at(schema, parts, key)
    if _is_str_type(target_type):
        value: Any = text  # verbatim: `--set mlflow.experiment=2024` stays a string
    else:
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            raise ConfigError(key, f"--set value {text!r} is not a valid YAML value") from None
    node: Any = raw
    for depth, part in enumerate(parts[:-1]):
        here = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            node = node[_list_index(part, node, here)]
            continue
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, (dict, list)):
            raise ConfigError(here, f"expected a mapping, got {_describe(node)}")
    last = parts[-1]
    if isinstance(node, list):
        node[_list_index(last, node, key)] = value
    else:
        node[last] = value


def _list_index(part: str, node: list, key: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(key, f"expected a list index below {len(node)}, got {part!r}")
    return int(part)


def _type_at(cls: type, parts: list[str], key: str) -> Any:
    """The declared type at a dotted path, so that unknown keys fail before anything is set."""
    tp: Any = cls
    for depth, part in enumerate(parts):
        here = ".".join(parts[: depth + 1])
        tp = _strip_optional(tp)
        if dataclasses.is_dataclass(tp):
            hints = typing.get_type_hints(tp)
            if part not in hints:
                raise ConfigError(here, f"unknown key; expected one of: {', '.join(hints)}")
            tp = hints[part]
        elif typing.get_origin(tp) is list:
            if not part.isdigit():
                raise ConfigError(here, "expected a list index")
            tp = typing.get_args(tp)[0]
        else:
            raise ConfigError(here, f"cannot set a key inside a value of type {_type_name(tp)}")
    return tp


def _strip_optional(tp: Any) -> Any:
    args = typing.get_args(tp)
    if _is_union(tp) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return tp


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _is_str_type(tp: Any) -> bool:
    return _strip_optional(tp) is str


def _type_name(tp: Any) -> str:
    if _is_union(tp):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, getattr(tp, "__name__", str(tp)))


def from_dict(tp: Any, value: Any, key: str) -> Any:
    """Build `tp` from YAML data, checking every type; errors name the dotted key."""
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return from_dict(arg, value, key)
            except ConfigError as exc:
                errors.append(exc)
        nested = [e for e in errors if e.key != key]
        if len(errors) == 1 and nested:  # Optional[section]: the error inside the section is the useful one
            raise errors[0]
        raise ConfigError(key, f"expected {_type_name(tp)}, got {_describe(value)}")
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(key, f"expected {_type_name(tp)}, got {_describe(value)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, f"expected {_type_name(tp)}, got {_describe(value)}")
        (item_tp,) = typing.get_args(tp)
        return [from_dict(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {_describe(value)}")
        hints = typing.get_type_hints(tp)
        for k in value:
            if k not in hints:
                raise ConfigError(_join(key, str(k)), f"unknown key; expected one of: {', '.join(hints)}")
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in value:
                kwargs[f.name] = from_dict(hints[f.name], value[f.name], _join(key, f.name))
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(_join(key, f.name), f"missing; expected {_type_name(hints[f.name])}")
        obj = tp(**kwargs)
        if hasattr(obj, "validate"):
            obj.validate(key)
        return obj
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):  # YAML 1.1 reads 3e-4 as a string
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp in (str, bool):
        if isinstance(value, tp):
            return value
    else:  # pragma: no cover - a type this loader does not know is a bug in the dataclasses
        raise TypeError(f"unsupported config type {tp!r} at {key}")
    raise ConfigError(key, f"expected {_type_name(tp)}, got {_describe(value)}")


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({'null' if value is None else type(value).__name__})"


def local_path(path: str, key: str) -> str:
    """`path` made absolute (a `file://` URI of a folder made a path); what core/storage.py refuses, a ConfigError."""
    try:
        return storage.local_path(path)
    except ValueError as exc:
        raise ConfigError(key, str(exc)) from None


# A field's metadata that makes it a section of its own stage: left out of its parent's section_dict, so that the
# stages keyed on the parent do not rerun when only it changes (eval.downstream: the downstream stage's).
KEYED_APART = "keyed_apart"
# A field's metadata that makes it part of how a stage is laid out on the machines, not of what it computes (the
# workers, their CPUs and GPUs, the micro-batch): left out of the fingerprint, so that a run goes on under another
# layout (train/checkpoint_files.py loads its checkpoints into it) and a finished one is not redone for a new one.
LAYOUT = "layout"


def section_of(config: Any, name: str) -> Any:
    """A config section by name; a dotted name is a section inside one (`eval.downstream`)."""
    value = config
    for part in name.split("."):
        value = getattr(value, part)
    return value


def section_dict(config: Any, section: str | tuple[str, ...], layout: bool = False) -> Any:
    """A config section (or several, by name) as plain data: what fingerprints are made of, and with `layout` the
    fields marked LAYOUT too (MLflow's params, the manifest). The fields marked KEYED_APART are not in it: they are
    sections of their own (section_dict(config, "eval.downstream"))."""
    if isinstance(section, tuple):
        return {name: section_dict(config, name, layout) for name in section}
    value = section_of(config, section)
    if isinstance(value, list):
        return [dataclasses.asdict(v) for v in value]
    return _without(value, dataclasses.asdict(value), layout)


def _without(value: Any, out: dict, layout: bool) -> dict:
    """`out`, the dict of dataclass `value`, less its KEYED_APART fields and (unless `layout`) its LAYOUT fields, at
    every depth: a proxy run's workers (screen.proxy.num_workers) are as much a layout as the training's."""
    for f in dataclasses.fields(value):
        if f.metadata.get(KEYED_APART) or (f.metadata.get(LAYOUT) and not layout):
            del out[f.name]
        elif dataclasses.is_dataclass(inner := getattr(value, f.name)):
            _without(inner, out[f.name], layout)
    return out
