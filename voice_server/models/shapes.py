"""Input checks for model entry points: each says which layout it expects, in one line at its top.

A layout is written as in the docstrings, `"[B, L]"`; alternatives are joined by `|`, e.g.
`"[B, L] | [3, B, L]"`. A dimension is a symbol (any size, but the same symbol must have the same size
in every tensor of one `expect_shapes` call, and in `dims` when given there) or an integer literal.
A mismatch is a `ValueError` that states both sides:

    input_ids: expected [B, L] int64, got shape (3,) float32

Only tensor metadata is read (no device sync), so the checks are cheap enough for every decode step.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

import torch

# dtype groups for inputs that accept any width (masks given as 0/1, lengths, hidden states).
INTEGER: tuple[torch.dtype, ...] = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
FLOATING: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

DType = torch.dtype | Collection[torch.dtype] | None
Spec = tuple[str, torch.Tensor | None, str, DType]

_TOKEN = re.compile(r"^(?:\d+|[A-Za-z_][A-Za-z0-9_]*)$")
_LAYOUTS: dict[str, list[list[str]]] = {}


def _parse(layout: str) -> list[list[str]]:
    """"[B, L] | [3, B, L]" -> [["B", "L"], ["3", "B", "L"]] (memoised)."""
    parsed = _LAYOUTS.get(layout)
    if parsed is None:
        parsed = []
        for alt in layout.split("|"):
            alt = alt.strip()
            if not (alt.startswith("[") and alt.endswith("]")):
                raise ValueError(f"layout {layout!r}: each alternative must look like [B, L]")
            tokens = [t.strip() for t in alt[1:-1].split(",") if t.strip()]
            if not all(_TOKEN.match(t) for t in tokens):
                raise ValueError(f"layout {layout!r}: dimensions are symbols or integers")
            parsed.append(tokens)
        _LAYOUTS[layout] = parsed
    return parsed


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_text(dtype: DType) -> str:
    if dtype is None:
        return ""
    if isinstance(dtype, torch.dtype):
        return f" {_dtype_name(dtype)}"
    if tuple(dtype) == INTEGER:
        return " integer"
    if tuple(dtype) == FLOATING:
        return " floating"
    return " " + "/".join(_dtype_name(d) for d in dtype)


def _bind(tokens: list[str], shape: torch.Size, dims: Mapping[str, int]) -> dict[str, int] | None:
    if len(tokens) != len(shape):
        return None
    bound = dict(dims)
    for token, size in zip(tokens, shape):
        if token.isdigit():
            if int(token) != size:
                return None
        elif bound.setdefault(token, size) != size:
            return None
    return bound


def expect_shape(
    name: str,
    tensor: object,
    layout: str,
    dtype: DType = None,
    dims: dict[str, int] | None = None,
) -> dict[str, int]:
    """Check that `tensor` is a tensor of `layout` (and of `dtype`, one dtype or a group such as
    `INTEGER`); `dims` holds sizes already bound (e.g. {"H": hidden_size}) and is updated in place
    with the symbols this tensor binds. Returns `dims`."""
    dims = {} if dims is None else dims
    alternatives = _parse(layout)
    wanted = f"{layout}{_dtype_text(dtype)}"
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor {wanted}, got {type(tensor).__name__}")
    dtype_ok = dtype is None or (tensor.dtype == dtype if isinstance(dtype, torch.dtype) else tensor.dtype in dtype)
    bound = None
    for tokens in alternatives:
        bound = _bind(tokens, tensor.shape, dims)
        if bound is not None:
            break
    if bound is None or not dtype_ok:
        given = [s for tokens in alternatives for s in tokens if s in dims]
        with_dims = f" with {', '.join(f'{s}={dims[s]}' for s in dict.fromkeys(given))}" if given else ""
        raise ValueError(
            f"{name}: expected {wanted}{with_dims}, got shape {tuple(tensor.shape)} {_dtype_name(tensor.dtype)}"
        )
    dims.update(bound)
    return dims


def expect_shapes(*specs: Spec, dims: dict[str, int] | None = None) -> dict[str, int]:
    """Several `(name, tensor, layout, dtype)` checks sharing one set of symbols, in order; a spec whose
    tensor is None (an optional input not given) is skipped. Returns the bound sizes."""
    dims = {} if dims is None else dims
    for name, tensor, layout, dtype in specs:
        if tensor is not None:
            expect_shape(name, tensor, layout, dtype, dims)
    return dims
