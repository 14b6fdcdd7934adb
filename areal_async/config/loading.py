"""From YAML and ``key=value`` overrides to a validated ``ExperimentConfig``, and back to YAML.

Loading only turns plain data into sections: it refuses unknown keys, reads the YAML quirks
(``1e-3`` without a dot is a string to PyYAML), and builds each section from the inside out,
so every section's own checks run on the final values and their errors get the dotted path.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from areal_async.config.base import ConfigError, field_types, keys_under, optional_of, unread_note
from areal_async.config.experiment import ExperimentConfig


def _from_yaml(key: str, value: Any, tp: Any, base: Any) -> Any:
    """The field value for YAML ``value``: nested sections built on ``base``; types are checked by the section."""
    tp = optional_of(tp) or tp
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: expected a mapping of {tp.__name__} fields")
        return _build(tp, value, key + ".", base)
    if tp is float and isinstance(value, str):  # PyYAML reads "1e-3" (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _build(cls: type, data: dict, prefix: str = "", base: Any = None) -> Any:
    """``cls`` from a mapping of its fields; fields not given keep ``base``'s values (or the defaults)."""
    types = field_types(cls)
    unknown = sorted(set(data) - set(types))
    if unknown:
        known = ", ".join(sorted(types))
        raise ConfigError(f"unknown config key '{prefix}{unknown[0]}' (known in this section: {known})")
    base = base if base is not None else cls()  # partial sections keep the parent's defaults
    values = {k: _from_yaml(prefix + k, v, types[k], getattr(base, k)) for k, v in data.items()}
    with keys_under(prefix):
        return dataclasses.replace(base, **values)


def parse_override(text: str) -> tuple[list[str], Any]:
    """'a.b.c=value' -> (['a','b','c'], parsed YAML value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected dotted key=value, e.g. rollout.max_head_offpolicyness=0")
    key, raw = text.split("=", 1)
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key part")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({e})") from e
    return key.split("."), value


def _set_dotted(data: dict, parts: list[str], value: Any) -> None:
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {'.'.join(parts)}: '{p}' is not a section")
    node[parts[-1]] = value


def from_dict(data: dict, overrides: list[str] = ()) -> ExperimentConfig:
    """An ExperimentConfig from plain data (a parsed preset) with dotted overrides applied on top."""
    data = yaml.safe_load(yaml.safe_dump(dict(data or {})))  # deep copy of plain data
    for text in overrides:
        parts, value = parse_override(text)
        _set_dotted(data, parts, value)
    return _build(ExperimentConfig, data)


def load_config(path: str | Path, overrides: list[str] = ()) -> ExperimentConfig:
    """Read a YAML preset, apply dotted overrides, validate."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r}: expected a mapping at the top level")
    return from_dict(data, overrides)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: ExperimentConfig, changed_only: bool = False) -> str:
    """The config as YAML; ``changed_only``: only the keys whose values differ from the defaults (what a
    user would have written: the preflight reads every key a file sets as set on purpose)."""
    data = to_dict(cfg)
    return yaml.safe_dump(_changed(data, to_dict(ExperimentConfig())) if changed_only else data, sort_keys=False)


def _changed(data: dict, default: dict) -> dict:
    out = {}
    for k, v in data.items():
        d = default.get(k)
        if isinstance(v, dict) and isinstance(d, dict):
            v = _changed(v, d)
            if v:
                out[k] = v
        elif v != d:
            out[k] = v
    return out


def describe(cls: type = ExperimentConfig, prefix: str = "", note: str = "") -> list[tuple[str, str]]:
    """(dotted key, help) for every leaf field: the reference of all knobs. ``note`` ends every help text."""
    out = []
    for f in dataclasses.fields(cls):
        tp = field_types(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            by = f.metadata.get("unread_by")
            out += describe(tp, prefix + f.name + ".", note or (unread_note(by) if by else ""))
        else:
            out.append((prefix + f.name, f.metadata.get("help", "") + note))
    return out
