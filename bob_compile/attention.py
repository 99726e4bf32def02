"""`bob_compile.attention`: softmax attention with exact, fused derivatives of every order.

A drop-in for `torch.nn.functional.scaled_dot_product_attention(query, key, value,
is_causal=..., scale=..., enable_gqa=...)` without `attn_mask` and dropout. The flashbob
backend inserts calls of this function into captured graphs; users may also call it in
their own code, compiled (with any backend) or not.
"""
import math

import torch

from .autograd import AttnFn

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_inputs(query, key, value, enable_gqa):
    """The errors SDPA gives for the same mistakes, said in our name."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"bob_compile.attention: {name} must be a Tensor, got {type(t).__name__}")
    if not (query.dtype == key.dtype == value.dtype):
        raise RuntimeError(
            "bob_compile.attention: Expected query, key, and value to have the same dtype, but got "
            f"query.dtype: {query.dtype} key.dtype: {key.dtype} and value.dtype: {value.dtype} instead.")
    if query.dtype not in _FLOAT_DTYPES:
        raise RuntimeError(f"bob_compile.attention: expected a floating dtype "
                           f"(float16, bfloat16, float32, float64), got {query.dtype}.")
    if not (query.device == key.device == value.device):
        raise RuntimeError(
            "bob_compile.attention: Expected query, key, and value to be on the same device, but got "
            f"query: {query.device} key: {key.device} and value: {value.device} instead.")
    if min(query.dim(), key.dim(), value.dim()) < 2:
        raise RuntimeError(
            "bob_compile.attention: Expected query, key, and value to all be at least 2 dimensional, "
            f"but got query.dim: {query.dim()} key.dim: {key.dim()} and value.dim: {value.dim()} instead.")
    if query.shape[-1] != key.shape[-1]:
        raise RuntimeError(
            f"bob_compile.attention: query and key must have the same embedding (last) dimension, "
            f"got query {tuple(query.shape)} and key {tuple(key.shape)}.")
    if key.shape[-2] != value.shape[-2]:
        raise RuntimeError(
            f"bob_compile.attention: key and value must have the same sequence length (dim -2), "
            f"got key {tuple(key.shape)} and value {tuple(value.shape)}.")
    if enable_gqa:
        if min(query.dim(), key.dim(), value.dim()) < 3:
            raise RuntimeError("bob_compile.attention: enable_gqa=True needs a head dimension "
                               "(dim -3) on query, key and value.")
        hq, hk, hv = query.shape[-3], key.shape[-3], value.shape[-3]
        if hk != hv or hq % hk != 0:
            raise RuntimeError(
                "bob_compile.attention: Number of heads in key and value must divide the number of "
                f"heads in query (enable_gqa=True), got query {hq}, key {hk} and value {hv} heads.")


def _broadcast_leading(query, key, value, enable_gqa):
    """Broadcast leading dims like SDPA's math path; with GQA the head dim is exempt."""
    split = -3 if enable_gqa else -2
    try:
        lead = torch.broadcast_shapes(query.shape[:split], key.shape[:split], value.shape[:split])
    except RuntimeError:
        heads = "" if enable_gqa or query.dim() < 3 or key.dim() < 3 else (
            f" (query has {query.shape[-3]} heads and key {key.shape[-3]}: pass enable_gqa=True "
            "for grouped-query attention)")
        raise RuntimeError(
            f"bob_compile.attention: the leading dims of query {tuple(query.shape)}, key "
            f"{tuple(key.shape)} and value {tuple(value.shape)} do not broadcast{heads}.") from None

    def expand(t):
        shape = (*lead, *t.shape[split:])
        return t if t.shape == shape else t.expand(shape)
    return expand(query), expand(key), expand(value)


@torch.compiler.allow_in_graph
def attention(query, key, value, *, is_causal=False, scale=None, enable_gqa=False):
    """Softmax attention, `softmax(query @ key^T * scale) @ value`.

    Args:
        query: (..., Hq, L, E); key: (..., Hkv, S, E); value: (..., Hkv, S, Ev).
        is_causal: mask aligned top-left, as in PyTorch: query i attends to keys j <= i.
        scale: defaults to 1/sqrt(E).
        enable_gqa: grouped-query attention; Hkv must divide Hq (query head h uses key/value
            head h // (Hq // Hkv)). Without it, leading dims (heads included) broadcast.

    Returns (..., Hq, L, Ev), in query's dtype. Rows that see no key (S == 0) are zeros.
    Differentiable to any order, by autograd and torch.func; first and second order run
    fused kernels (Triton on CUDA, a memory-efficient blockwise path elsewhere).
    """
    _check_inputs(query, key, value, enable_gqa)
    if not isinstance(is_causal, bool):
        raise TypeError(f"bob_compile.attention: is_causal must be a bool, got {type(is_causal).__name__}")
    query, key, value = _broadcast_leading(query, key, value, enable_gqa)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    o, _ = AttnFn.apply(query, key, value, float(scale), is_causal)
    return o
