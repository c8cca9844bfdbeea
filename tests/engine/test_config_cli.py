"""`voice-server check-config` end to end: every malformed or unstartable config from issue #6 item 7 is
refused with exit 2 and one `config error:` paragraph naming the stage (or file) and the field; never a
traceback. Each case is a real file run through the real CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from voice_server.config import MAX_FILE_BYTES, MAX_STAGES, ConfigError, pipeline_from_dict
from voice_server.scheduling import SCHEDULER_BUILDERS, check_schedulers

REPO = Path(__file__).resolve().parents[2]
ECHO = "voice_server.stages.numeric:create_echo"


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "voice_server.cli", "check-config", str(path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )


def assert_refused(out: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 2, nothing on stdout, and stderr one `config error:` paragraph holding every needle."""
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: "), out.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def one_stage(extra: str = "", stage_extra: str = "", factory: str = ECHO) -> str:
    return f"name: t\n{extra}stages:\n  - {{name: solo, factory: '{factory}', terminal: true{stage_extra}}}\n"


def chain(num_stages: int) -> str:
    lines = ["name: long", "stages:"]
    for i in range(num_stages):
        route = f"next: s{i + 1}" if i < num_stages - 1 else "terminal: true"
        lines.append(f"  - {{name: s{i}, factory: '{ECHO}', memory_fraction: 0.001, {route}}}")
    return "\n".join(lines) + "\n"


CASES: dict[str, tuple[str | bytes, tuple[str, ...]]] = {
    "non_utf8": (
        one_stage().replace("name: t", "name: caf\xe9").encode("latin-1"),
        ("not UTF-8", "byte 0xe9 at line 1"),
    ),
    "startup_timeout_soon": (
        one_stage("startup_timeout_s: soon\n"),
        ("pipeline 't'", "field 'startup_timeout_s'", "'soon' (str)"),
    ),
    "inline_threshold_null": (
        one_stage("inline_threshold_bytes: null\n"),
        ("pipeline 't'", "field 'inline_threshold_bytes'", "None"),
    ),
    "relay_slab_bool": (one_stage("relay_slab_bytes: true\n"), ("field 'relay_slab_bytes'", "True (bool)")),
    "batch_size_bool": (one_stage(stage_extra=", max_batch_size: true"), ("stage 'solo'", "field 'max_batch_size'")),
    "batch_window_nan": (one_stage(stage_extra=", batch_window_ms: .nan"), ("stage 'solo'", "field 'batch_window_ms'")),
    "deep_nesting": ("name: t\nstages: " + "[" * 5000 + "]" * 5000 + "\n", ("field 'stages.0.0", "nested deeper")),
    "deep_factory_args": (
        one_stage(stage_extra=", factory_args: " + "{a: " * 40 + "1" + "}" * 40),
        ("field 'stages.0.factory_args.a.a", "nested deeper than 32 levels"),
    ),
    "long_chain": (chain(5000), ("pipeline 'long'", "field 'stages'", f"5000 stages is more than the {MAX_STAGES}")),
    "duplicate_top_level_key": (
        one_stage("startup_timeout_s: 10\nstartup_timeout_s: 20\n"),
        ("line 3", "field 'startup_timeout_s': duplicate key", "of 't'", "first at line 2"),
    ),
    "duplicate_stage_key": (
        f"name: t\nstages:\n  - name: solo\n    factory: '{ECHO}'\n    terminal: true\n    terminal: false\n",
        ("line 6", "field 'terminal': duplicate key", "of 'solo'", "first at line 5"),
    ),
    "duplicate_factory_args_key": (
        one_stage(stage_extra=", factory_args: {gain: 1, gain: 2}"),
        ("field 'gain': duplicate key",),
    ),
    "recursive_alias": (
        one_stage(stage_extra=", factory_args: &loop {self: *loop}"),
        ("field 'stages.0.factory_args'", "recursive alias"),
    ),
    "three_stage_cycle": (
        "name: t\nstages:\n"
        f"  - {{name: a, factory: '{ECHO}', next: b}}\n"
        f"  - {{name: b, factory: '{ECHO}', next: c}}\n"
        f"  - {{name: c, factory: '{ECHO}', next: a}}\n",
        ("stage 'c'", "field 'next'", "routing cycle a -> b -> c -> a"),
    ),
    "three_stage_cycle_with_entry": (
        "name: t\nstages:\n"
        f"  - {{name: e, factory: '{ECHO}', next: a}}\n"
        f"  - {{name: a, factory: '{ECHO}', next: b}}\n"
        f"  - {{name: b, factory: '{ECHO}', stream_to: [c]}}\n"
        f"  - {{name: c, factory: '{ECHO}', next: a, terminal: true}}\n",
        ("stage 'c'", "field 'next'", "routing cycle a -> b -> c -> a"),
    ),
    "missing_module": (
        one_stage(factory="voice_server.stages.no_such_module:create"),
        ("stage 'solo'", "field 'factory'", "ModuleNotFoundError", "no_such_module"),
    ),
    "missing_function": (
        one_stage(factory="voice_server.stages.numeric:no_such_function"),
        ("stage 'solo'", "field 'factory'", "has no attribute 'no_such_function'"),
    ),
    "factory_not_callable": (
        one_stage(factory="voice_server.config.loading:MAX_DEPTH"),
        ("stage 'solo'", "field 'factory'", "not a callable"),
    ),
    "slab_too_big_for_dev_shm": (
        one_stage(f"relay_slab_bytes: {1 << 50}\n"),  # 1 PiB: 2 slabs (stage + coordinator)
        ("pipeline 't'", "field 'relay_slab_bytes'", "2 slabs", "1024.0 TiB need 2048.0 TiB", "/dev/shm has"),
    ),
    "unroutable_tcp_host": (
        one_stage("control_transport: tcp\ntcp_host: 203.0.113.1\n"),  # TEST-NET-3: never on this host
        ("pipeline 't'", "field 'tcp_host'", "cannot bind '203.0.113.1'"),
    ),
    "syntax_error": ("name: t\nstages: [\n", ("invalid YAML: line 3",)),
    "stage_not_a_mapping": ("name: t\nstages: [5]\n", ("stage #0: expected a mapping, got int",)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_check_config_refuses_with_one_paragraph(tmp_path: Path, case: str) -> None:
    text, needles = CASES[case]
    path = tmp_path / "pipeline.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    assert_refused(check_config(path), *needles)


def test_oversized_file_is_refused_before_parsing(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(one_stage() + "#" * MAX_FILE_BYTES + "\n")
    assert_refused(check_config(path), str(path), "larger than 1 MiB")


def test_longest_allowed_chain_passes(tmp_path: Path) -> None:
    path = tmp_path / "chain.yaml"
    path.write_text(chain(MAX_STAGES))
    out = check_config(path)
    assert out.returncode == 0, out.stderr
    assert f"s{MAX_STAGES - 1}" in out.stdout


def test_good_tcp_config_passes_and_prints_topology_and_budget(tmp_path: Path) -> None:
    path = tmp_path / "good.yaml"
    path.write_text(one_stage("control_transport: tcp\ntcp_host: 127.0.0.1\n", ", factory_args: {<<: {x: 1}, x: 2}"))
    out = check_config(path)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert "entry solo, terminal solo" in out.stdout and "total cpu" in out.stdout


def test_a_valid_but_unimplemented_scheduler_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: every name in SCHEDULERS is implemented today, so the refusal is checked with one taken out.
    monkeypatch.delitem(SCHEDULER_BUILDERS, "code2wav")
    cfg = pipeline_from_dict({"name": "t", "stages": [{"name": "solo", "factory": ECHO, "scheduler": "code2wav",
                                                       "terminal": True}]})
    with pytest.raises(ConfigError, match=r"stage 'solo': field 'scheduler': 'code2wav' is not implemented yet "
                                          r"\(implemented: ar, simple\)"):
        check_schedulers(cfg)
