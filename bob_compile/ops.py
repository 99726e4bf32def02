"""The attention custom ops: the opaque kernel boundary that graphs and AOTAutograd see.

    attn_fwd(q, k, v, mask?, scale, causal, dropout_p, seed?)  -> (o, lse)
    attn_bwd(q, k, v, o, lse, do, dlse?, mask?, scale, causal) -> (dq, dk, dv)
    attn_bob(q, k, v, o, lse, do, dlse?, gdq?, gdk?, gdv?, mask?, scale, causal)
                                   -> (gq, gk, gv, go, glse, gdo, gdlse)   VJP of attn_bwd
    attn_bob_folded(q, k, v, o, lse, do, dlse?, gdq?, gdk?, gdv?, dq?, mask?, scale, causal)
                                   -> (gq, gk, gv, gdo, gdlse)   VJP of attn_bwd where o and lse
                                      are attn_fwd(q, k, v)'s: their cotangents are folded in;
                                      dq, if given, is attn_bwd's (the kernels read a row
                                      term from it instead of recomputing it)
    attn_fwd_jvp(q, k, v, o, lse, tq?, tk?, tv?, mask?, scale, causal) -> (to, tlse)
    attn_bwd_jvp(q, k, v, o, lse, do, dlse?, tq?, tk?, tv?, to?, tlse?, tdo?, tdlse?, mask?,
                 scale, causal)    -> (tdq, tdk, tdv)                       JVP of attn_bwd

Every op ends with (mask?, scale, causal, dropout_p, seed?, softcap), dropout_p = 0, seed None
and softcap 0 by default: attention dropout with SDPA's semantics, its keep mask regenerated
from `seed` (an int64 tensor of one element) by every op of the call
(bob_compile/kernels/dropout.py); softcap c > 0 caps the scaled scores at c tanh(s / c)
before any mask (Gemma 2; bob_compile/kernels/params.py).

Shapes: q (..., Hq, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev) with equal leading dims
and Hkv dividing Hq (rank-2 inputs have one implicit head); lse and other row vectors are
(..., Hq, L). mask (optional, never differentiated) broadcasts to (..., Hq, L, S): bool
(True: visible) or floating (added to the scaled scores); see bob_compile/kernels/params.py. The ops
flatten leading dims to the 4-D layout of `bob_compile.kernels` and pick an
implementation there. Each output is dense, in the memory order of the input it is
shaped like (row vectors contiguous: bob_compile/kernels/layout.py); the fake implementations say the
same, through the same functions, so compiled graphs see the strides they were traced with.

Autograd does not live here: `custom_op.register_autograd` does not compose with
torch.func, so `bob_compile.autograd` wraps these ops in new-style autograd.Functions.
"""
import math
from typing import Optional

import torch
from torch import Tensor

from . import block_masks, kernels
from .kernels import dropout, layout
from .kernels.interval_masks import KeyIntervals
from .kernels.params import AttentionParams, mask_own_shape
from .kernels.reference import acc_dtype

NAMESPACE = "bob_compile"
# Inputs reach the implementations with the strides they were traced with (inductor's
# default for custom ops; said explicitly so that a changed default cannot reorder them).
_TAGS = (torch.Tag.needs_exact_strides,)


# ----------------------------------------------------------------------------- layout
# These run on every call: 4-D inputs (the common case) and outputs that already have their
# final shape are passed through without a reshape (a dispatcher call each).
def _flat(t: Optional[Tensor]):
    """(..., H, N, X) -> (B, H, N, X); rank-2 (N, X) -> (1, 1, N, X)."""
    if t is None:
        return None
    dim = t.dim()
    if dim == 4:
        return t
    if dim == 2:
        return t.unsqueeze(0).unsqueeze(0)
    return t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:])


def _flat_rows(r: Optional[Tensor], qf: Tensor):
    """Row vectors (..., H, L) -> (B, H, L), matching the flattened query qf."""
    if r is None:
        return None
    shape = qf.shape[:3]
    return r if r.shape == shape else r.reshape(shape)


def flat_mask(mask: Optional[Tensor], q: Tensor, k: Tensor):
    """The mask as the kernels take it, (B, Hq, L, S), broadcast dims as stride-0 views;
    two forms bob_compile.flex_attention passes (never the public API): an int32 mask is a
    mask's key intervals (kernels/interval_masks.py: (B or 1, Hq or 1, 1, 3 + 2L + 2S)),
    taken as KeyIntervals; a uint8 one a packed BlockMask, resolved here
    (bob_compile/block_masks.py), or a mask tile by tile (kernels/block_sparse_masks.py)."""
    if mask is None:
        return None
    if mask.dtype == torch.int32 or mask.dtype == torch.uint8:
        return _flat_compact_mask(mask, q, k)
    full = (*q.shape[:-1], k.shape[-2])
    if mask.shape != full:
        mask = mask.expand(full)
    if mask.dim() == 4:
        return mask
    return mask.reshape(-1, *full[-3:]) if mask.dim() > 2 else mask.view(1, 1, *full)


def _flat_compact_mask(mask, q, k):
    L, S = q.shape[-2], k.shape[-2]
    heads = q.shape[-3] if q.dim() > 2 else 1
    batch = math.prod(q.shape[:-3])
    if mask.dtype == torch.uint8:
        if mask.dim() != 1:
            raise RuntimeError("bob_compile attention ops: a uint8 mask is a packed BlockMask "
                               "(bob_compile/block_masks.py) or a tile-by-tile mask "
                               "(kernels/block_sparse_masks.py), one-dimensional")
        return block_masks.resolve(mask, batch, heads, L, S)
    if mask.dim() == 4 and q.dim() != 4:        # a (B, Hq, 1, X) summary over more dims
        mask = mask.expand(*q.shape[:-2], 1, mask.shape[-1]).reshape(
            batch, heads, 1, mask.shape[-1])
    return KeyIntervals.of(mask, batch, heads, L, S)


def _params(q, k, mask, scale, causal, keep_mask_summary, dropout_p=0.0, seed=None,
            softcap=0.0):
    if not dropout_p:
        dropout_p, seed = 0.0, None
    elif seed is None:
        raise ValueError("bob_compile attention ops: dropout_p > 0 needs a seed (an int64 tensor "
                         "of one element: bob_compile.kernels.dropout.draw_seed)")
    else:
        heads = math.prod(q.shape[:-2])
        if all(type(n) is int for n in (heads, q.shape[-2], k.shape[-2])):
            dropout.check_counter_range((1, heads, q.shape[-2], k.shape[-2]))
    if mask is None:
        return AttentionParams(scale=scale, causal=causal, dropout_p=dropout_p,
                               dropout_seed=seed, softcap=softcap)
    return AttentionParams(scale=scale, causal=causal, mask=flat_mask(mask, q, k),
                           keep_mask_summary=keep_mask_summary, dropout_p=dropout_p,
                           dropout_seed=seed, softcap=softcap)


def _unflat(t: Tensor, shape, like: Optional[Tensor]):
    """t (from an implementation) in the caller's shape, laid out like `like` (a row vector,
    like=None: contiguous); see bob_compile/kernels/layout.py."""
    if t.shape != shape:
        t = t.reshape(shape)
    return t.contiguous() if like is None else layout.in_order_of(t, like)


def call_path(pick, q, k, v, mask, scale, causal, dropout_p=0.0, softcap=0.0):
    """The CallPath of a call of the real implementations (pick is kernels.select) on 4-D
    inputs without a mask, dropout or soft-cap (kernels.call_path): what runs for its
    signature, decided once, so that such calls skip the flattening and the choice of an
    implementation."""
    if pick is kernels.select and mask is None and not dropout_p and not softcap \
            and q.dim() == 4 \
            and k.dim() == 4 and v.dim() == 4:
        return kernels.call_path(q, k, v, scale, causal)
    return None


def call_forward(pick, q, k, v, mask, scale, causal, dropout_p=0.0, seed=None, softcap=0.0,
                 keep_mask_summary=False):
    """Flatten, run pick(q, k, v).forward (pick chooses the implementation module), and
    restore the leading dims and the output layout. The call_* functions below do the same
    for each op. keep_mask_summary: see AttentionParams (True only from the plain eager
    path of bob_compile/autograd.py, never from the ops themselves)."""
    known = call_path(pick, q, k, v, mask, scale, causal, dropout_p, softcap)
    if known is not None:
        out = known.forward(q, k, v)
        if out is not None:
            return out
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    params = _params(q, k, mask, scale, causal, keep_mask_summary, dropout_p, seed, softcap)
    o, lse = pick(qf, kf, vf).forward(qf, kf, vf, params)
    return _unflat(o, (*q.shape[:-1], v.shape[-1]), q), _unflat(lse, q.shape[:-1], None)


def call_forward_output(pick, q, k, v, mask, scale, causal, dropout_p=0.0, seed=None,
                        softcap=0.0, keep_mask_summary=False):
    """o of call_forward, from the implementation's forward_output (no lse to compute)."""
    known = call_path(pick, q, k, v, mask, scale, causal, dropout_p, softcap)
    if known is not None:
        o = known.forward_output(q, k, v)
        if o is not None:
            return o
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    params = _params(q, k, mask, scale, causal, keep_mask_summary, dropout_p, seed, softcap)
    o = pick(qf, kf, vf).forward_output(qf, kf, vf, params)
    return _unflat(o, (*q.shape[:-1], v.shape[-1]), q)


def call_backward(pick, q, k, v, o, lse, do, dlse, mask, scale, causal, dropout_p=0.0,
                  seed=None, softcap=0.0, keep_mask_summary=False):
    known = call_path(pick, q, k, v, mask, scale, causal, dropout_p, softcap)
    if known is not None:
        grads = known.backward(q, k, v, o, lse, do, dlse)
        if grads is not None:
            return grads
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    params = _params(q, k, mask, scale, causal, keep_mask_summary, dropout_p, seed, softcap)
    dq, dk, dv = pick(qf, kf, vf).backward(
        qf, kf, vf, _flat(o), _flat_rows(lse, qf), _flat(do), _flat_rows(dlse, qf), params)
    return _unflat(dq, q.shape, q), _unflat(dk, k.shape, k), _unflat(dv, v.shape, v)


def _call_second_order(method, likes, pick, q, k, v, o, lse, do, dlse, shaped_like_q_k_v,
                       mask, scale, causal, dropout_p, seed, softcap, keep_mask_summary):
    """The implementation's `method` (bob or bob_folded); shaped_like_q_k_v: its optional
    arguments after dlse (gdq, gdk, gdv, and bob_folded's dq); likes: the input each output
    is shaped and laid out like (None: a row vector shaped like lse)."""
    known = call_path(pick, q, k, v, mask, scale, causal, dropout_p, softcap)
    if known is not None:
        outs = getattr(known, method)(q, k, v, o, lse, do, dlse, *shaped_like_q_k_v)
        if outs is not None:
            return outs
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    params = _params(q, k, mask, scale, causal, keep_mask_summary, dropout_p, seed, softcap)
    outs = getattr(pick(qf, kf, vf), method)(
        qf, kf, vf, _flat(o), _flat_rows(lse, qf), _flat(do), _flat_rows(dlse, qf),
        *map(_flat, shaped_like_q_k_v), params)
    return tuple(_unflat(t, like.shape if like is not None else lse.shape, like)
                 for t, like in zip(outs, likes))


def call_bob(pick, q, k, v, o, lse, do, dlse, gdq, gdk, gdv, mask, scale, causal,
             dropout_p=0.0, seed=None, softcap=0.0, keep_mask_summary=False):
    return _call_second_order("bob", (q, k, v, o, None, do, None), pick, q, k, v, o, lse, do,
                              dlse, (gdq, gdk, gdv), mask, scale, causal, dropout_p, seed,
                              softcap, keep_mask_summary)


def call_bob_folded(pick, q, k, v, o, lse, do, dlse, gdq, gdk, gdv, dq, mask, scale, causal,
                    dropout_p=0.0, seed=None, softcap=0.0, keep_mask_summary=False):
    if dq is not None and dq.shape != q.shape:
        raise ValueError(f"attn_bob_folded: dq must be shaped like q {tuple(q.shape)} (it is "
                         f"attn_bwd's dq for the same inputs), got {tuple(dq.shape)}")
    return _call_second_order("bob_folded", (q, k, v, do, None), pick, q, k, v, o, lse, do,
                              dlse, (gdq, gdk, gdv, dq), mask, scale, causal, dropout_p, seed,
                              softcap, keep_mask_summary)


def call_backward_bias(pick, q, k, v, o, lse, do, dlse, mask, scale, causal, dropout_p=0.0,
                       seed=None, softcap=0.0):
    """call_backward, and the additive mask's cotangent, shaped like the mask. The
    implementations return it with 1 on the flat mask's broadcast (stride-0) dims, which
    are the mask's missing or size-1 dims: a mask with a stride-0 dim of its own comes in
    contiguous (autograd.learned_bias_output), and the inputs are 4-D."""
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    params = _params(q, k, mask, scale, causal, False, dropout_p, seed, softcap)
    dq, dk, dv, dmask = pick(qf, kf, vf).backward_bias(
        qf, kf, vf, _flat(o), _flat_rows(lse, qf), _flat(do), _flat_rows(dlse, qf), params)
    return (_unflat(dq, q.shape, q), _unflat(dk, k.shape, k), _unflat(dv, v.shape, v),
            dmask.reshape(mask.shape))


def call_bob_folded_bias(pick, q, k, v, o, lse, do, dlse, gdq, gdk, gdv, gdmask, mask, scale,
                         causal, dropout_p=0.0, seed=None, softcap=0.0):
    """call_bob_folded where the additive mask is an input too: gdmask (shaped like the
    mask, or None) is the cotangent of call_backward_bias's mask cotangent; the mask's own
    cotangent comes last."""
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    params = _params(q, k, mask, scale, causal, False, dropout_p, seed, softcap)
    gdmask = None if gdmask is None else gdmask.reshape(mask_own_shape(params.mask))
    outs = pick(qf, kf, vf).bob_folded_bias(
        qf, kf, vf, _flat(o), _flat_rows(lse, qf), _flat(do), _flat_rows(dlse, qf), _flat(gdq),
        _flat(gdk), _flat(gdv), gdmask, None, params)
    shaped = tuple(_unflat(t, like.shape if like is not None else lse.shape, like)
                   for t, like in zip(outs[:5], (q, k, v, do, None)))
    return (*shaped, outs[5].reshape(mask.shape))


def call_forward_jvp(pick, q, k, v, o, lse, tq, tk, tv, mask, scale, causal, dropout_p=0.0,
                     seed=None, softcap=0.0, keep_mask_summary=False):
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    params = _params(q, k, mask, scale, causal, keep_mask_summary, dropout_p, seed, softcap)
    to, tlse = pick(qf, kf, vf).forward_jvp(
        qf, kf, vf, _flat(o), _flat_rows(lse, qf), _flat(tq), _flat(tk), _flat(tv), params)
    return _unflat(to, o.shape, o), _unflat(tlse, lse.shape, None)


def call_backward_jvp(pick, q, k, v, o, lse, do, dlse, tq, tk, tv, to, tlse, tdo, tdlse,
                      mask, scale, causal, dropout_p=0.0, seed=None, softcap=0.0,
                      keep_mask_summary=False):
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    params = _params(q, k, mask, scale, causal, keep_mask_summary, dropout_p, seed, softcap)
    outs = pick(qf, kf, vf).backward_jvp(
        qf, kf, vf, _flat(o), _flat_rows(lse, qf), _flat(do), _flat_rows(dlse, qf), _flat(tq),
        _flat(tk), _flat(tv), _flat(to), _flat_rows(tlse, qf), _flat(tdo), _flat_rows(tdlse, qf),
        params)
    return tuple(_unflat(t, like.shape, like) for t, like in zip(outs, (q, k, v)))


def _like(t: Tensor, shape=None, dtype=None):
    """An empty tensor laid out as the real implementations lay out an output shaped like t."""
    return layout.empty_like_order(t.shape if shape is None else shape, t, dtype)


def _rows(t: Tensor, dtype=None):
    """An empty contiguous row vector shaped like t."""
    return t.new_empty(t.shape, dtype=dtype or t.dtype)


# ----------------------------------------------------------------------------- forward
@torch.library.custom_op(f"{NAMESPACE}::attn_fwd", mutates_args=(), tags=_TAGS)
def attn_fwd(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float,
             causal: bool, dropout_p: float = 0.0, seed: Optional[Tensor] = None,
             softcap: float = 0.0
             ) -> tuple[Tensor, Tensor]:
    return call_forward(kernels.select, q, k, v, mask, scale, causal, dropout_p, seed, softcap)


@attn_fwd.register_fake
def _(q, k, v, mask, scale, causal, dropout_p=0.0, seed=None, softcap=0.0):
    return _like(q, (*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=acc_dtype(q.dtype))


# ----------------------------------------------------------------------------- backward
@torch.library.custom_op(f"{NAMESPACE}::attn_bwd", mutates_args=(), tags=_TAGS)
def attn_bwd(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
             dlse: Optional[Tensor], mask: Optional[Tensor], scale: float, causal: bool,
             dropout_p: float = 0.0, seed: Optional[Tensor] = None, softcap: float = 0.0
             ) -> tuple[Tensor, Tensor, Tensor]:
    return call_backward(kernels.select, q, k, v, o, lse, do, dlse, mask, scale, causal,
                         dropout_p, seed, softcap)


@attn_bwd.register_fake
def _(q, k, v, o, lse, do, dlse, mask, scale, causal, dropout_p=0.0, seed=None,
      softcap=0.0):
    return _like(q), _like(k), _like(v)


# ----------------------------------------------------------------------------- backward-over-backward
@torch.library.custom_op(f"{NAMESPACE}::attn_bob", mutates_args=(), tags=_TAGS)
def attn_bob(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
             dlse: Optional[Tensor], gdq: Optional[Tensor], gdk: Optional[Tensor],
             gdv: Optional[Tensor], mask: Optional[Tensor], scale: float, causal: bool,
             dropout_p: float = 0.0, seed: Optional[Tensor] = None, softcap: float = 0.0
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return call_bob(kernels.select, q, k, v, o, lse, do, dlse, gdq, gdk, gdv, mask, scale,
                    causal, dropout_p, seed, softcap)


@attn_bob.register_fake
def _(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, mask, scale, causal, dropout_p=0.0, seed=None,
      softcap=0.0):
    return _like(q), _like(k), _like(v), _like(o), _rows(lse), _like(do), _rows(lse)


@torch.library.custom_op(f"{NAMESPACE}::attn_bob_folded", mutates_args=(), tags=_TAGS)
def attn_bob_folded(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                    dlse: Optional[Tensor], gdq: Optional[Tensor], gdk: Optional[Tensor],
                    gdv: Optional[Tensor], dq: Optional[Tensor], mask: Optional[Tensor],
                    scale: float, causal: bool, dropout_p: float = 0.0,
                    seed: Optional[Tensor] = None, softcap: float = 0.0
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return call_bob_folded(kernels.select, q, k, v, o, lse, do, dlse, gdq, gdk, gdv, dq, mask,
                           scale, causal, dropout_p, seed, softcap)


@attn_bob_folded.register_fake
def _(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, dq, mask, scale, causal, dropout_p=0.0,
      seed=None, softcap=0.0):
    return _like(q), _like(k), _like(v), _like(do), _rows(lse)


# ----------------------------------------------------------------------------- a learned bias
# The additive mask is an input of the derivatives here: attn_bwd_bias returns its
# cotangent dS; attn_bob_folded_bias takes that cotangent's cotangent and returns the mask's.
@torch.library.custom_op(f"{NAMESPACE}::attn_bwd_bias", mutates_args=(), tags=_TAGS)
def attn_bwd_bias(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                  dlse: Optional[Tensor], mask: Tensor, scale: float, causal: bool,
                  dropout_p: float = 0.0, seed: Optional[Tensor] = None,
                  softcap: float = 0.0
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return call_backward_bias(kernels.select, q, k, v, o, lse, do, dlse, mask, scale,
                              causal, dropout_p, seed, softcap)


@attn_bwd_bias.register_fake
def _(q, k, v, o, lse, do, dlse, mask, scale, causal, dropout_p=0.0, seed=None, softcap=0.0):
    return _like(q), _like(k), _like(v), _like(mask)


@torch.library.custom_op(f"{NAMESPACE}::attn_bob_folded_bias", mutates_args=(), tags=_TAGS)
def attn_bob_folded_bias(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                         dlse: Optional[Tensor], gdq: Optional[Tensor], gdk: Optional[Tensor],
                         gdv: Optional[Tensor], gdmask: Optional[Tensor], mask: Tensor,
                         scale: float, causal: bool, dropout_p: float = 0.0,
                         seed: Optional[Tensor] = None, softcap: float = 0.0
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return call_bob_folded_bias(kernels.select, q, k, v, o, lse, do, dlse, gdq, gdk, gdv,
                                gdmask, mask, scale, causal, dropout_p, seed, softcap)


@attn_bob_folded_bias.register_fake
def _(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, gdmask, mask, scale, causal, dropout_p=0.0,
      seed=None, softcap=0.0):
    return _like(q), _like(k), _like(v), _like(do), _rows(lse), _like(mask)


# ----------------------------------------------------------------------------- forward mode
@torch.library.custom_op(f"{NAMESPACE}::attn_fwd_jvp", mutates_args=(), tags=_TAGS)
def attn_fwd_jvp(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, tq: Optional[Tensor],
                 tk: Optional[Tensor], tv: Optional[Tensor], mask: Optional[Tensor], scale: float,
                 causal: bool, dropout_p: float = 0.0, seed: Optional[Tensor] = None,
             softcap: float = 0.0
                 ) -> tuple[Tensor, Tensor]:
    return call_forward_jvp(kernels.select, q, k, v, o, lse, tq, tk, tv, mask, scale, causal,
                            dropout_p, seed, softcap)


@attn_fwd_jvp.register_fake
def _(q, k, v, o, lse, tq, tk, tv, mask, scale, causal, dropout_p=0.0, seed=None, softcap=0.0):
    return _like(o), _rows(lse)


@torch.library.custom_op(f"{NAMESPACE}::attn_bwd_jvp", mutates_args=(), tags=_TAGS)
def attn_bwd_jvp(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                 dlse: Optional[Tensor], tq: Optional[Tensor], tk: Optional[Tensor],
                 tv: Optional[Tensor], to: Optional[Tensor], tlse: Optional[Tensor],
                 tdo: Optional[Tensor], tdlse: Optional[Tensor], mask: Optional[Tensor],
                 scale: float, causal: bool, dropout_p: float = 0.0,
                 seed: Optional[Tensor] = None, softcap: float = 0.0
                 ) -> tuple[Tensor, Tensor, Tensor]:
    return call_backward_jvp(kernels.select, q, k, v, o, lse, do, dlse, tq, tk, tv, to, tlse,
                             tdo, tdlse, mask, scale, causal, dropout_p, seed, softcap)


@attn_bwd_jvp.register_fake
def _(q, k, v, o, lse, do, dlse, tq, tk, tv, to, tlse, tdo, tdlse, mask, scale, causal,
      dropout_p=0.0, seed=None, softcap=0.0):
    return _like(q), _like(k), _like(v)


# ----------------------------------------------------------------------------- vmap
def _vmap_rule(op, n_out):
    """Batch by moving the vmapped dim to the front: the ops accept any leading dims.

    Unbatched tensors are expanded (a view) so that every operand has the batch dim; None
    stays None. The mask only broadcasts: unbatched it stays as it is, batched it gets unit
    dims after the batch dim, so that it lines up with the (now batched) query.

    With dropout, each vmapped call must draw the mask a call of its own would: the
    counter of a mask element holds its flattened batch index (kernels/dropout.py), which a
    moved vmap dim would change. So those calls run one by one: with one seed (vmap's
    randomness="same") each draws the same mask, with a seed per call ("different") its own.
    So do calls with a packed BlockMask (block_masks.py)."""
    names = [a.name for a in op._opoverload._schema.arguments]
    mask_at, query_at = names.index("mask"), names.index("q")
    dropout_at, seed_at = names.index("dropout_p"), names.index("seed")

    def rule(info, in_dims, *args):
        if len(args) > dropout_at and args[dropout_at]:       # (defaults may be left out)
            return _one_by_one(op, info, in_dims, args), (0,) * n_out
        mask = args[mask_at]
        if mask is not None and mask.dtype == torch.uint8:
            # a packed BlockMask's mask_mod reads the batch index of the call it was made
            # for: batched together, the calls would number their entries anew
            return _one_by_one(op, info, in_dims, args), (0,) * n_out
        moved = []
        for i, (a, d) in enumerate(zip(args, in_dims)):
            if isinstance(a, Tensor):
                if i == mask_at:
                    if d is not None:
                        a = a.movedim(d, 0)
                        missing = (args[query_at].dim() - (in_dims[query_at] is not None)) - (a.dim() - 1)
                        a = a.reshape(a.shape[0], *([1] * max(missing, 0)), *a.shape[1:])
                elif i == seed_at:
                    pass        # no dropout: the seed is not read
                elif d is not None:
                    a = a.movedim(d, 0)
                else:
                    a = a.expand(info.batch_size, *a.shape)
            moved.append(a)
        return op(*moved), (0,) * n_out
    return rule


def _one_by_one(op, info, in_dims, args):
    """op over each vmapped call in turn, its outputs stacked along dim 0."""
    calls = []
    for j in range(info.batch_size):
        calls.append(op(*(a.select(d, j) if isinstance(a, Tensor) and d is not None else a
                          for a, d in zip(args, in_dims))))
    return tuple(torch.stack(outputs) for outputs in zip(*calls))


for _op, _n_out in ((attn_fwd, 2), (attn_bwd, 3), (attn_bob, 7), (attn_bob_folded, 5),
                    (attn_fwd_jvp, 2), (attn_bwd_jvp, 3)):
    torch.library.register_vmap(_op, _vmap_rule(_op, _n_out))


def _one_by_one_rule(op, n_out):
    """The learned-bias ops under vmap: one call per vmapped call. Batched together, a mask
    shared by the calls would broadcast over their batch, and its cotangent would come back
    summed over them instead of one per call."""
    def rule(info, in_dims, *args):
        return _one_by_one(op, info, in_dims, args), (0,) * n_out
    return rule


for _op, _n_out in ((attn_bwd_bias, 4), (attn_bob_folded_bias, 6)):
    torch.library.register_vmap(_op, _one_by_one_rule(_op, _n_out))
