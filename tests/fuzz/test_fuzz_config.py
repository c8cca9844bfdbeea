"""Fuzz: the pipeline YAML loader raises only ``ConfigError`` on any text and any nested mapping.

``voice_server/config/loading.py`` documents every failure as a one-paragraph ``ConfigError`` (bounded
size, UTF-8, no duplicate keys, bounded depth and aliases); ``pipeline_from_dict`` and the dataclasses
behind it validate field by field.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml
from fuzz_values import FUZZ, json_values, numbers, scalars, shaped
from hypothesis import example, given
from hypothesis import strategies as st

from voice_server.config.errors import ConfigError
from voice_server.config.loading import load_pipeline, pipeline_from_dict
from voice_server.config.pipeline import PipelineConfig, StageConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PIPELINE_KEYS = [f.name for f in dataclasses.fields(PipelineConfig)]
STAGE_KEYS = [f.name for f in dataclasses.fields(StageConfig)]
WORDS = [*PIPELINE_KEYS, *STAGE_KEYS, "asr", "thinker", "talker", "ar", "generation", "cpu", "cuda:0",
         "tests.text_stages:make", "voice_server.stages:thinker", "a.b:c", "OMP_NUM_THREADS"]
ANY = st.one_of(numbers(), scalars(WORDS), st.lists(scalars(WORDS), max_size=3), json_values(WORDS, max_leaves=6))
NAMES = st.sampled_from(["asr", "thinker", "talker", "x"])
STAGES = shaped({**{key: ANY for key in STAGE_KEYS if key not in ("name", "factory")}, "next": st.one_of(NAMES, ANY),
                 "stream_to": st.one_of(NAMES, st.lists(NAMES, max_size=2), ANY)}, WORDS,
                {"name": st.one_of(NAMES, ANY), "factory": st.one_of(st.sampled_from(WORDS[-4:-1]), ANY)})
PIPELINES = st.one_of(
    shaped({key: ANY for key in PIPELINE_KEYS if key != "stages"}, WORDS,
           {"stages": st.one_of(st.lists(st.one_of(STAGES, ANY), max_size=4), ANY)}),
    json_values(WORDS, max_leaves=40))
YAML_PIECES = st.sampled_from([
    "name: x\n", "stages:\n", "  - name: a\n", "    factory: a.b:c\n", "    next: b\n", "a: &x [1, *x]\n",
    "b: &y {c: 1}\n", "<<: *y\n", "d: *y\n", "e: *nope\n", "  ", "- ", "{", "}", "[", "]", ": ", "\t",
    "!!python/object:os.system\n", "!!binary AAAA\n",
    "? [a]\n", "name: x\nname: y\n", "%YAML 1.1\n---\n", "---\n", "...\n", "\"\\x\"\n", "\x00",
    "\ufeff", "a: 1e400\n", "a: .nan\n",
])
YAML_TEXTS = st.one_of(st.text(max_size=200), st.lists(YAML_PIECES, max_size=30).map("".join),
                       PIPELINES.map(lambda value: yaml.safe_dump(value, allow_unicode=True)))


@FUZZ
@given(PIPELINES)
def test_any_nested_mapping_is_a_pipeline_or_a_config_error(raw: object) -> None:
    try:
        config = pipeline_from_dict(raw)
    except ConfigError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    assert isinstance(config, PipelineConfig)


@FUZZ
@given(st.one_of(YAML_TEXTS, st.binary(max_size=200)))
@example("\x1f")  # was a yaml ReaderError (raised while building the loader, outside its try)
def test_any_yaml_text_is_a_pipeline_or_a_config_error(tmp_path: Path, text: str | bytes) -> None:
    path = tmp_path / "pipeline.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    try:
        load_pipeline(path)
    except ConfigError as exc:
        assert str(exc).startswith(str(path)) or "pipeline" in str(exc) or "stage" in str(exc)


def test_the_shipped_configs_load() -> None:
    for path in sorted(CONFIGS.glob("*.yaml")):
        assert load_pipeline(path).stages
