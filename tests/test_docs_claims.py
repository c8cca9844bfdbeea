"""The README's checkable claims hold against the repository (tests/test_docs.py checks links and paths).

- Every performance figure the README quotes is a measurement from docs/BENCHMARKS.md: a figure is a
  number followed by `ms`, `s`, `tok/s`, `MB` or `GB`, or a ratio such as `2.2x`, in README prose (fenced code
  blocks and inline code left out). A measured figure is written as a link to the BENCHMARKS section
  that measured it, e.g. `[217.5 ms](docs/BENCHMARKS.md#embedded-cpu-default-...)`: every number in the
  link's text must appear in that section, and the section (or the sections around it) must show the
  command that produced it (`loadtest/...` or `make ...` in code). Any other figure must be a setting
  or a size, listed with its reason in NOT_MEASUREMENTS below.
- Every config README names exists, every file in configs/ is listed in "What is here", and every
  listed YAML passes `voice-server check-config FILE --skip-device-check` (the CLI's `main`, in a
  subprocess).
- "What is here" names every docs/*.md, every top-level folder and every package of voice_server/.
- The stage and pipeline fields README lists are the config's fields, and `tp_size` takes only 1.
- Every `make TARGET` the docs name is a Makefile target; every error code the session layer sends
  is in docs/PROTOCOLS.md.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "BENCHMARKS.md"

# Figures in README prose that are not measurements: settings, defaults, sizes of a run. Each entry is
# a phrase of README (whitespace-insensitive) that contains the figure, and why it is not a measurement.
NOT_MEASUREMENTS: dict[str, str] = {
    "resident memory on a 24 GB host": "the development VM's RAM (BENCHMARKS' preamble)",
    "first (~330 MB)": "the download size of the whisper extra (faster-whisper and its model package)",
    "first (~110 MB)": "the download size of the piper extra (piper-tts and its voice package)",
    "a fixed 500 ms silence window": "server_vad's silence_duration_ms default (voice_server/session/turn_config.py)",
    "20 ms frames": "the browser demo's frame size (web/audio.js FRAME_MS)",
    "also every 250 ms while playing": "the browser demo's playback report period (web/app.js)",
    "(default 5 s each)": "--request-head-timeout / --keep-alive-timeout defaults (voice_server/cli.py)",
    "a 30 s version runs in `make test`": "tests/load/test_soak_short.py's duration",
    "with 20x the examples of `make test`": "make fuzz-long's VOICE_SERVER_FUZZ_EXAMPLES=3000 over the default 150",
}

_NUMBER = r"\d[\d,]*(?:\.\d+)?"
# A number (or a range of two) followed by a unit of time, throughput or memory, or a ratio like 2.2x.
_FIGURE = re.compile(
    rf"(?<![\w.]){_NUMBER}(?:\s?[-–]\s?~?{_NUMBER})?(?:\s?(?:ms|s|tok/s|MB|GB)(?![\w/])|x(?!\w))"
)
_BENCH_LINK = re.compile(r"\[([^\]]+)\]\((?:\./)?docs/BENCHMARKS\.md#([^)\s]+)\)")
_ANY_LINK_TARGET = re.compile(r"(?<=\])\([^)\s]*\)")
_CODE_SPAN = re.compile(r"`[^`\n]+`")
_FENCE = re.compile(r"^\s*(```|~~~)")
_COMMAND = re.compile(r"loadtest/[\w./-]+\.(?:py|sh)|\bmake [a-z][\w-]*")


def _blank_fences(text: str) -> str:
    """`text` with the lines of fenced code blocks emptied (line numbers kept)."""
    lines, is_code = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            is_code = not is_code
            lines.append("")
        else:
            lines.append("" if is_code else line)
    return "\n".join(lines)


def _code(text: str) -> str:
    """What `text` shows as code: fenced blocks and inline code spans."""
    parts, is_code = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            is_code = not is_code
        elif is_code:
            parts.append(line)
        else:
            parts.extend(span.strip("`") for span in _CODE_SPAN.findall(line))
    return "\n".join(parts)


def _mask(text: str, pattern: re.Pattern[str]) -> str:
    """`text` with each match of `pattern` replaced by as many spaces (offsets kept)."""
    return pattern.sub(lambda m: " " * len(m.group(0)), text)


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


# -- docs/BENCHMARKS.md's sections -------------------------------------------------------------------------


@dataclass
class Section:
    level: int
    title: str
    slug: str
    body: str
    """From the heading to the next heading of any level."""
    context: str
    """Where the section's command may be: its body and the preamble of each section it is in."""


def github_slug(title: str) -> str:
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def markdown_sections(text: str) -> dict[str, Section]:
    headings: list[tuple[int, int, str]] = []  # (line index, level, title)
    lines, is_code = text.splitlines(), False
    for i, line in enumerate(lines):
        if _FENCE.match(line):
            is_code = not is_code
        elif not is_code and (m := re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)):
            headings.append((i, len(m.group(1)), m.group(2)))
    sections: dict[str, Section] = {}
    bodies = []
    for n, (i, _, _) in enumerate(headings):
        end = headings[n + 1][0] if n + 1 < len(headings) else len(lines)
        bodies.append("\n".join(lines[i:end]))
    for n, (_, level, title) in enumerate(headings):
        context = [bodies[n]]
        wanted = level
        for k in range(n - 1, -1, -1):  # NOTE: enclosing sections' preambles (up to their first subheading)
            if headings[k][1] < wanted:
                context.append(bodies[k])
                wanted = headings[k][1]
        slug, suffix = github_slug(title), 0
        while (slug if not suffix else f"{slug}-{suffix}") in sections:
            suffix += 1
        slug = slug if not suffix else f"{slug}-{suffix}"
        sections[slug] = Section(level, title, slug, bodies[n], "\n".join(context))
    return sections


def _has_number(text: str, number: str) -> bool:
    return re.search(rf"(?<![\d.,]){re.escape(number)}(?![\d]|[.,]\d)", text) is not None


# -- README's figures ------------------------------------------------------------------------------------


def figure_problems(readme: str, benchmarks: str, not_measurements: dict[str, str]) -> list[str]:
    """Why figures of `readme` are not backed by `benchmarks` (empty: all are)."""
    problems: list[str] = []
    sections = markdown_sections(benchmarks)
    prose = _blank_fences(readme)
    for m in _BENCH_LINK.finditer(_mask(prose, _CODE_SPAN)):
        text, slug = m.group(1), m.group(2)
        claim = f"README.md:{_line(prose, m.start())}: {text!r}"
        section = sections.get(slug)
        if section is None:
            problems.append(f"{claim} links to docs/BENCHMARKS.md#{slug}, which is no heading there")
            continue
        if not _FIGURE.search(text):
            problems.append(f"{claim} links to BENCHMARKS but quotes no figure (a number with a unit, or a ratio)")
        for number in re.findall(_NUMBER, text):
            if not _has_number(section.body, number):
                problems.append(f"{claim}: {number} is not in BENCHMARKS' section {section.title!r}")
        if not _COMMAND.search(_code(section.context)):
            problems.append(f"{claim}: BENCHMARKS' section {section.title!r} shows no command that produced it "
                            "(`loadtest/...` or `make ...`)")
    # Figures outside those links: each must sit inside a NOT_MEASUREMENTS phrase.
    scan = _mask(_mask(_mask(prose, _CODE_SPAN), _BENCH_LINK), _ANY_LINK_TARGET)
    allowed: list[tuple[int, int]] = []
    for phrase in not_measurements:
        pattern = r"\s+".join(re.escape(word) for word in phrase.split())
        allowed += [(a.start(), a.end()) for a in re.finditer(pattern, prose)]
    for m in _FIGURE.finditer(scan):
        if not any(start <= m.start() and m.end() <= end for start, end in allowed):
            problems.append(f"README.md:{_line(prose, m.start())}: figure {m.group(0)!r} is neither a link to the "
                            "docs/BENCHMARKS.md section that measured it nor a setting listed in NOT_MEASUREMENTS")
    return problems


def test_readme_figures_are_measured_in_benchmarks() -> None:
    problems = figure_problems(README.read_text(encoding="utf-8"), BENCHMARKS.read_text(encoding="utf-8"),
                               NOT_MEASUREMENTS)
    assert not problems, "\n".join(problems)


def test_not_measurements_are_all_in_readme() -> None:
    """A stale NOT_MEASUREMENTS entry would let a figure through that nobody looked at."""
    prose = re.sub(r"\s+", " ", _blank_fences(README.read_text(encoding="utf-8")))
    stale = [phrase for phrase in NOT_MEASUREMENTS if phrase not in prose]
    assert not stale, f"NOT_MEASUREMENTS phrases no longer in README.md: {stale}"


def test_figure_checker_catches_unbacked_figures() -> None:
    bench = "\n".join([
        "# Benchmarks", "## Turns", "Command: `loadtest/bench_turns.py`.", "| 1 | 217.5 |",
        "## Uncommanded", "It took 42 ms.",
    ])
    good = "First audio [217.5 ms](docs/BENCHMARKS.md#turns); the VAD waits 500 ms."
    assert figure_problems(good, bench, {"waits 500 ms": "a setting"}) == []
    found = "\n".join(figure_problems("\n".join([
        "About 150 ms after the turn, 2.5x faster, 81 tok/s, 3 GB.",
        "[99 ms](docs/BENCHMARKS.md#turns) [42 ms](docs/BENCHMARKS.md#uncommanded) [1 ms](docs/BENCHMARKS.md#nope)",
        "```", "code 7 ms is not prose", "```", "`inline 8 ms` neither",
    ]), bench, {}))
    for expected in ("figure '150 ms'", "figure '2.5x'", "figure '81 tok/s'", "figure '3 GB'",
                     "99 is not in BENCHMARKS' section 'Turns'", "'Uncommanded' shows no command",
                     "docs/BENCHMARKS.md#nope, which is no heading"):
        assert expected in found, (expected, found)
    assert "7 ms" not in found and "8 ms" not in found


# -- "What is here" ------------------------------------------------------------------------------------


def what_is_here() -> dict[str, str]:
    """README's "What is here" table: first column's path -> the row's text."""
    text = README.read_text(encoding="utf-8")
    start = text.index("## What is here")
    rows: dict[str, str] = {}
    for line in text[start:].splitlines()[1:]:
        if rows and not line.startswith("|"):
            break  # NOTE: the end of the table
        m = re.match(r"^\|\s*`([^`]+)`\s*\|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    assert rows, "README.md has no 'What is here' table"
    return rows


def _gitignored(name: str) -> bool:
    patterns = [p.strip().strip("/") for p in (ROOT / ".gitignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def test_what_is_here_lists_every_folder_and_doc() -> None:
    rows = what_is_here()
    listed = "\n".join(f"`{path}` {text}" for path, text in rows.items())
    missing = []
    for path in sorted(ROOT.iterdir()):
        is_folder = path.is_dir() and path.name != ".git" and not _gitignored(path.name)
        if is_folder and not any(row.split("/", 1)[0] == path.name for row in rows):
            missing.append(f"top-level folder {path.name}/")
    for path in sorted((ROOT / "voice_server").iterdir()):
        if (path / "__init__.py").is_file() and f"voice_server/{path.name}/" not in rows:
            missing.append(f"package voice_server/{path.name}/")
    for doc in sorted((ROOT / "docs").glob("*.md")):
        if f"`docs/{doc.name}`" not in listed:
            missing.append(f"docs/{doc.name}")
    assert not missing, f"README.md's 'What is here' does not list: {', '.join(missing)}"
    absent = [path for path in rows if not (ROOT / path).exists()]
    assert not absent, f"README.md's 'What is here' lists paths that do not exist: {absent}"


# -- configs ---------------------------------------------------------------------------------------------


def readme_configs() -> set[str]:
    return set(re.findall(r"configs/[\w.-]+\.(?:yaml|yml|conf)", README.read_text(encoding="utf-8")))


def test_readme_configs_exist_and_every_config_is_listed() -> None:
    named = readme_configs()
    absent = sorted(path for path in named if not (ROOT / path).is_file())
    assert not absent, f"README.md names configs that do not exist: {absent}"
    row = what_is_here().get("configs/", "")
    unlisted = sorted(f"configs/{p.name}" for p in (ROOT / "configs").iterdir()
                      if p.is_file() and f"`configs/{p.name}`" not in row)
    assert not unlisted, f"README.md's 'What is here' (configs/ row) does not list: {unlisted}"


# Configs README lists that cannot be checked on a machine without a GPU, and why. None today:
# `--skip-device-check` skips only the check that the config's `cuda:N` devices exist (the factories
# still import, the budget is still planned), so the 30B GPU configs are checked here too.
NOT_CHECKABLE_WITHOUT_GPU: dict[str, str] = {}


def test_cli_module_is_the_voice_server_command() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["voice-server"] == "voice_server.cli:main"


# NOTE: one process for all configs (torch is imported once: ~2 s a config otherwise, on 2 shared cores); each
# config goes through the CLI's own `main`, what `voice-server check-config` runs, its exit code and output kept.
_CHECK_CONFIGS = """
import contextlib, io, json, sys
from voice_server.cli import main
results = {}
for path in sys.argv[2:]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["check-config", path, "--skip-device-check"])
        except SystemExit as exc:
            code = exc.code
    results[path] = [code, out.getvalue(), err.getvalue()]
with open(sys.argv[1], "w") as f:
    json.dump(results, f)
"""


def check_configs(paths: list[str], tmp_path: Path) -> dict[str, tuple[int, str, str]]:
    """`voice-server check-config PATH --skip-device-check` of each path: (exit code, stdout, stderr)."""
    report = tmp_path / "check-config.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _CHECK_CONFIGS, str(report), *paths], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and report.is_file(), f"the check-config driver failed:\n{run.stderr}"
    return {path: (code, out, err) for path, (code, out, err) in json.loads(report.read_text()).items()}


def test_every_readme_config_passes_check_config(tmp_path: Path) -> None:
    yamls = sorted(p for p in readme_configs() if p.endswith((".yaml", ".yml")))
    assert yamls == sorted(f"configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml")), \
        "README.md must name every configs/*.yaml"
    results = check_configs([p for p in yamls if p not in NOT_CHECKABLE_WITHOUT_GPU], tmp_path)
    failed = [f"{path}: exit {code}\n{err.strip()}" for path, (code, _, err) in results.items() if code != 0]
    assert not failed, "voice-server check-config --skip-device-check fails on configs README lists:\n" + \
        "\n".join(failed)
    for path, (_, out, _) in results.items():
        if "device=cuda" in out:
            assert "--skip-device-check: this host was not checked" in out, path


def test_check_config_driver_reports_a_broken_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nstages:\n  - name: a\n    factory: voice_server.stages.numeric:create_framer\n"
                   "    tp_size: 2\n")
    code, _, err = check_configs([str(bad)], tmp_path)[str(bad)]
    assert code == 2 and "tp_size" in err, err


# -- config fields, make targets, protocol error codes -----------------------------------------------------


def test_readme_lists_the_config_fields() -> None:
    from voice_server.config import ConfigError, PipelineConfig, StageConfig

    text = README.read_text(encoding="utf-8")
    start = text.index("A pipeline is a list of stages:")
    end = text.index("\n\n", text.index("Other fields:"))
    block = text[start:end]
    named = set(re.findall(r"`([a-z][a-z0-9_]*)`", block)) | set(re.findall(r"^\s*-?\s*([a-z_]+):", block, re.M))
    fields = {f.name for f in dataclasses.fields(StageConfig)} | {f.name for f in dataclasses.fields(PipelineConfig)}
    missing = sorted(fields - named)
    assert not missing, f"README.md's stage/pipeline fields omit: {missing}"
    values = {"cpu", "ipc", "tcp", "ar", "code2wav", "simple", "local", "ray"}
    unknown = sorted(named - values - fields)
    assert not unknown, f"README.md lists config fields that do not exist: {unknown}"
    # The claim "`tp_size` (only 1 is accepted ...)": a larger value is refused.
    assert re.search(r"`tp_size` \(only 1 is accepted", block), "README.md no longer says tp_size accepts only 1"
    with pytest.raises(ConfigError, match="tp_size"):
        StageConfig(name="s", factory="a.b:c", tp_size=2)


def _docs() -> Iterator[Path]:
    yield README
    yield from sorted((ROOT / "docs").glob("*.md"))


def test_make_targets_in_docs_exist() -> None:
    targets = set(re.findall(r"^([a-z][\w-]*)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.M))
    missing = []
    for doc in _docs():
        for target in set(re.findall(r"\bmake ([a-z][\w-]*)", _code(doc.read_text(encoding="utf-8")))):
            if target not in targets:
                missing.append(f"{doc.relative_to(ROOT)}: make {target}")
    assert not missing, f"docs name make targets the Makefile lacks: {missing}"


def test_protocols_doc_names_every_session_error_code() -> None:
    codes = set()
    for path in (ROOT / "voice_server" / "session").rglob("*.py"):
        codes |= set(re.findall(r"(?:SessionError|self\.error)\(\s*\"([a-z_]+)\"", path.read_text()))
    assert {"pipeline_unavailable", "pipeline_overloaded"} <= codes
    protocols = (ROOT / "docs" / "PROTOCOLS.md").read_text(encoding="utf-8")
    missing = sorted(code for code in codes if f"`{code}`" not in protocols)
    assert not missing, f"docs/PROTOCOLS.md does not document the session error codes {missing}"
