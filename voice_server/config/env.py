"""A stage's `env`: environment variables its process sets before its modules (torch, CUDA) load.

The use it is made for is CUDA MPS: `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` caps the SMs one process's
CUDA context may use, and it is read when that context is created, so it must be in the environment
before the stage imports torch. Other per-stage knobs fit too (`OMP_NUM_THREADS`,
`PYTORCH_CUDA_ALLOC_CONF`, `NCCL_*`).

Rules (every one a `ConfigError` naming the stage and the field `env.NAME`):
- names match `^[A-Z_][A-Z0-9_]*$`; values are strings (quote numbers in YAML: `"30"`), printable, at
  most `MAX_VALUE_LEN` characters; at most `MAX_VARS` names per stage;
- `DENIED_NAMES` and `DENIED_PREFIXES` are refused (why: next to each);
- stages sharing one `process` group share one environment: they may not give one name two values.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from voice_server.config.errors import fail, quoted, show

if TYPE_CHECKING:
    from voice_server.config.pipeline import StageConfig

MAX_VARS = 32
MAX_VALUE_LEN = 1024
_NAME_RE = re.compile(r"^[A-Z_][A-Z0-9_]{0,127}$")

DENIED_NAMES: dict[str, str] = {
    # NOTE: per-stage PATH would make tool lookups (triton's ptxas, inductor's compiler) differ
    # between stages of one server; set it for the whole server instead.
    "PATH": "set it for the whole server, not one stage",
    # NOTE: device numbering must mean the same in every process: `device: cuda:1`, the budget per
    # device and the one-device-per-process check all assume the host's numbering.
    "CUDA_VISIBLE_DEVICES": "renumbers the GPUs under the stage; choose the GPU with `device: cuda:N`",
    "CUDA_DEVICE_ORDER": "renumbers the GPUs under the stage; choose the GPU with `device: cuda:N`",
}
DENIED_PREFIXES: dict[str, str] = {
    # NOTE: the interpreter and the dynamic loader read these at exec, before the stage's entry
    # point runs: set there they would do nothing in the stage, yet change its child processes.
    "PYTHON": "read when the interpreter starts, before a stage can set it",
    "LD_": "read by the dynamic loader when the process starts, before a stage can set it",
    # NOTE: the engine's own settings (run directory) must agree between the server and its stages.
    "VOICE_SERVER_": "reserved for the server's own settings",
}


def check_env(where: str, env: object) -> None:
    """Raise a ConfigError for the first bad name or value of a stage's `env`."""
    if not isinstance(env, dict):
        raise fail(where, "env", f"must be a mapping of NAME: \"value\", got {show(env)}")
    if len(env) > MAX_VARS:
        raise fail(where, "env", f"{len(env)} variables is more than the {MAX_VARS} a stage may set")
    for name, value in env.items():
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise fail(where, f"env.{name}" if isinstance(name, str) and name.isprintable() else "env",
                       f"name {quoted(name)} must match [A-Z_][A-Z0-9_]* (at most 128 characters)")
        field_name = f"env.{name}"
        denied = DENIED_NAMES.get(name) or next(
            (why for prefix, why in DENIED_PREFIXES.items() if name.startswith(prefix)), None
        )
        if denied is not None:
            raise fail(where, field_name, f"may not be set per stage: {denied}")
        if not isinstance(value, str):
            raise fail(where, field_name, f"must be a string (quote it in YAML: \"{value}\"), got {show(value)}")
        if len(value) > MAX_VALUE_LEN or not value.isprintable():
            why = f"must be printable and at most {MAX_VALUE_LEN} characters, got {show(value)}"
            raise fail(where, field_name, why)


def check_process_env(stages: Sequence[StageConfig]) -> None:
    """Stages in one process group share its environment: one name may not get two values."""
    seen: dict[tuple[str, str], tuple[str, str]] = {}
    for stage in stages:
        for name, value in stage.env.items():
            first = seen.setdefault((stage.process_name, name), (stage.name, value))
            if first[1] != value:
                raise fail(
                    f"stage {quoted(stage.name)}", f"env.{name}",
                    f"{value!r} conflicts with {first[1]!r} from stage {quoted(first[0])}: both run in "
                    f"process '{stage.process_name}', which has one environment",
                )


def process_env(stages: Sequence[StageConfig]) -> dict[str, str]:
    """The environment a process group's stages set (checked free of conflicts by `check_process_env`)."""
    env: dict[str, str] = {}
    for stage in stages:
        env.update(stage.env)
    return env
