"""README.md and docs/*.md are self-contained: every link or path they give stays inside the repository
and names something that exists in it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Markdown links and images: [text](target) / ![alt](target), and <a href> / <img src> in HTML.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|(?:href|src)=\"([^\"]+)\"")
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)
_LOCAL_URL = re.compile(r"^https?://(127\.0\.0\.1|localhost)(:\d+)?(/|$)")
_CODE_SPAN = re.compile(r"`+([^`]+)`+")
# Pointers out of the tree in any text: sibling checkouts, home/work folders; `../` is resolved.
_ESCAPING = re.compile(
    r"(?:^|[\s(\[\"'`=])(~/|/(?:work|home|root|Users|mnt|srv|opt)/)|(?:^|[\s(\[\"'`=/])((?:shared|seed)/)"
)
_PARENT = re.compile(r"(?:\.\./)+[\w./-]*")
# Absolute paths a doc may name: runtime locations of the server and its HTTP routes.
# NOTE: the server's URL paths (/health, /ws, ...) are not files.
_ALLOWED_ABSOLUTE = ("/dev/shm", "/tmp/voice-server-", "/proc/", "/health", "/ws", "/v1/realtime", "/twilio/media",
                     "/metrics")
_REPO_EXTENSIONS = (".py", ".md", ".yaml", ".yml", ".toml", ".json", ".cfg", ".txt", ".js", ".html")


def _tracked_top_level() -> set[str]:
    return {p.name for p in ROOT.iterdir() if not p.name.startswith(".") or p.name == ".ci"} - {".git"}


def _exists_in_repo(target: str, doc: Path) -> bool:
    target = target.split("#", 1)[0].split("?", 1)[0].rstrip("/")
    if not target:
        return True  # an anchor in the same page
    for base in (doc.parent, ROOT):
        path = (base / target).resolve()
        if path.is_relative_to(ROOT) and path.exists():
            return True
    return False


def doc_problems(text: str, doc: Path) -> list[str]:
    """What in `text` (the contents of `doc`) points outside the repository or at nothing."""
    problems: list[str] = []
    top_level = _tracked_top_level()
    for lineno, line in enumerate(text.splitlines(), 1):
        where = f"{doc.name}:{lineno}"
        for match in _LINK.finditer(line):
            target = match.group(1) or match.group(2)
            if _URL.match(target) or target.startswith("mailto:"):
                if not _LOCAL_URL.match(target):
                    problems.append(f"{where}: link out of the repository: {target}")
            elif target.startswith("/") or not _exists_in_repo(target, doc):
                problems.append(f"{where}: link to a file not in the repository: {target}")
        for match in _ESCAPING.finditer(line):
            pointer = match.group(1) or match.group(2)
            problems.append(f"{where}: points outside the repository: {pointer!r} in {line.strip()!r}")
        for match in _PARENT.finditer(line):
            if not (doc.parent / match.group(0)).resolve().is_relative_to(ROOT):
                problems.append(f"{where}: points outside the repository: {match.group(0)}")
        for span in _CODE_SPAN.findall(line):
            for token in span.split():
                token = token.strip(",;:.()[]'\"")
                if not token or "://" in token or "$" in token or "{" in token.split("/", 1)[0]:
                    continue
                if token.startswith("/"):
                    if token != "/" and not token.startswith(_ALLOWED_ABSOLUTE):
                        problems.append(f"{where}: absolute path {token}")
                    continue
                first = token.split("/", 1)[0]
                looks_like_repo_path = ("/" in token and first in top_level) or token.endswith(_REPO_EXTENSIONS)
                if looks_like_repo_path and "*" not in token and not _exists_in_repo(token, doc):
                    problems.append(f"{where}: {token} does not exist in the repository")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_is_self_contained(doc: Path) -> None:
    assert doc_problems(doc.read_text(encoding="utf-8"), doc) == []


def test_checker_catches_escaping_and_missing_paths() -> None:
    doc = ROOT / "docs" / "EXAMPLE.md"
    bad = "\n".join([
        "See [the plan](../shared/PLAN.md) and [notes](missing.md).",
        "Weights live in `seed/weights` and /work/main/.venv; also `/home/me/x.py`.",
        "Read `voice_server/models/nothing.py`, `relay/base.py` and [up](https://example.com/x).",
    ])
    found = "\n".join(doc_problems(bad, doc))
    for expected in ("link to a file not in the repository: ../shared/PLAN.md", "missing.md", "'shared/'",
                     "'seed/'", "'/work/'", "absolute path /home/me/x.py", "link out of the repository: https",
                     "voice_server/models/nothing.py does not exist", "relay/base.py does not exist"):
        assert expected in found, (expected, found)
    assert "points outside the repository: ../" in "\n".join(doc_problems("[x](../../up.md)", doc))
    good = "\n".join([
        "[ops](OPERATIONS.md#limits), [readme](../README.md), `voice_server/models/hf_config.py`,",
        "`docs/MODELS.md`, `/dev/shm`, `/health`, `http://127.0.0.1:8000`, `$XDG_RUNTIME_DIR/voice-server`,",
        "shared-memory relay, `Qwen/Qwen3-Omni-30B-A3B-Instruct`, `.venv/bin/python loadtest/bench_relay.py`.",
    ])
    assert doc_problems(good, doc) == []
