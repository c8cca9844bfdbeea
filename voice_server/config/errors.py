"""The one error type of config checking, and the one way its messages are phrased."""

from __future__ import annotations


class ConfigError(ValueError):
    """A pipeline config that cannot run; the message names the offending stage and field."""


def fail(where: str, field_name: object, why: str) -> ConfigError:
    """`stage 'x': field 'y': why`: the shape of every validation message."""
    return ConfigError(f"{where}: field {quoted(field_name)}: {why}")


def quoted(name: object, max_len: int = 64) -> str:
    """'name' for a short printable string (stage names, keys), else a capped repr, so that a name
    the user got wrong (a newline, a whole paragraph) cannot break the one-line message around it."""
    if isinstance(name, str) and len(name) <= max_len and name.isprintable():
        return f"'{name}'"
    text = repr(name)
    return text if len(text) <= max_len else text[: max_len - 3] + "..."


def one_line(text: str, max_len: int = 300) -> str:
    """Collapse whitespace (exception texts may span lines) and cap the length, so an error stays one paragraph."""
    line = " ".join(text.split())
    return line if len(line) <= max_len else line[: max_len - 3] + "..."


def show(value: object, max_len: int = 60) -> str:
    """A value as the user wrote it, for messages: repr, with its type, capped."""
    text = repr(value)
    if len(text) > max_len:
        text = text[: max_len - 3] + "..."
    return f"{text} ({type(value).__name__})"
