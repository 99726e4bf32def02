"""`bob_compile.attention`: softmax attention with exact, fused derivatives of every order.

A drop-in for `torch.nn.functional.scaled_dot_product_attention(query, key, value,
attn_mask=..., dropout_p=..., is_causal=..., scale=..., enable_gqa=...)`. The flashbob
backend inserts calls of this function into captured graphs; users may also call it in
their own code, compiled (with any backend) or not.
"""
import math
import sys

import torch

from . import autograd, eager
from .eager import node as eager_node
from .kernels import dropout

_FLOAT_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))


def _check_inputs(query, key, value, enable_gqa):
    """The errors SDPA gives for the same mistakes, said in our name. Runs on every call:
    each property is read once, and the valid case takes one test per rule."""
    tensor = torch.Tensor
    if not (isinstance(query, tensor) and isinstance(key, tensor) and isinstance(value, tensor)):
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, tensor):
                raise TypeError(f"bob_compile.attention: {name} must be a Tensor, got {type(t).__name__}")
    dtype = query.dtype
    if key.dtype != dtype or value.dtype != dtype:
        raise RuntimeError(
            "bob_compile.attention: Expected query, key, and value to have the same dtype, but got "
            f"query.dtype: {query.dtype} key.dtype: {key.dtype} and value.dtype: {value.dtype} instead.")
    if dtype not in _FLOAT_DTYPES:
        raise RuntimeError(f"bob_compile.attention: expected a floating dtype "
                           f"(float16, bfloat16, float32, float64), got {query.dtype}.")
    device = query.device
    if key.device != device or value.device != device:
        raise RuntimeError(
            "bob_compile.attention: Expected query, key, and value to be on the same device, but got "
            f"query: {query.device} key: {key.device} and value: {value.device} instead.")
    qs, ks, vs = query.shape, key.shape, value.shape
    if len(qs) < 2 or len(ks) < 2 or len(vs) < 2:
        raise RuntimeError(
            "bob_compile.attention: Expected query, key, and value to all be at least 2 dimensional, "
            f"but got query.dim: {query.dim()} key.dim: {key.dim()} and value.dim: {value.dim()} instead.")
    if qs[-1] != ks[-1]:
        raise RuntimeError(
            f"bob_compile.attention: query and key must have the same embedding (last) dimension, "
            f"got query {tuple(qs)} and key {tuple(ks)}.")
    if ks[-2] != vs[-2]:
        raise RuntimeError(
            f"bob_compile.attention: key and value must have the same sequence length (dim -2), "
            f"got key {tuple(ks)} and value {tuple(vs)}.")
    if enable_gqa:
        if len(qs) < 3 or len(ks) < 3 or len(vs) < 3:
            raise RuntimeError("bob_compile.attention: enable_gqa=True needs a head dimension "
                               "(dim -3) on query, key and value.")
        hq, hk, hv = qs[-3], ks[-3], vs[-3]
        if hk != hv or hq % hk != 0:
            raise RuntimeError(
                "bob_compile.attention: Number of heads in key and value must divide the number of "
                f"heads in query (enable_gqa=True), got query {hq}, key {hk} and value {hv} heads.")


def _is_numpy_number(x):
    numpy = sys.modules.get("numpy")        # numpy scalars exist only once numpy is imported
    return numpy is not None and isinstance(x, (numpy.number, numpy.bool_))


def _scale_value(scale, head_dim):
    """scale as a number, accepting what SDPA accepts: None (1/sqrt(E)), a Python or numpy
    number, a SymInt/SymFloat, or a 0-d tensor that does not require grad (read once)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, torch.Tensor):
        if scale.dim() != 0:
            raise TypeError(f"bob_compile.attention: scale must be a float, got a Tensor of shape "
                            f"{tuple(scale.shape)}; pass a Python float or a 0-d tensor.")
        if scale.requires_grad:
            raise TypeError(
                "bob_compile.attention: scale must be a float, got a Tensor that requires grad, "
                "whose gradient would be lost (SDPA refuses it too): to learn a scale, multiply "
                "query by the tensor instead; to use its value only, pass scale=float(t).")
        return float(scale)
    if isinstance(scale, (int, float, torch.SymInt, torch.SymFloat)) or _is_numpy_number(scale):
        return float(scale)
    raise TypeError(f"bob_compile.attention: scale must be a float or None (for "
                    f"1/sqrt(E)), got {type(scale).__name__}.")


def _checked_mask(attn_mask, query, key, value):
    """attn_mask as SDPA takes it (bool: True = visible; floating: added to the scaled
    scores), checked."""
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"bob_compile.attention: attn_mask must be a Tensor or None, got "
                        f"{type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise RuntimeError(f"bob_compile.attention: attn_mask must be bool (True: attend) or "
                           f"floating (added to the scores), got {attn_mask.dtype}")
    if attn_mask.device != query.device:
        raise RuntimeError(f"bob_compile.attention: attn_mask is on {attn_mask.device}, query "
                           f"on {query.device}")
    out = (*query.shape[:-1], key.shape[-2])
    if not _broadcasts_to(attn_mask.shape, out):
        raise RuntimeError(f"bob_compile.attention: attn_mask of shape {tuple(attn_mask.shape)} "
                           f"does not broadcast to the scores' shape {out} (..., heads, query "
                           f"length, key length)")
    return attn_mask


def _dropout_value(dropout_p):
    """dropout_p as a float in [0, 1], as F.dropout checks it."""
    if isinstance(dropout_p, torch.Tensor) or not isinstance(
            dropout_p, (int, float, torch.SymInt, torch.SymFloat)) and not _is_numpy_number(dropout_p):
        raise TypeError(f"bob_compile.attention: dropout_p must be a float, got "
                        f"{type(dropout_p).__name__}")
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"bob_compile.attention: dropout probability has to be between 0 and 1, "
                         f"but got {dropout_p}")
    return dropout_p


def _softcap_value(softcap):
    """softcap as a float: 0.0 for None or 0 (no cap), else a positive number."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, torch.Tensor) or not isinstance(
            softcap, (int, float, torch.SymInt, torch.SymFloat)) and not _is_numpy_number(softcap):
        raise TypeError(f"bob_compile.attention: softcap must be a float or None, got "
                        f"{type(softcap).__name__}")
    softcap = float(softcap)
    if not (softcap == 0.0 or softcap > 0.0) or math.isinf(softcap):
        raise ValueError(f"bob_compile.attention: softcap must be positive and finite (or None "
                         f"for no cap), got {softcap}")
    return softcap


def _broadcasts_to(shape, out):
    """Whether shape broadcasts to out unchanged. Plain ints in a loop (torch.broadcast_shapes
    took 23 us per masked call on a CI-class CPU, a third of its host time); symbolic sizes
    (while tracing) through torch.broadcast_shapes, which guards on them as it should."""
    if all(type(n) is int for n in (*shape, *out)):
        return len(shape) <= len(out) and all(
            m == 1 or m == n for m, n in zip(reversed(shape), reversed(out)))
    try:
        return torch.broadcast_shapes(shape, out) == out
    except RuntimeError:
        return False


def _broadcast_leading(query, key, value, enable_gqa):
    """Broadcast leading dims like SDPA's math path; with GQA the head dim is exempt."""
    split = -3 if enable_gqa else -2
    lead = query.shape[:split]
    if key.shape[:split] == lead and value.shape[:split] == lead:
        return query, key, value   # nothing to broadcast (the usual case: no shape work)
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


def _checked_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """A call's arguments checked and normalized as the op takes them: (query, key, value,
    mask, dropout_p, scale, seed), a dropout seed drawn where dropout_p > 0."""
    _check_inputs(query, key, value, enable_gqa)
    if not isinstance(is_causal, bool):
        raise TypeError(f"bob_compile.attention: is_causal must be a bool, got {type(is_causal).__name__}")
    scale = _scale_value(scale, query.shape[-1])
    query, key, value = _broadcast_leading(query, key, value, enable_gqa)
    mask = _checked_mask(attn_mask, query, key, value)
    dropout_p = _dropout_value(dropout_p)
    seed = dropout.draw_seed(query.device) if dropout_p else None
    return query, key, value, mask, dropout_p, scale, seed


@torch.compiler.allow_in_graph
def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, *, softcap=None):
    """Softmax attention, `dropout(softmax(query @ key^T * scale + mask)) @ value`.

    Args:
        query: (..., Hq, L, E); key: (..., Hkv, S, E); value: (..., Hkv, S, Ev).
        attn_mask: None, or a tensor broadcastable to (..., Hq, L, S), as in SDPA: bool
            (True: the query attends to the key) or floating (added to the scaled scores;
            -inf hides a key). Unlike SDPA it may be combined with is_causal (both apply).
            A floating mask that requires grad (a learned bias: T5's relative positions,
            ALiBi slopes as parameters) is differentiated too, at every order, its first
            and second order fused (4-D inputs; others by the closed-form math, logged).
        dropout_p: attention dropout, as in SDPA: each probability is dropped with
            probability dropout_p and the kept ones scaled by 1 / (1 - dropout_p), whenever
            dropout_p > 0 (pass 0.0 outside training, as nn modules do). The keep mask is
            drawn from PyTorch's generator on query's device (a seed per call: manual_seed
            reproduces it) and regenerated by every derivative, never stored.
        is_causal: mask aligned top-left, as in PyTorch: query i attends to keys j <= i.
        scale: a float (or what SDPA takes for one: int, numpy number, 0-d tensor without
            grad); defaults to 1/sqrt(E). Not differentiated, as in SDPA.
        enable_gqa: grouped-query attention; Hkv must divide Hq (query head h uses key/value
            head h // (Hq // Hkv)). Without it, leading dims (heads included) broadcast.
        softcap: None, or c > 0: the scaled scores s are soft-capped to c * tanh(s / c)
            before the masks apply (Gemma 2's attention logit soft-capping).

    Returns (..., Hq, L, Ev), in query's dtype. Rows that see no key (S == 0, or every key
    masked) are zeros, as in SDPA.
    Differentiable to any order, by autograd and torch.func; first and second order run
    fused kernels (Triton on CUDA, a memory-efficient blockwise path elsewhere).
    """
    # the C++ node's entry: for a plain eager call of a signature seen before, whose first
    # order PyTorch's fused kernels run, what the lines below would run, without their
    # Python; None for anything else (bob_compile/eager/)
    fast = eager_node.fast_entry
    if fast is not None and not dropout_p and not softcap:
        o = fast(query, key, value, attn_mask, is_causal, scale, enable_gqa)
        if o is not None:
            return o
    query, key, value, mask, dropout_p, scale, seed = _checked_call(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    softcap = _softcap_value(softcap)
    if mask is not None and mask.requires_grad:
        return autograd.learned_bias_output(query, key, value, mask, scale, is_causal, dropout_p,
                                            seed, softcap)
    if dropout_p or softcap:    # (the C++ node runs neither)
        return _through_functions(query, key, value, mask, scale, is_causal, dropout_p, seed,
                                  softcap)
    # a plain eager call: the eager accelerator first, then the forward alone where nothing
    # can differentiate the result; anything else through the autograd Functions
    if autograd.plain_call((query, key, value, mask)):
        needs_graph = not autograd.no_graph_needed((query, key, value))
        o = eager.output(query, key, value, mask, scale, is_causal, needs_graph)
        if o is not None:
            return o
        if not needs_graph:
            return autograd.forward_output(query, key, value, mask, scale, is_causal)
    return autograd.attention_with_lse(query, key, value, mask, scale, is_causal)[0]


def _through_functions(query, key, value, mask, scale, is_causal, dropout_p=0.0, seed=None,
                       softcap=0.0):
    """The op's output through its autograd Functions: the forward alone where nothing can
    differentiate it (a plain call that needs no graph)."""
    if autograd.plain_call((query, key, value, mask)) and autograd.no_graph_needed(
            (query, key, value)):
        return autograd.forward_output(query, key, value, mask, scale, is_causal, dropout_p,
                                       seed, softcap)
    return autograd.attention_with_lse(query, key, value, mask, scale, is_causal, dropout_p,
                                       seed, softcap)[0]


def attention_with_op_mask(query, key, value, mask, scale, enable_gqa, softcap=0.0):
    """`attention` for a mask in a form only the ops take (int32 key intervals, a uint8
    packed BlockMask: ops.flat_mask), which bob_compile.flex_attention passes; the public
    call refuses both."""
    query, key, value, _, _, scale, _ = _checked_call(query, key, value, None, 0.0, False,
                                                      scale, enable_gqa)
    return _through_functions(query, key, value, mask, scale, False, softcap=softcap)


def attention_with_lse(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                       scale=None, enable_gqa=False):
    """(output, log-sum-exp of the visible scaled scores per query row), both differentiable
    to any order: what merges attention over disjoint key sets (context parallelism). Takes
    `attention`'s arguments, but not a mask that requires grad."""
    query, key, value, mask, dropout_p, scale, seed = _checked_call(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if mask is not None and mask.requires_grad:
        raise NotImplementedError("bob_compile: the log-sum-exp of a call whose mask requires "
                                  "grad (a learned bias) is not available")
    return autograd.attention_with_lse(query, key, value, mask, scale, is_causal, dropout_p,
                                       seed)
