"""Config limits and checks below the CLI: field rules cover every field, the YAML loader's limits,
the routing graph at its size limit, environment checks, and a factory that returns no runner."""

from __future__ import annotations

import dataclasses
import math
import textwrap
from pathlib import Path
from typing import Any

import pytest
from harness import assert_start_fails

from voice_server.config import (
    MAX_DEPTH,
    MAX_STAGES,
    ConfigError,
    PipelineConfig,
    StageConfig,
    check_environment,
    load_pipeline,
    pipeline_from_dict,
)
from voice_server.config.checks import SHM_DIR, check_shm
from voice_server.config.pipeline import PIPELINE_RULES, SCHEDULERS, STAGE_RULES
from voice_server.config.topology import RESERVED_PROCESS_NAMES
from voice_server.engine import ipc
from voice_server.engine.runtime import StageContext, create_runner, create_scheduler
from voice_server.relay.shm_segments import SHM_DIR as RELAY_SHM_DIR
from voice_server.scheduling import SCHEDULER_BUILDERS, check_schedulers
from voice_server.scheduling.contract import ARSpec, Code2WavSpec
from voice_server.stages.numeric import Echo

ECHO = "voice_server.stages.numeric:create_echo"
STRUCTURAL_STAGE_FIELDS = {"next", "stream_to", "factory_args", "env", "placement"}  # NOTE: config/env.py, placement.py


def solo(**pipeline: Any) -> dict[str, Any]:
    return {"name": "t", "stages": [{"name": "solo", "factory": ECHO, "terminal": True}], **pipeline}


def chain(num_stages: int) -> list[StageConfig]:
    return [
        StageConfig(f"s{i}", ECHO, next=f"s{i + 1}" if i < num_stages - 1 else None, terminal=i == num_stages - 1,
                    memory_fraction=0.001)
        for i in range(num_stages)
    ]


# -- field rules --------------------------------------------------------------------------------


def test_every_field_has_a_rule() -> None:
    """A pipeline-level field added without a row in PIPELINE_RULES would go unchecked: fail here."""
    # NOTE: `voices` and `twilio` are structural, checked in config/voices.py (tests/engine/test_config_voices.py)
    # and config/twilio.py (tests/server/test_twilio_config.py).
    assert {f.name for f in dataclasses.fields(PipelineConfig)} == set(PIPELINE_RULES) | {"stages", "voices", "twilio"}
    assert {f.name for f in dataclasses.fields(StageConfig)} == set(STAGE_RULES) | STRUCTURAL_STAGE_FIELDS


@pytest.mark.parametrize("field_name", list(PIPELINE_RULES))
@pytest.mark.parametrize("value", ["soon", True, [1], {"a": 1}, math.nan, -1, 1.5])
def test_pipeline_fields_refuse_wrong_values(field_name: str, value: Any) -> None:
    raw = solo(**{field_name: value})
    try:
        pipeline_from_dict(raw)
    except ConfigError as exc:
        assert f"field '{field_name}'" in str(exc)
    else:  # some values are right for some fields ('soon' is a fine name): the rule itself must agree
        assert PIPELINE_RULES[field_name].problem(value) is None


@pytest.mark.parametrize("field_name", list(STAGE_RULES))
@pytest.mark.parametrize("value", [None, True, [1], math.inf, 0, 2.5, "x y"])
def test_stage_fields_refuse_wrong_values(field_name: str, value: Any) -> None:
    raw = solo()
    raw["stages"][0][field_name] = value
    try:
        pipeline_from_dict(raw)
    except ConfigError as exc:
        assert "stage" in str(exc) and f"field '{field_name}'" in str(exc)
    else:
        assert STAGE_RULES[field_name].problem(value) is None


def test_nullable_number_rule_reads_null_as_auto() -> None:
    from voice_server.config.fields import Number

    rule = Number(int, minimum=1, is_nullable=True)
    assert rule.problem(None) is None and rule.problem(4) is None
    assert rule.problem(0) == "must be an integer >= 1 or null (auto), got 0 (int)"
    assert rule.problem(10**400) is None  # no float overflow on huge ints
    assert Number(float, minimum=0.0, maximum=1.0, is_min_exclusive=True).problem(10**400) is not None


# -- YAML loading -------------------------------------------------------------------------------


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_depth_is_counted_through_aliases(tmp_path: Path) -> None:
    # Each anchor is 8 levels deep on its own; chained through aliases, l3 (under the root) reaches 33.
    lines = ["l0: &l0 " + "[" * 8 + "1" + "]" * 8]
    for i in range(1, 5):
        lines.append(f"l{i}: &l{i} " + "[" * 8 + f"*l{i - 1}" + "]" * 8)
    path = write(tmp_path, "\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=rf"line 4, column \d+: field 'l3(\.0)*': nested deeper than {MAX_DEPTH} "
                                          r"levels \(counting through aliases\)"):
        load_pipeline(path)


def test_nesting_up_to_the_limit_loads(tmp_path: Path) -> None:
    # top mapping (1) -> stages (2) -> stage (3) -> factory_args (4) -> MAX_DEPTH - 4 more mappings
    args = "{a: " * (MAX_DEPTH - 4) + "1" + "}" * (MAX_DEPTH - 4)
    stage = f"{{name: s, factory: '{ECHO}', terminal: true, factory_args: {args}}}"
    path = write(tmp_path, f"name: t\nstages:\n  - {stage}\n")
    cfg = load_pipeline(path)
    assert cfg.stage("s").factory_args["a"]["a"]["a"] is not None


def test_merge_keys_may_override_but_written_keys_may_not_repeat(tmp_path: Path) -> None:
    path = write(tmp_path, f"""\
        common: &common {{gain: 1.0, offset: 0.0}}
        name: t
        stages:
          - name: s
            factory: '{ECHO}'
            terminal: true
            factory_args: {{<<: *common, gain: 2.0}}
        """)
    with pytest.raises(ConfigError, match="field 'common': unknown field"):
        load_pipeline(path)  # the YAML itself is fine; the anchor holder is just not a pipeline field
    raw = path.read_text().replace("common: &common {gain: 1.0, offset: 0.0}\n", "")
    raw = raw.replace("<<: *common, ", "<<: {gain: 1.0, offset: 0.0}, ")
    assert load_pipeline(write(tmp_path, raw)).stage("s").factory_args == {"gain": 2.0, "offset": 0.0}
    with pytest.raises(ConfigError, match=r"line 1, column 11: field 'name': duplicate key .* \(first at line 1\)"):
        load_pipeline(write(tmp_path, "{name: t, name: u}\n"))
    with pytest.raises(ConfigError, match="field True: duplicate key"):  # yes and true are the same key
        load_pipeline(write(tmp_path, "{yes: 1, true: 2}\n"))


def test_yaml_errors_are_one_line_with_the_position(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_pipeline(write(tmp_path, "name: t\nstages:\n  - {name: a\n  factory: b}\n"))
    message = str(info.value)
    assert "\n" not in message and "invalid YAML: line" in message
    with pytest.raises(ConfigError, match="invalid YAML: .*python/object"):
        load_pipeline(write(tmp_path, "name: !!python/object:os.system x\n"))
    with pytest.raises(ConfigError, match="cannot read pipeline config"):
        load_pipeline(tmp_path)  # a directory


# -- topology -----------------------------------------------------------------------------------


def test_stage_count_is_bounded_and_the_graph_checks_are_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: work counted, not timed: every graph check reads the stages' routes (`targets`). Linear
    # checks read each stage's a fixed number of times, so a chain twice as long takes at most twice
    # the reads; one that re-walked the chain from every stage would take four times as many.
    num_reads = 0
    targets = vars(StageConfig)["targets"].fget  # the property's getter

    def counted(stage: StageConfig) -> tuple[str, ...]:
        nonlocal num_reads
        num_reads += 1
        return targets(stage)

    monkeypatch.setattr(StageConfig, "targets", property(counted))
    reads = {}
    for num_stages in (MAX_STAGES // 2, MAX_STAGES):
        stages = chain(num_stages)
        num_reads = 0
        cfg = PipelineConfig("long", tuple(stages))
        assert cfg.reachable_from("s0") == [s.name for s in stages]
        reads[num_stages] = num_reads
    assert 0 < reads[MAX_STAGES] <= 2 * reads[MAX_STAGES // 2], reads
    with pytest.raises(ConfigError, match=rf"field 'stages': {MAX_STAGES + 1} stages is more than the {MAX_STAGES}"):
        PipelineConfig("long", tuple(chain(MAX_STAGES + 1)))


@pytest.mark.parametrize(
    ("routes", "needle"),
    [
        ({"a": {"next": "b"}, "b": {"next": "c"}, "c": {"next": "a"}},
         "stage 'c': field 'next': routing cycle a -> b -> c -> a"),
        ({"e": {"next": "a"}, "a": {"stream_to": ["b"]}, "b": {"next": "c"}, "c": {"stream_to": ["a"]}},
         "stage 'c': field 'stream_to': routing cycle a -> b -> c -> a"),
        ({"e": {"next": "a", "stream_to": ["x"]}, "x": {"terminal": True}, "a": {"next": "b"}, "b": {"next": "c"},
          "c": {"next": "a"}}, "stage 'c': field 'next': routing cycle a -> b -> c -> a"),
        ({"a": {"next": "b"}, "b": {"next": "a"}}, "stage 'b': field 'next': routing cycle a -> b -> a"),
    ],
)
def test_cycles_are_reported_as_cycles_not_fan_in(routes: dict[str, dict[str, Any]], needle: str) -> None:
    raw = {"name": "t", "stages": [{"name": n, "factory": ECHO, **r} for n, r in routes.items()]}
    with pytest.raises(ConfigError) as info:
        pipeline_from_dict(raw)
    assert needle in str(info.value) and "fan-in" not in str(info.value)


def test_process_names_the_engine_uses_are_reserved() -> None:
    assert ipc.COORDINATOR in RESERVED_PROCESS_NAMES
    for stage in ({"name": "coord"}, {"name": "a", "process": "pub"}):
        raw = solo()
        raw["stages"][0].update(stage)
        with pytest.raises(ConfigError, match="field '(name|process)': process name '(coord|pub)' is reserved"):
            pipeline_from_dict(raw)


# -- environment checks -------------------------------------------------------------------------


def test_scheduler_registry_is_the_single_source() -> None:
    assert set(SCHEDULER_BUILDERS) <= set(SCHEDULERS)
    for name in SCHEDULERS:
        raw = solo()
        raw["stages"][0]["scheduler"] = name
        cfg = pipeline_from_dict(raw)
        if name in SCHEDULER_BUILDERS:
            check_schedulers(cfg)
            check_environment(cfg)
            runner = Echo()
            if name == "ar":  # NOTE: an ar scheduler is sized by its runner's KV cache
                with pytest.raises(TypeError, match="stage 'solo': scheduler 'ar' needs a runner with an `ar_spec`"):
                    create_scheduler(cfg.stages[0], runner)
                runner.ar_spec = ARSpec(num_pages=4, page_size=16, max_model_len=64)  # type: ignore[attr-defined]
            if name == "code2wav":  # NOTE: a code2wav scheduler takes its sample rate from the runner
                with pytest.raises(TypeError, match="stage 'solo': scheduler 'code2wav' needs a runner with a "
                                                    "`code2wav_spec`"):
                    create_scheduler(cfg.stages[0], runner)
                runner.code2wav_spec = Code2WavSpec(sample_rate=24000)  # type: ignore[attr-defined]
            assert create_scheduler(cfg.stages[0], runner) is not None
        else:
            with pytest.raises(ConfigError, match=f"stage 'solo': field 'scheduler': '{name}' is not implemented"):
                check_schedulers(cfg)
            with pytest.raises(NotImplementedError, match="stage 'solo': field 'scheduler'"):
                create_scheduler(cfg.stages[0], Echo())


def test_shm_check_counts_one_slab_per_process_plus_the_coordinator() -> None:
    assert SHM_DIR == RELAY_SHM_DIR
    cfg = pipeline_from_dict(solo(relay_slab_bytes=1 << 16))
    check_shm(cfg)
    raw = solo(relay_slab_bytes=1 << 50)
    raw["stages"] = [{"name": "a", "factory": ECHO, "next": "b"}, {"name": "b", "factory": ECHO, "terminal": True}]
    with pytest.raises(ConfigError, match=r"'relay_slab_bytes': 3 slabs \(2 stage processes \+ the coordinator\)"):
        check_shm(pipeline_from_dict(raw))
    with pytest.raises(ConfigError, match="cannot check free space of /no/such/dir"):
        check_shm(cfg, shm_dir="/no/such/dir")


# -- a factory that returns no runner -------------------------------------------------------------

BAD_FACTORIES = """\
class OnlyExecute:
    def execute(self, batch):
        return batch


def create_none(ctx):
    return None


def create_only_execute(ctx):
    return OnlyExecute()
"""


@pytest.fixture
def bad_factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module of broken factories, importable here and (spawn copies sys.path) in stage processes."""
    (tmp_path / "vs_bad_factories.py").write_text(BAD_FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "vs_bad_factories"


def test_create_runner_refuses_what_is_not_a_runner(bad_factories: str) -> None:
    for factory, needle in [
        ("create_none", "create_none returned None (NoneType), which is not a voice_server.scheduling.Runner"),
        ("create_only_execute", "(OnlyExecute), which is not a voice_server.scheduling.Runner"),
    ]:
        raw = solo()
        raw["stages"][0]["factory"] = f"{bad_factories}:{factory}"
        cfg = pipeline_from_dict(raw)
        check_environment(cfg)  # importable: only calling it can tell
        with pytest.raises(TypeError) as info:
            create_runner(StageContext(cfg.stages[0], cfg, None, "test"))
        assert str(info.value).startswith(f"stage 'solo': field 'factory': {bad_factories}:{factory} returned ")
        assert str(info.value).endswith(needle)


def test_factory_returning_none_fails_start_up_naming_the_stage(bad_factories: str) -> None:
    raw = {
        "name": "broken",
        "startup_timeout_s": 30,
        "stages": [
            {"name": "good", "factory": ECHO, "next": "bad"},
            {"name": "bad", "factory": f"{bad_factories}:create_none", "terminal": True},
        ],
    }
    assert_start_fails(pipeline_from_dict(raw), "stage process 'bad'.*field 'factory'.*returned None")


def test_names_the_user_got_wrong_cannot_break_the_message_into_lines() -> None:
    raw = solo(name="two\nlines")
    with pytest.raises(ConfigError) as info:
        pipeline_from_dict(raw)
    assert "\n" not in str(info.value) and "field 'name'" in str(info.value)
    raw = solo()
    raw["stages"][0].update({"terminal": False, "next": "x\ny" * 100})
    with pytest.raises(ConfigError) as info:
        pipeline_from_dict(raw)
    message = str(info.value)
    assert "\n" not in message and len(message) < 200 and "field 'next': unknown stage" in message
    raw = solo()
    raw["stages"][0]["bad\nkey"] = 1
    with pytest.raises(ConfigError, match=r"field 'bad\\nkey': unknown field"):
        pipeline_from_dict(raw)
