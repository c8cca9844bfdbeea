"""Pipeline configuration: a YAML file of stages, loaded into frozen, validated dataclasses.

Every validation error is a `ConfigError` whose message names the stage and the field, so a user
editing `configs/*.yaml` can find the line to fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from voice_server.config.env import check_env, check_process_env, process_env
from voice_server.config.errors import ConfigError, fail, quoted
from voice_server.config.fields import Choice, Flag, Number, Rule, Text, check_fields
from voice_server.config.placement import Placement, check_process_placement, process_placement
from voice_server.config.priority import check_process_nice, process_nice
from voice_server.config.topology import check_topology, reachable_from
from voice_server.config.twilio import TwilioConfig
from voice_server.config.voices import VOICE_NAME_RE, VoiceConfig, check_voices, find_voice

__all__ = [
    "MAX_REPLICAS", "PIPELINE_RULES", "REPLICA_SEP", "SCHEDULERS", "STAGE_RULES", "ConfigError", "PipelineConfig",
    "StageConfig",
]

SCHEDULERS = ("simple", "ar", "code2wav")
"""Scheduler names a config may use; which are implemented is `voice_server.scheduling.SCHEDULER_BUILDERS`."""
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,23}$")
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_LABEL_RE = re.compile(r"^[^\x00-\x1f\x7f]{1,64}$")
MAX_REPLICAS = 64
"""Most processes one replicated stage may run (each is an OS process with its own model)."""
REPLICA_SEP = "@"
"""Between a process group and a replica's index (`code2wav@1`): never '.', which ends a process name in a relay
owner (`engine/ipc.py: owner_process`), and not a name character, so no configured name collides."""
_FACTORY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")

STAGE_RULES: dict[str, Rule] = {
    "name": Text(_NAME_RE, "must match [a-z][a-z0-9_]{0,23}"),
    "factory": Text(_FACTORY_RE, "'package.module:callable'"),
    "scheduler": Choice(SCHEDULERS),
    "terminal": Flag(),
    "device": Text(_DEVICE_RE, "'cpu', 'cuda' or 'cuda:N'"),
    "process": Text(_NAME_RE, "must match [a-z][a-z0-9_]{0,23}", is_empty_allowed=True),
    "tp_size": Number(int, minimum=1),
    "memory_fraction": Number(float, minimum=0.0, maximum=1.0, is_min_exclusive=True),
    "max_batch_size": Number(int, minimum=1),
    "batch_window_ms": Number(float, minimum=0.0),
    "max_step_tokens": Number(int, minimum=1),
    "prefix_cache": Flag(),
    "speech_lead_s": Number(float, minimum=0.0),
    "initial_chunk_frames": Number(int, minimum=1),
    "chunk_frames": Number(int, minimum=1),
    "replicas": Number(int, minimum=1, maximum=MAX_REPLICAS),
    "nice": Number(int, minimum=-20, maximum=19),
}
"""Scalar fields of a stage and their rules; `next`, `stream_to`, `factory_args` are checked by hand, `env`
in `config/env.py`."""

@dataclass(frozen=True)
class StageConfig:
    name: str
    """Unique stage name: lowercase letters, digits, '_' (it becomes part of socket names)."""
    factory: str
    """Import path `package.module:callable` of the stage's runner factory."""
    scheduler: str = "simple"
    """One of `simple`, `ar`, `code2wav`."""
    next: str | None = None
    """Stage that receives this stage's final result as a new request."""
    stream_to: tuple[str, ...] = ()
    """Stages that receive this stage's stream chunks (each gets new_request, chunks, stream_done)."""
    terminal: bool = False
    """Whether this stage's outputs (stream and result) go to the client."""
    device: str = "cpu"
    """`cpu`, `cuda` or `cuda:N`."""
    process: str = ""
    """OS process group; stages with the same value share one process. Defaults to the stage name."""
    tp_size: int = 1
    """Tensor-parallel degree (only 1 until the GPU work)."""
    memory_fraction: float = 0.05
    """Fraction of the device's memory this stage may use (host RAM for `cpu`)."""
    max_batch_size: int = 8
    """Most work items one forward call may take."""
    batch_window_ms: float = 0.0
    """How long a partial batch may wait for more work before it runs."""
    max_step_tokens: int = 512
    """`ar` stages: most tokens one step computes (decode tokens plus prefill chunks)."""
    prefix_cache: bool = True
    """`ar` stages: reuse the KV pages of a prompt prefix another request already computed."""
    speech_lead_s: float = 0.0
    """`ar` stages whose text becomes speech: a request this many seconds of speech ahead of its listener sits
    out steps while another request has no output yet or less than that ahead
    (`voice_server/scheduling/speech_lead.py`); 0: off."""
    initial_chunk_frames: int = 2
    """`code2wav` stages: codec frames in a stream's first vocoder chunk (small: first audio sooner)."""
    chunk_frames: int = 10
    """`code2wav` stages: codec frames in each later chunk (at 12.5 Hz, 10 frames = 0.8 s of audio)."""
    factory_args: dict[str, Any] = field(default_factory=dict)
    """Free-form keyword arguments for the factory."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables the stage's process sets before it imports torch (`config/env.py`)."""
    replicas: int = 1
    """Processes that run this stage, each with its own model (`process@0` ... `process@N-1`); the coordinator
    sends each request to the least loaded one, and all of a request's input to that one. The stage must be alone
    in its process group."""
    placement: Placement | None = None
    """With `launcher: ray`: what the node of this stage's process must offer (`config/placement.py`); None: any
    node of the cluster."""
    nice: int = 0
    """The CPU priority of this stage's process (Unix nice, -20..19: higher yields the CPU to the others;
    `config/priority.py` says when it matters)."""

    def __post_init__(self) -> None:
        where = f"stage {quoted(self.name)}"
        check_fields(where, self, STAGE_RULES)
        if self.next is not None and not isinstance(self.next, str):
            raise fail(where, "next", f"must be a stage name, got {self.next!r}")
        if not isinstance(self.stream_to, tuple) or not all(isinstance(s, str) for s in self.stream_to):
            raise fail(where, "stream_to", "must be a list of stage names")
        if self.tp_size != 1:
            raise fail(where, "tp_size", "only 1 is supported until tensor parallelism lands")
        if not isinstance(self.factory_args, dict):
            raise fail(where, "factory_args", "must be a mapping")
        check_env(where, self.env)
        if self.placement is not None:
            if not isinstance(self.placement, Placement):
                raise fail(where, "placement", "must be a Placement")
            self.placement.check(where)
        if self.scheduler == "ar" and self.max_step_tokens < self.max_batch_size:
            # NOTE: decode takes one token per running request per step; a smaller budget would
            # leave some running requests without a token every step.
            raise fail(where, "max_step_tokens", f"must be >= max_batch_size ({self.max_batch_size}) for an ar stage, "
                       f"got {self.max_step_tokens}")

    @property
    def process_name(self) -> str:
        """The stage's process group (one process, or the group its replicas share)."""
        return self.process or self.name

    @property
    def process_names(self) -> tuple[str, ...]:
        """The processes that run this stage: the group itself, or one per replica."""
        if self.replicas == 1:
            return (self.process_name,)
        return tuple(f"{self.process_name}{REPLICA_SEP}{i}" for i in range(self.replicas))

    @property
    def device_key(self) -> str:
        """Budget key: `cpu` or `cuda:N` (bare `cuda` is device 0)."""
        return "cuda:0" if self.device == "cuda" else self.device

    @property
    def targets(self) -> tuple[str, ...]:
        return ((self.next,) if self.next else ()) + self.stream_to


PIPELINE_RULES: dict[str, Rule] = {
    "name": Text(_LABEL_RE, "printable, at most 64 characters"),
    "entry": Text(is_empty_allowed=True),
    "startup_timeout_s": Number(float, minimum=0.0, is_min_exclusive=True),
    "inline_threshold_bytes": Number(int, minimum=0),
    "relay_slab_bytes": Number(int, minimum=1 << 16),
    "control_transport": Choice(("ipc", "tcp")),
    "launcher": Choice(("local", "ray")),
    "ray_address": Text(),
    "stream_input": Flag(),
    "turn_detection": Choice(("server_vad", "semantic_vad")),
    "tcp_host": Text(),
    "max_inflight_requests": Number(int, minimum=1, is_nullable=True),
    "max_relay_bytes": Number(int, minimum=1 << 16, is_nullable=True),
    "max_relay_segments": Number(int, minimum=1, is_nullable=True),
    "max_relay_wait_s": Number(float, minimum=0.0),
    "request_timeout_s": Number(float, minimum=0.0, is_min_exclusive=True, is_nullable=True),
    "max_queued_outputs": Number(int, minimum=1),
    "restart_backoff_s": Number(float, minimum=0.0, is_min_exclusive=True),
    "max_restart_backoff_s": Number(float, minimum=0.0, is_min_exclusive=True),
    "default_voice": Text(VOICE_NAME_RE, "a voice name", is_empty_allowed=True),
}
"""Every pipeline-level field but `stages`, `voices` (`config/voices.py`) and `twilio` (`config/twilio.py`), with its
rule. A new field needs a row here (a test checks); `Number(..., is_nullable=True)` for limits where null means
auto/off."""


@dataclass(frozen=True)
class PipelineConfig:
    name: str
    stages: tuple[StageConfig, ...]
    entry: str = ""
    """Stage that receives new requests; defaults to the first stage."""
    stream_input: bool = False
    """The entry stage takes a spoken turn while the user speaks (a transcriber): the session opens
    the turn's request at speech start and streams its audio (`{"audio"}` chunks, 16 kHz int16),
    ending the stream at the end of the turn. False: a request carries whole turns."""
    turn_detection: str = "server_vad"
    """Turn detection of a session whose client names none (`/ws` without `turn_detection`, a new
    `/v1/realtime` session, every `/twilio/media` call): `server_vad` (a fixed silence ends the turn) or
    `semantic_vad` (eagerness auto: an end-of-turn model decides; needs the Smart Turn and Silero models
    of `pip install --no-deps pipecat-ai==1.14.0`)."""
    startup_timeout_s: float = 120.0
    """How long a stage process may take to load and report ready."""
    inline_threshold_bytes: int = 16384
    """Tensors smaller than this travel inside the control message instead of the relay."""
    relay_slab_bytes: int = 32 << 20
    """Shared-memory slab per producer process; larger tensors use overflow segments."""
    control_transport: str = "ipc"
    """ZMQ transport of the control plane: `ipc` (one host) or `tcp`."""
    tcp_host: str = "127.0.0.1"
    """Interface the control sockets use with `control_transport: tcp`; with `launcher: ray` the address the
    other nodes reach this host at (`0.0.0.0` or `::`: this node's address in the cluster)."""
    launcher: str = "local"
    """Who starts the stage processes: `local` (this host, the default) or `ray` (a Ray actor per process, placed by
    each stage's `placement` in one placement group; needs `pip install ray` and `control_transport: tcp`)."""
    ray_address: str = "auto"
    """With `launcher: ray`: the cluster to join (`ray.init(address=...)`): `auto` finds the one started on this
    host (`ray start --head`), or `HOST:PORT` of its head node."""
    max_inflight_requests: int | None = None
    """Requests admitted at once; beyond it `submit` refuses with OverloadError. null: sized from
    the descriptor limit."""
    max_relay_bytes: int | None = None
    """Live relay bytes per producer process (slab plus overflow). null: a share of /dev/shm."""
    max_relay_segments: int | None = None
    """Live relay overflow segments per producer process (each holds a descriptor). null: sized from
    the descriptor limit."""
    max_relay_wait_s: float = 5.0
    """How long a stage waits for room in its full relay (its consumers' acks) before the output's
    request fails as an overload. The stage serves nothing else meanwhile: a full relay means its
    consumers are behind, and waiting is what lets admitted work complete instead of failing."""
    request_timeout_s: float | None = None
    """Default deadline of a request; past it the request fails and is aborted everywhere. null: none."""
    max_queued_outputs: int = 1024
    """Terminal outputs of one request waiting for its consumer; one more fails the request ("consumer
    too slow") and aborts it everywhere, so a consumer that stops reading cannot grow memory."""
    restart_backoff_s: float = 0.5
    """Delay before restarting a crashed stage process; doubles per consecutive crash."""
    max_restart_backoff_s: float = 30.0
    """Cap of the restart delay."""
    voices: tuple[VoiceConfig, ...] = ()
    """What a session may choose its responses to speak in (`config/voices.py`): each voice's request params and
    the OpenAI voice names that choose it. None declared: a session's voice name is metadata only."""
    default_voice: str = ""
    """The voice of a session that names none; "" is the first declared."""
    twilio: TwilioConfig | None = None
    """What `WS /twilio/media` calls get (instructions, greeting, tools and their webhook: `config/twilio.py`);
    None: the defaults, no tools."""

    def __post_init__(self) -> None:
        where = f"pipeline {quoted(self.name)}"
        check_fields(where, self, PIPELINE_RULES)
        if not isinstance(self.stages, tuple) or not all(isinstance(s, StageConfig) for s in self.stages):
            raise fail(where, "stages", "must be a tuple of StageConfig")
        if not self.stages:
            raise fail(where, "stages", "at least one stage is required")
        check_topology(where, self.stages, self.entry_stage)
        check_process_env(self.stages)
        check_process_placement(self.stages, self.launcher)
        check_process_nice(self.stages)
        if self.launcher == "ray" and self.control_transport != "tcp":
            raise fail(where, "control_transport", "must be tcp with `launcher: ray`: stages on other nodes "
                       "cannot reach this host's ipc sockets")
        check_voices(where, self.voices, self.default_voice)
        if self.twilio is not None and not isinstance(self.twilio, TwilioConfig):
            raise fail(where, "twilio", "must be a TwilioConfig")
        if self.max_relay_bytes is not None and self.max_relay_bytes < self.relay_slab_bytes:
            raise fail(where, "max_relay_bytes", f"must be at least relay_slab_bytes ({self.relay_slab_bytes})")
        if self.max_restart_backoff_s < self.restart_backoff_s:
            raise fail(where, "max_restart_backoff_s", "must be >= restart_backoff_s")

    @property
    def default_voice_config(self) -> VoiceConfig | None:
        """The default voice; None when the pipeline declares none."""
        if not self.voices:
            return None
        return find_voice(self.voices, self.default_voice) if self.default_voice else self.voices[0]

    @property
    def entry_stage(self) -> str:
        return self.entry or self.stages[0].name

    @property
    def takes_images(self) -> bool:
        """Its entry stage runs a vision encoder (`factory_args.vision: true`, `voice_server/stages/audio_encoder.py`):
        sessions may send images; elsewhere they are refused as unsupported."""
        return self.stage(self.entry_stage).factory_args.get("vision") is True

    @cached_property
    def _by_name(self) -> dict[str, StageConfig]:
        # NOTE: cached_property writes the instance __dict__ directly, so it works on a frozen dataclass.
        return {stage.name: stage for stage in self.stages}

    def stage(self, name: str) -> StageConfig:
        return self._by_name[name]

    def reachable_from(self, name: str) -> list[str]:
        """Stage names reachable from `name` (itself included), in breadth-first order."""
        return reachable_from(self._by_name, name)

    @property
    def terminal_stages(self) -> tuple[str, ...]:
        return tuple(s for s in self.reachable_from(self.entry_stage) if self.stage(s).terminal)

    @property
    def processes(self) -> dict[str, tuple[StageConfig, ...]]:
        """Process name -> its stages, in config order: one entry per process group, or per replica of a
        replicated stage (`check_topology` keeps such a stage alone in its group)."""
        groups: dict[str, list[StageConfig]] = {}
        for stage in self.stages:
            for process in stage.process_names:
                groups.setdefault(process, []).append(stage)
        return {name: tuple(stages) for name, stages in groups.items()}

    @cached_property
    def replicated_stages(self) -> tuple[str, ...]:
        """Stages with `replicas` > 1, in config order: the ones a request's replica plan names."""
        return tuple(s.name for s in self.stages if s.replicas > 1)

    def process_nice(self, process: str) -> int:
        """The CPU priority (`nice`) process group `process` sets at start."""
        return process_nice(self.processes[process])

    def process_env(self, process: str) -> dict[str, str]:
        """The environment variables process group `process` sets at start (its stages' `env`)."""
        return process_env(self.processes[process])

    def process_placement(self, process: str) -> Placement:
        """Where process `process` (a group or a replica) runs with `launcher: ray`; empty: any node."""
        return process_placement(self.processes[process])
