"""Table-driven checks of scalar config fields: a field's rule sits in one table row next to its dataclass.

A rule's `problem(value)` says what is wrong with a value (None when it is fine); `check_fields`
turns the first problem into a `ConfigError` naming the field. A new field needs one row.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from voice_server.config.errors import fail, show


class Rule(ABC):
    @abstractmethod
    def problem(self, value: object) -> str | None:
        """What is wrong with `value`, or None when it is fine."""


@dataclass(frozen=True)
class Number(Rule):
    """An int or a finite float within bounds; `null` allowed only when `is_nullable` (it means auto/off)."""

    kind: type[int] | type[float]
    minimum: float | None = None
    maximum: float | None = None
    is_min_exclusive: bool = False
    is_nullable: bool = False

    def problem(self, value: object) -> str | None:
        if value is None and self.is_nullable:
            return None
        wrong = f"must be {self.describe()}, got {show(value)}"
        # NOTE: bool is an int subclass: `max_batch_size: true` must not read as 1.
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return wrong
        # NOTE: isfinite only for floats: a huge YAML int would overflow the conversion.
        if isinstance(value, float) and (self.kind is int or not math.isfinite(value)):
            return wrong
        if self.minimum is not None and (value < self.minimum or (self.is_min_exclusive and value == self.minimum)):
            return wrong
        if self.maximum is not None and value > self.maximum:
            return wrong
        return None

    def describe(self) -> str:
        noun = "an integer" if self.kind is int else "a number"
        lo = None if self.minimum is None else _bound(self.minimum)
        hi = None if self.maximum is None else _bound(self.maximum)
        if lo is not None and hi is not None:
            bounds = f" in {'(' if self.is_min_exclusive else '['}{lo}, {hi}]"
        elif lo is not None:
            bounds = f" {'>' if self.is_min_exclusive else '>='} {lo}"
        elif hi is not None:
            bounds = f" <= {hi}"
        else:
            bounds = ""
        return f"{noun}{bounds}{' or null (auto)' if self.is_nullable else ''}"


def _bound(value: float) -> str:
    """A bound as a person writes it: 1000000, not 1e+06; 0.5 as 0.5."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


@dataclass(frozen=True)
class Text(Rule):
    """A string, optionally matching `pattern` (described by `hint`); empty only when `is_empty_allowed`."""

    pattern: re.Pattern[str] | None = None
    hint: str = ""
    is_empty_allowed: bool = False

    def problem(self, value: object) -> str | None:
        if isinstance(value, str):
            if not value:
                return None if self.is_empty_allowed else f"must not be empty{self._hint()}"
            if self.pattern is None or self.pattern.match(value):
                return None
        return f"must be a string{self._hint()}, got {show(value)}"

    def _hint(self) -> str:
        return f" ({self.hint})" if self.hint else ""


@dataclass(frozen=True)
class Choice(Rule):
    options: tuple[str, ...]

    def problem(self, value: object) -> str | None:
        if isinstance(value, str) and value in self.options:
            return None
        return f"must be one of {', '.join(self.options)}, got {show(value)}"


@dataclass(frozen=True)
class Flag(Rule):
    def problem(self, value: object) -> str | None:
        return None if isinstance(value, bool) else f"must be true or false, got {show(value)}"


def read_arg(where: str, args: Mapping[str, Any], key: str, rule: Rule, default: Any) -> Any:
    """`args[key]` (`default` when absent) checked against `rule`: the one reader of a stage's
    `factory_args`, whose ConfigError names `factory_args.<key>` with the rule's own wording."""
    value = args.get(key, default)
    problem = rule.problem(value)
    if problem is not None:
        raise fail(where, f"factory_args.{key}", problem)
    return value


def check_fields(where: str, obj: object, rules: Mapping[str, Rule]) -> None:
    """Raise a ConfigError for the first field of `obj` (in table order) that breaks its rule."""
    for name, rule in rules.items():
        problem = rule.problem(getattr(obj, name))
        if problem is not None:
            raise fail(where, name, problem)
