"""Package dependencies point one way: no module of a lower package imports a higher one, at any depth
(inside functions and `if TYPE_CHECKING:` blocks too), read from the source with `ast`.

- `voice_server/session/` never imports `voice_server.server`: the server routes to the session
  endpoints, which see the server's objects only as the Protocols of `voice_server/session/connection.py`;
- `voice_server/config/` never imports the schedulers, the engine or the server: they all read configs
  (the scheduler registry check is `voice_server/scheduling/__init__.py: check_schedulers`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RULES = {
    "voice_server/session": ("voice_server.server",),
    "voice_server/config": ("voice_server.scheduling", "voice_server.engine", "voice_server.server"),
}
"""Package folder -> the packages none of its modules may import."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, package: str) -> Iterator[tuple[int, str]]:
    """(line, absolute name) of every import in `source`, a module of `package` (relative imports resolved):
    a `from X import y` yields both `X.y` (y may be a module) and `X`."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # NOTE: `from voice_server import server` imports the package by its attribute name.
            yield from ((node.lineno, f"{base}.{alias.name}") for alias in node.names)
            yield node.lineno, base


def package_of(path: Path) -> str:
    name = module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def is_within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("folder", sorted(RULES))
def test_a_package_never_imports_the_packages_above_it(folder: str) -> None:
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, folder
    bad = sorted({f"{path.relative_to(ROOT)}:{line}: {name}" for path in files
                  for line, name in imported_modules(path.read_text(encoding="utf-8"), package_of(path))
                  for banned in RULES[folder] if is_within(name, banned)})
    assert not bad, f"{folder} must not import {', '.join(RULES[folder])}:\n" + "\n".join(bad)


def test_the_import_reader_sees_every_form() -> None:
    # NOTE: the checker itself, on a module of `voice_server.session.realtime` importing the server each way.
    source = ("import voice_server.server.app\nfrom voice_server.server import metrics\n"
              "from voice_server import server\ndef f() -> None:\n    from ...server.sessions import SessionGuard\n")
    found = [name for _, name in imported_modules(source, "voice_server.session.realtime")
             if is_within(name, "voice_server.server")]
    assert found == ["voice_server.server.app", "voice_server.server.metrics", "voice_server.server",
                     "voice_server.server", "voice_server.server.sessions.SessionGuard", "voice_server.server.sessions"]
