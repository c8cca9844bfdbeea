"""One reader for Hugging Face `config.json` fields, shared by every model config.

The default policy, the same for every field: a key that is missing or null takes the caller's
default; a field read without a default is required, and a missing or null key is an error. Every
value is type-checked (an int field takes an int, not a bool or a string; a float field takes an int
or a float; a tuple field takes a JSON list), and an error is an `HFConfigError` (a `ValueError`) that
names the file and section, and the field: "config.json talker_config.text_config: num_attention_heads
is required". No value is coerced from another type, so what reaches a dataclass is what the file says.

Shared rules on top of the fields:
- RoPE (`read_rope`): transformers 5 writes `rope_parameters` (with `rope_theta` inside); older files
  write a top-level `rope_theta` plus an optional `rope_scaling` dict. `rope_parameters` wins over
  `rope_scaling`; a theta inside the dict wins over the top-level one; the type comes from `rope_type`
  (or the legacy `type`) and defaults to "default". The Qwen3-Omni `interleaved` flag is not read:
  transformers ignores it too and always interleaves the M-RoPE sections.
- `head_dim` (`read_head_dim`): when missing or null it is `hidden_size // num_attention_heads`.
- Positive values: `read_int(..., positive=True)` when reading, `check_positive` on a built config.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Collection, Mapping
from typing import Any, Final, TypeVar, Union

_C = TypeVar("_C")


class HFConfigError(ValueError):
    """A config.json field is missing, null where required, of the wrong type, or out of range."""


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Final = _Required()


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def as_section(d: Mapping[str, Any] | HFSection | None, path: str) -> HFSection:
    """`d` itself if it is already a section (it knows where it came from), else the section at `path`
    of a config.json (e.g. "talker_config.text_config"; "" for the file itself)."""
    return d if isinstance(d, HFSection) else HFSection(d, path=path)


class HFSection:
    """One dict of a config.json (the file itself or a nested `*_config` block), named for errors.

    `file` names the file (a path, or "config.json" when the dict came from elsewhere), `path` the
    section in it ("" for the top level, else e.g. "talker_config.text_config"); errors start with
    `where`, e.g. "config.json talker_config.text_config: ...".
    """

    def __init__(self, d: Mapping[str, Any] | None, file: str = "config.json", path: str = "") -> None:
        self.file, self.path = file, path
        self.where = f"{file} {path}" if path else file
        if d is not None and not isinstance(d, Mapping):
            raise HFConfigError(f"{self.where}: expected an object, got {_type_name(d)}")
        self.d: Mapping[str, Any] = d or {}

    def sub(self, key: str) -> HFSection:
        """The nested dict under `key` (missing or null: an empty section, so its fields default)."""
        path = f"{self.path}.{key}" if self.path else key
        return HFSection(self.d.get(key), self.file, path)

    def has(self, key: str) -> bool:
        """Whether `key` is present and not null (the policy's "given")."""
        return self.d.get(key) is not None

    def error(self, key: str, message: str) -> HFConfigError:
        return HFConfigError(f"{self.where}: {key} {message}")

    def _raw(self, key: str, default: object, aliases: tuple[str, ...] = ()) -> tuple[str, Any]:
        for name in (key, *aliases):
            if self.d.get(name) is not None:
                return name, self.d[name]
        if isinstance(default, _Required):
            spelled = " or ".join((key, *aliases))
            raise self.error(spelled, "is required" + (" (null given)" if key in self.d else ""))
        return key, default

    def read_int(
        self, key: str, default: int | _Required = REQUIRED, *, positive: bool = False, aliases: tuple[str, ...] = ()
    ) -> int:
        name, value = self._raw(key, default, aliases)
        if not _is_int(value):
            raise self.error(name, f"must be an int, got {_type_name(value)} {value!r}")
        if positive and value <= 0:
            raise self.error(name, f"must be > 0, got {value}")
        return int(value)

    def read_opt_int(self, key: str, *, positive: bool = False) -> int | None:
        """An int that may be absent (missing or null: None)."""
        return self.read_int(key, positive=positive) if self.has(key) else None

    def read_float(self, key: str, default: float | _Required = REQUIRED, *, positive: bool = False) -> float:
        name, value = self._raw(key, default)
        if not _is_number(value):
            raise self.error(name, f"must be a number, got {_type_name(value)} {value!r}")
        if positive and value <= 0:
            raise self.error(name, f"must be > 0, got {value}")
        return float(value)

    def read_bool(self, key: str, default: bool | _Required = REQUIRED) -> bool:
        name, value = self._raw(key, default)
        if not isinstance(value, bool):
            raise self.error(name, f"must be true or false, got {_type_name(value)} {value!r}")
        return value

    def read_str(
        self, key: str, default: str | _Required = REQUIRED, *, choices: Collection[str] | None = None
    ) -> str:
        name, value = self._raw(key, default)
        if not isinstance(value, str):
            raise self.error(name, f"must be a string, got {_type_name(value)} {value!r}")
        if choices is not None and value not in choices:
            raise self.error(name, f"is {value!r}, not one of {tuple(choices)}")
        return value

    def read_int_tuple(
        self, key: str, default: tuple[int, ...] | _Required = REQUIRED, *, length: int | None = None
    ) -> tuple[int, ...]:
        name, value = self._raw(key, default)
        if not isinstance(value, list | tuple) or not all(_is_int(v) for v in value):
            raise self.error(name, f"must be a list of ints, got {value!r}")
        if length is not None and len(value) != length:
            raise self.error(name, f"must have {length} entries, got {list(value)}")
        return tuple(int(v) for v in value)

    def read_str_tuple(self, key: str, default: tuple[str, ...] | _Required = REQUIRED) -> tuple[str, ...]:
        name, value = self._raw(key, default)
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise self.error(name, f"must be a list of strings, got {value!r}")
        return tuple(value)

    def read_int_map(self, key: str, default: Mapping[str, int] | _Required = REQUIRED) -> dict[str, int]:
        """A JSON object of ints, e.g. `speaker_id`."""
        name, value = self._raw(key, default)
        if not isinstance(value, Mapping) or not all(_is_int(v) for v in value.values()):
            raise self.error(name, f"must be an object of ints, got {value!r}")
        return {str(k): int(v) for k, v in value.items()}

    def read_fields(self, cls: type[_C], *, exclude: Collection[str] = ()) -> dict[str, Any]:
        """Every field of dataclass `cls` that this section gives, type-checked by the field's
        annotation (lists become tuples); a missing or null key is left out, so the dataclass default
        applies. For configs whose defaults live in the dataclass (the released model's values)."""
        hints = typing.get_type_hints(cls)
        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name in exclude or not self.has(f.name):
                continue
            out[f.name] = self._read_typed(f.name, hints[f.name])
        return out

    def _read_typed(self, key: str, hint: Any) -> Any:
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin in (Union, types.UnionType):
            inner = [a for a in args if a is not type(None)]
            if len(inner) == 1:
                return self._read_typed(key, inner[0])  # null never gets here: it means "not given"
        if hint is int:
            return self.read_int(key)
        if hint is float:
            return self.read_float(key)
        if hint is bool:
            return self.read_bool(key)
        if hint is str:
            return self.read_str(key)
        if origin is tuple and args:
            length = None if args[-1] is Ellipsis else len(args)
            if args[0] is int:
                return self.read_int_tuple(key, length=length)
            if args[0] is str:
                return self.read_str_tuple(key)
        raise TypeError(f"hf_config cannot read a field of type {hint!r} ({key})")


@dataclasses.dataclass(frozen=True)
class RopeParams:
    """RoPE settings of one decoder, from either spelling (see the module note)."""

    theta: float
    rope_type: str
    # The rest of the rope dict (llama3 factors, mrope_section, ...), for `read_*` with defaults.
    params: HFSection

    @property
    def mrope_section(self) -> tuple[int, ...] | None:
        return self.params.read_int_tuple("mrope_section") if self.params.has("mrope_section") else None


def read_rope(
    section: HFSection, default_theta: float, *, rope_types: Collection[str] | None = ("default",)
) -> RopeParams:
    """`rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (older), see the module note.

    `rope_types` are the types the model implements (None: not checked)."""
    # NOTE: an empty `rope_parameters` dict falls through to `rope_scaling`, as transformers reads it.
    key = "rope_parameters" if section.d.get("rope_parameters") else "rope_scaling"
    params = section.sub(key)
    theta = params.read_float("rope_theta") if params.has("rope_theta") else section.read_float(
        "rope_theta", default_theta
    )
    if theta <= 0:
        raise section.error("rope_theta", f"must be > 0, got {theta}")
    rope_type = params.read_str("rope_type", params.read_str("type", "default"))
    if rope_types is not None and rope_type not in rope_types:
        raise params.error("rope_type", f"{rope_type!r} is not supported (only {tuple(rope_types)})")
    return RopeParams(theta, rope_type, params)


def read_head_dim(section: HFSection, hidden_size: int, num_attention_heads: int) -> int:
    """`head_dim` when given (and > 0), else `hidden_size // num_attention_heads` as transformers does."""
    if section.has("head_dim"):
        return section.read_int("head_dim", positive=True)
    return hidden_size // num_attention_heads


def check_positive(obj: object, *names: str, integer: bool = False) -> None:
    """For a built config's `__post_init__`: each named attribute must be a number > 0 (an int with
    `integer`); the error names the class and the attribute."""
    for name in names:
        value = getattr(obj, name)
        if not (_is_int(value) if integer else _is_number(value)) or value <= 0:
            kind = "a positive int" if integer else "> 0"
            raise ValueError(f"{type(obj).__name__}.{name} must be {kind}, got {value!r}")
