"""Stand-in linears for a BLAS whose kernels round some row counts differently, so that the runner's
row plan can be tested on any CPU (the real BLAS's choice differs between machines).

Each computes in float64 and rounds to float32: the same bits for a row whatever the row count (a
float64 difference of ~1e-16 crossing a float32 rounding boundary is a ~1e-9 event per value), then
adds the pattern it stands in for. `create_count_dependent_llm` is a stage factory over a tiny dummy
Llama whose linears are all `CountDependentLinear` (for `/health` in a real server).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tiny_llama import tiny_llama
from torch import nn

from voice_server.engine.runtime import StageContext
from voice_server.models.llama import LlamaForCausalLM, load_llama
from voice_server.runners import DecoderRunner, DecoderRunnerConfig

NUDGE = 2.0**-12
TINY = tiny_llama(vocab_size=256, hidden_size=64, intermediate_size=128, head_dim=16, max_position_embeddings=512)


class ExactLinear(nn.Linear):
    def num_rows(self, x: torch.Tensor) -> int:
        return x.numel() // self.in_features

    def exact(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.double()
        return F.linear(x.double(), self.weight.double(), bias).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.exact(x)


class CountDependentLinear(ExactLinear):
    """Every row count rounds its own way: no padding makes a row's bits independent of the count."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.exact(x) + self.num_rows(x) * NUDGE


class MultipleOfFourLinear(ExactLinear):
    """MKL's MKL_CBWR=COMPATIBLE pattern (measured on an EPYC): 8, 12, 16, ... rows agree, every other
    count rounds its own way."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.num_rows(x)
        return self.exact(x) if m >= 8 and m % 4 == 0 else self.exact(x) + m * NUDGE


class PositionalLinear(ExactLinear):
    """A row's bits depend on where it sits in the batch (an edge kernel for the last rows)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.exact(x)
        flat = out.reshape(-1, self.out_features)
        flat[-1] += NUDGE
        return out


def swap_linears(model: nn.Module, cls: type[ExactLinear]) -> nn.Module:
    """Every plain `nn.Linear` of `model` replaced by `cls` over the same parameters (ties kept)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                swapped = cls(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                swapped.weight = child.weight
                swapped.bias = child.bias
                setattr(parent, name, swapped)
    return model


def stand_in_llama(cls: type[ExactLinear], seed: int = 1) -> LlamaForCausalLM:
    model = load_llama(load_format="dummy", config=TINY, seed=seed)
    assert isinstance(model, LlamaForCausalLM)
    swap_linears(model, cls)
    return model


def create_count_dependent_llm(ctx: StageContext) -> DecoderRunner:
    """A text `ar` stage whose BLAS has no batch-invariant padding: it must start anyway and say so."""
    config = DecoderRunnerConfig(budget_bytes=ctx.memory_budget_bytes(), page_size=4,
                                 max_step_tokens=ctx.stage.max_step_tokens, max_num_seqs=ctx.stage.max_batch_size)
    return DecoderRunner(stand_in_llama(CountDependentLinear), None, config)
