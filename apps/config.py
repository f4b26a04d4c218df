"""Configuration for the apps: a dataclass of defaults, overridden by YAML, overridden by --key=value.

Each app defines one ``@dataclass`` with a comment on every field. ``load_config`` resolves it:

    defaults (the dataclass)  <  YAML file (--config=path.yaml)  <  --key=value on the command line

Unknown keys are an error that names the key and lists the valid ones, so a typo never silently
falls back to a default. ``save_config`` writes the resolved config next to a checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

C = TypeVar("C")


class ConfigError(ValueError):
    """A config file or command-line override that does not fit the config dataclass."""


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    """Convert a YAML or command-line value to the field's declared type."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(name, value, inner[0])
    if origin in (list, tuple, Sequence):
        given = value
        if isinstance(value, str):  # 2,2 or YAML's [2, 2] (or (2, 2))
            value = [v.strip() for v in value.strip().strip("[]()").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            value = [value]  # YAML's `balance: 4` for a one-stage list
        item_type = args[0] if args else str
        try:
            items = [_coerce(name, v, item_type) for v in value]
        except ConfigError as error:
            form = "; give a list as 2,2 or [2, 2]" if "is not a valid" in str(error) else ""
            said = str(error).removesuffix("; give a whole number").removesuffix("; give a number")
            raise ConfigError(f"{said} (in {name}={given!r}){form}") from None
        return tuple(items) if origin is tuple else items
    if annotation is bool:
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}={value!r} is not a boolean; use true or false")
    if annotation is int:
        return _integer(name, value)
    if annotation in (float, str):
        if annotation is float and isinstance(value, bool):  # YAML's `lr: true`
            raise ConfigError(f"{name}={value!r} is not a valid float; give a number")
        try:
            result = annotation(value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ConfigError(
                f"{name}={value!r} is not a valid {annotation.__name__}; give a number"
            ) from exc
        if annotation is float:
            check_finite(name, result)
        return result
    return value


def _integer(name: str, value: Any) -> int:
    """An integer option's value: a whole number, also written ``2e3`` or ``2.0``; a fraction
    (``2.5``, ``2.5e0``, ``1e-3``), NaN, infinity or a boolean is an error, never truncated
    (``int(float("1e-3"))`` is 0, which means "no cap" for max_steps)."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is not a valid int (a boolean); give a whole number")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        number = value
    else:
        text = str(value).strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            raise ConfigError(f"{name}={value!r} is not a valid int; give a whole number") from None
    if not math.isfinite(number):
        raise ConfigError(f"{name}={value!r} is not a valid int (not a finite number); give a "
                          "whole number")
    if not number.is_integer():
        # the nearest whole numbers, but not 0 for a positive fraction (0 often means "none")
        near = [n for n in (math.floor(number), math.ceil(number)) if number <= 0 or n > 0]
        raise ConfigError(
            f"{name}={value!r} is not a whole number; give an integer such as "
            f"{' or '.join(map(str, near))}"
        )
    return int(number)


def check_finite(name: str, value: float) -> None:
    """ConfigError unless ``value`` is a finite number: every float option of the apps passes
    here (``_coerce``, by the dataclass field's type, and the scripts' own float flags), because
    NaN compares false with every bound a ``validate()`` checks (``nan <= 0`` is False) and so
    would slip through to a traceback, or silently switch a feature off (``clip_norm=nan``)."""
    if not math.isfinite(value):
        raise ConfigError(f"{name}={value} is not a finite number; give a finite value")


def _off(value: Any) -> bool:
    """Whether a retired key's value is its old 'off' (0, 0.0, "0", empty): nothing to refuse."""
    if value is None or value is False or value == "":
        return True
    try:
        return float(value) == 0.0
    except (TypeError, ValueError):
        return False


def _refuse_retired(cls: type, updates: dict[str, Any], source: str) -> dict[str, Any]:
    """``updates`` without the retired keys at their old 'off' value (a config saved before they
    retired still loads); ConfigError naming what replaces a retired key that is set.

    A config dataclass lists its retired keys as ``RETIRED: ClassVar[dict[str, str]]``, each
    with the sentence that says what to give instead."""
    retired: dict[str, str] = getattr(cls, "RETIRED", {})
    for key in sorted(set(updates) & set(retired)):
        if not _off(updates[key]):
            raise ConfigError(f"{key}={updates[key]} in {source} is no longer a setting: "
                              f"{retired[key]}")
    return {k: v for k, v in updates.items() if k not in retired}


def _apply(config: C, updates: dict[str, Any], source: str) -> C:
    updates = _refuse_retired(type(config), updates, source)
    types_by_name = _field_types(type(config))
    unknown = sorted(set(updates) - set(types_by_name))
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {unknown} in {source}; valid keys: {sorted(types_by_name)}"
        )
    coerced = {k: _coerce(k, v, types_by_name[k]) for k, v in updates.items()}
    return dataclasses.replace(config, **coerced)  # type: ignore[type-var]


def parse_overrides(argv: Sequence[str]) -> tuple[str | None, dict[str, str]]:
    """Split ``--config=path`` and ``--key=value`` arguments; ``--key value`` is accepted too."""
    config_path: str | None = None
    overrides: dict[str, str] = {}
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; use --key=value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, value = arg[2:], args[i + 1]
            i += 1
        else:  # a bare flag means true
            key, value = arg[2:], "true"
        key = key.replace("-", "_")
        if key == "config":
            config_path = value
        else:
            overrides[key] = value
        i += 1
    return config_path, overrides


def load_config(cls: type[C], argv: Sequence[str] = (), yaml_path: str | Path | None = None) -> C:
    """Resolve ``cls`` defaults < YAML < ``--key=value`` overrides; unknown keys raise ConfigError."""
    config = cls()
    cli_path, overrides = parse_overrides(argv)
    path = cli_path or yaml_path
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            detail = " ".join(str(exc).split())
            raise ConfigError(f"config file {path} is not valid YAML: {detail}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a mapping of key: value, got {type(data).__name__}")
        config = _apply(config, data, str(path))
    return _apply(config, overrides, "command-line overrides")


def config_yaml(config: Any) -> str:
    """The resolved config as YAML text (loadable again with ``--config=path``)."""
    return yaml.safe_dump(dataclasses.asdict(config), sort_keys=False)


def save_config(config: Any, path: str | Path) -> None:
    """Write the resolved config as YAML, atomically (loadable again with ``--config=path``)."""
    from gpipe_core.storage import write_atomic

    write_atomic(path, config_yaml(config))
