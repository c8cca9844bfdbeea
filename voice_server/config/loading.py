"""Reading a pipeline YAML file: bounded, strict, and every failure a one-paragraph `ConfigError`.

Limits (a config is a hand-written file of a few KiB; anything past these is a mistake or an attack):
- `MAX_FILE_BYTES`: the file size;
- UTF-8 only;
- duplicate mapping keys are refused at every level (YAML would keep the last one silently);
- `MAX_DEPTH`: nesting of mappings and lists, aliases included (no RecursionError, no recursive alias);
- `topology.MAX_STAGES`: the number of stages.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml
from yaml.events import AliasEvent, MappingStartEvent, SequenceStartEvent
from yaml.nodes import CollectionNode, MappingNode, Node, ScalarNode, SequenceNode

from voice_server.config.errors import ConfigError, fail, one_line, quoted
from voice_server.config.pipeline import PipelineConfig, StageConfig
from voice_server.config.placement import placement_from_dict
from voice_server.config.topology import check_num_stages
from voice_server.config.twilio import twilio_from_dict
from voice_server.config.voices import voices_from_dict

MAX_FILE_BYTES = 1 << 20
"""Largest pipeline config file read (1 MiB)."""
MAX_DEPTH = 32
"""Deepest nesting of mappings and lists, counted through aliases (a stage's `factory_args` sits at 4)."""

_MERGE_TAG = "tag:yaml.org,2002:merge"


class RefusedYAML(yaml.MarkedYAMLError):
    """Well-formed YAML that a pipeline config may not use (duplicate keys, too deep, recursive aliases)."""


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys, nesting deeper than MAX_DEPTH and recursive aliases."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._keys: list[str] = []
        """Where the composer is: the keys (and list indexes) of the open collections, for messages."""
        self._heights: dict[int, int] = {}
        """id(collection node) -> its nesting height, aliases followed; set once the node is composed."""

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        if self.check_event(AliasEvent):
            event = self.peek_event()
            node = self.anchors.get(event.anchor)
            if isinstance(node, CollectionNode) and id(node) not in self._heights:
                why = f"{self._at()}alias *{event.anchor} is inside the node it names (recursive alias)"
                raise RefusedYAML(None, None, why, event.start_mark)
            return super().compose_node(parent, index)
        if not self.check_event(MappingStartEvent, SequenceStartEvent):
            return super().compose_node(parent, index)
        self._keys.append(_label(index))
        try:
            # NOTE: the composer recurses once per level: stop long before Python's recursion limit.
            if len(self._keys) > MAX_DEPTH:
                why = f"{self._at()}nested deeper than {MAX_DEPTH} levels"
                raise RefusedYAML(None, None, why, self.peek_event().start_mark)
            node = super().compose_node(parent, index)
            assert node is not None
            # NOTE: aliases can stack shallow nodes into a deep value (a: [*b], b: [*c] ...), so the
            # height is measured through them, in one pass: children are composed before their parent.
            if isinstance(node, SequenceNode):
                children: list[Node] = node.value
            else:
                children = [n for pair in node.value for n in pair]
            height = 1 + max((self._heights.get(id(child), 0) for child in children), default=0)
            if len(self._keys) - 1 + height > MAX_DEPTH:
                why = f"{self._at()}nested deeper than {MAX_DEPTH} levels (counting through aliases)"
                raise RefusedYAML(None, None, why, node.start_mark)
            self._heights[id(node)] = height
            return node
        finally:
            self._keys.pop()

    def _at(self) -> str:
        # NOTE: the first entry is the document root.
        keys = self._keys[1:]
        return f"field '{'.'.join(keys)}': " if keys else ""

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        # NOTE: checked on the node as written, before merge keys (`<<: *base`) are flattened in:
        # overriding a merged key is what merging is for, repeating a written key is a mistake.
        first: dict[Any, Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                seen = first.setdefault(key, key_node)
            except TypeError:
                continue  # unhashable key: the base constructor reports it
            if seen is not key_node:
                named = _scalar_value(node, "name")
                inside = f" of {quoted(named)}" if named else ""
                raise RefusedYAML(
                    None, None,
                    f"field {quoted(key)}: duplicate key in the mapping{inside} that starts at line "
                    f"{node.start_mark.line + 1} (first at line {seen.start_mark.line + 1}); YAML would keep "
                    "only the last one",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep)


def _label(index: Any) -> str:
    # NOTE: compose_mapping_node passes a value's key node as `index`, compose_sequence_node the position.
    if isinstance(index, ScalarNode):
        return str(index.value)
    return str(index) if isinstance(index, int) else "?"


def _scalar_value(node: MappingNode, key: str) -> str | None:
    for key_node, value_node in node.value:
        if isinstance(key_node, ScalarNode) and key_node.value == key and isinstance(value_node, ScalarNode):
            return str(value_node.value)
    return None


def _describe(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = exc.problem or ""
        if exc.context:
            context_mark = exc.context_mark
            at = f" at line {context_mark.line + 1}" if context_mark is not None and context_mark is not mark else ""
            what = f"{what} ({exc.context}{at})"
        return one_line(where + what)
    return one_line(str(exc))


def read_yaml(path: Path) -> Any:
    """The YAML document in `path`, or a ConfigError naming the file and, where known, the line."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read pipeline config: {one_line(str(exc))}") from exc
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB, the limit for a pipeline config")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}: not UTF-8 text: byte 0x{data[exc.start]:02x} at line {line}; save the file as UTF-8"
        ) from exc
    loader: StrictLoader | None = None
    try:
        # NOTE: inside the try: the reader refuses control characters (ReaderError) already when built.
        loader = StrictLoader(text)
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        kind = "" if isinstance(exc, RefusedYAML) else "invalid YAML: "
        raise ConfigError(f"{path}: {kind}{_describe(exc)}") from exc
    except RecursionError as exc:  # NOTE: MAX_DEPTH should prevent this; a safety net, not a path
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from exc
    finally:
        if loader is not None:
            loader.dispose()


def _mapping(raw: Any, where: str, known: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    for key in raw:
        if key not in known:
            raise fail(where, key, f"unknown field (known: {', '.join(sorted(known))})")
    return dict(raw)


def pipeline_from_dict(raw: Any) -> PipelineConfig:
    name = raw.get("name", "pipeline") if isinstance(raw, dict) else "pipeline"
    where = f"pipeline {quoted(name)}"
    top = _mapping(raw, where, tuple(f.name for f in dataclasses.fields(PipelineConfig)))
    raw_stages = top.get("stages")
    if not isinstance(raw_stages, list):
        raise fail(where, "stages", "must be a list of stages")
    # NOTE: before building any stage: a 5000-stage file is refused in one line, not stage by stage.
    check_num_stages(where, len(raw_stages))
    stages = []
    stage_fields = tuple(f.name for f in dataclasses.fields(StageConfig))
    for i, raw_stage in enumerate(raw_stages):
        stage_name = raw_stage.get("name", "?") if isinstance(raw_stage, dict) else None
        stage_where = f"stage #{i} {quoted(stage_name)}" if stage_name is not None else f"stage #{i}"
        kwargs = _mapping(raw_stage, stage_where, stage_fields)
        for required in ("name", "factory"):
            if required not in kwargs:
                raise fail(stage_where, required, "missing")
        if "stream_to" in kwargs:
            value = kwargs["stream_to"]
            kwargs["stream_to"] = tuple(value) if isinstance(value, list) else (value,)
        for optional in ("factory_args", "env"):
            if optional in kwargs and kwargs[optional] is None:
                kwargs.pop(optional)  # NOTE: `env:` with nothing after it reads as null: no variables
        if "placement" in kwargs:
            kwargs["placement"] = placement_from_dict(stage_where, kwargs["placement"])
        stages.append(StageConfig(**kwargs))
    top["stages"] = tuple(stages)
    top["voices"] = voices_from_dict(where, top.get("voices"))
    top["twilio"] = twilio_from_dict(where, top.get("twilio"))
    top.setdefault("name", name)
    return PipelineConfig(**top)


def load_pipeline(path: str | Path) -> PipelineConfig:
    return pipeline_from_dict(read_yaml(Path(path)))
