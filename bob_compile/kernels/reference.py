"""Closed-form math of every attention kernel: the oracle of the kernel tests, and the
production path of third and higher orders.

Every function here materializes the full (L, S) score matrix (O(L·S) memory), runs in any
dtype (float64 included; half inputs are computed in float32, or, with upcast=False, with
the roundings of a plain implementation in their own dtype) and is differentiable. So it
serves three purposes: the tests compare every kernel with it; `bob_compile.autograd`
differentiates it for the third order and beyond (exact, unfused) and runs it as the twin
of a fused step under torch's legacy vmap; and BOB_COMPILE_KERNELS=reference forces it for
debugging. `sdpa_math` at the end is the plain forward that autograd differentiates in the
tests' answers (independent of the closed forms above it).

Layout (the kernel contract, see `bob_compile/kernels/__init__.py`): q (B, Hq, L, E),
k (B, Hkv, S, E), v (B, Hkv, S, Ev), with Hkv dividing Hq (grouped-query attention when
Hkv < Hq). Causal masks are aligned top-left, as in PyTorch: query i sees keys j <= i.
The math is that of docs/second-order.md (chain form:
o and lse are inputs of the backward, so their cotangents are outputs of the BoB).
"""
import math

import torch

from . import dropout
from .block_sparse_masks import BlockSparseMask
from .interval_masks import KeyIntervals
from .params import HIDDEN_AT_OR_BELOW, sum_to_mask

# Cotangent names of `bob` outputs, in order: the VJP of `backward` w.r.t. all its tensors.
BOB_OUTPUTS = ("gq", "gk", "gv", "go", "glse", "gdo", "gdlse")
# ... and of `bob_folded`: o and lse are the forward's, their cotangents folded into q, k, v.
BOB_FOLDED_OUTPUTS = ("gq", "gk", "gv", "gdo", "gdlse")


def acc_dtype(dtype):
    """Accumulation dtype: float32 for half types, the dtype itself for float32/float64."""
    return torch.promote_types(dtype, torch.float32)


def expand_kv(x, num_q_heads):
    """Repeat key/value heads for grouped-query attention (head h reads kv head h // group)."""
    group = num_q_heads // x.shape[-3]
    return x if group == 1 else x.repeat_interleave(group, dim=-3)


def reduce_kv(x, num_kv_heads):
    """Sum a per-query-head gradient back onto the shared key/value heads."""
    B, H, S, E = x.shape
    group = H // num_kv_heads
    return x if group == 1 else x.view(B, num_kv_heads, group, S, E).sum(2)


def causal_mask(L, S, device):
    return torch.ones(L, S, dtype=torch.bool, device=device).tril()


def lse_for_probabilities(lse):
    """lse with 0 on rows that see no key (lse = -inf: every score masked or -inf), so that
    P = exp(s - lse) is 0 there instead of exp(-inf + inf) = NaN. A NaN lse (the row sees a
    NaN or +inf score) stays, and so do its NaN probabilities, as in SDPA's math path."""
    return torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)


def capped(u, softcap):
    """Soft-capped scores T = c tanh(U / c) (c = softcap; U itself where 0)."""
    return softcap * torch.tanh(u / softcap) if softcap else u


def cap_slope(u, softcap):
    """φ'(U) = 1 - tanh²(U / c) of the soft-cap, or None without one."""
    return 1 - torch.tanh(u / softcap) ** 2 if softcap else None


def cap_curvature(u, softcap):
    """φ''(U) = -(2 / c) tanh(U / c) φ'(U)."""
    th = torch.tanh(u / softcap)
    return (-2 / softcap) * th * (1 - th * th)


def sloped(t, slope):
    """t ∘ φ'(U): a cotangent or tangent of the capped scores T as one of U (t without a cap)."""
    return t if slope is None else t * slope


def masked(s, params):
    """Scaled scores s, soft-capped where params say so, with the masks of `params` applied:
    the causal and boolean masks set hidden scores to -inf; an additive mask is added (in
    s's dtype), its values at or below HIDDEN_AT_OR_BELOW hide their key (params.py)."""
    s = capped(s, params.softcap)
    if params.causal:
        s = s.masked_fill(~causal_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    if params.mask is not None:
        s = apply_mask(s, params.mask)
    return s


def apply_mask(s, mask):
    """s with a mask tensor (broadcastable to it) applied, as AttentionParams defines it."""
    if isinstance(mask, (KeyIntervals, BlockSparseMask)):
        mask = mask.dense()
    if mask.dtype == torch.bool:
        return s.masked_fill(~mask, float("-inf"))
    return (s + mask.to(s.dtype)).masked_fill(mask <= HIDDEN_AT_OR_BELOW, float("-inf"))


def probabilities(q, k, lse, params):
    """P = exp(scale * q k^T (masked) - lse), exactly 0 where masked or where the row sees
    no key."""
    s = masked(params.scale * q @ k.transpose(-2, -1), params)
    return torch.exp(s - lse_for_probabilities(lse).unsqueeze(-1))


def keep_scale(p, params):
    """Dropout's Z = keep / (1 - p) for the (B, H, L, S) probabilities p (dropout.py), or
    None without dropout."""
    B, H, L, S = p.shape
    return dropout.keep_scale(params, (B, H, L, S), slice(0, L), slice(0, S), p.dtype, p.device)


def dropped(t, z):
    """t ∘ Z: probabilities (or their derivatives) where they meet V; t without dropout."""
    return t if z is None else t * z


def _upcast(*ts):
    dt = acc_dtype(ts[0].dtype)
    return [None if t is None else t.to(dt) for t in ts]


# --------------------------------------------------------------------------------------
# upcast=False: the same math with the roundings of a plain implementation in the input
# dtype (matmuls in that dtype, softmax statistics in float32, P and dS rounded to that
# dtype before they meet a matmul), as SDPA's math path on half inputs rounds: the
# precision baseline that the GPU tests hold the fused kernels to (a small multiple of its
# error against float64). upcast=True (the default) computes in float32 for half inputs.
# --------------------------------------------------------------------------------------
def _scores_in_dtype(q, k, params):
    return masked((q @ k.transpose(-2, -1)) * params.scale, params)


def _forward_in_dtype(q, k, v, params):
    k, v = expand_kv(k, q.shape[-3]), expand_kv(v, q.shape[-3])
    s = _scores_in_dtype(q, k, params)
    p = torch.softmax(s, -1)
    return dropped(p, keep_scale(p, params)) @ v, torch.logsumexp(s.to(acc_dtype(s.dtype)), -1)


def _backward_in_dtype(q, k, v, o, lse, do, dlse, params):
    hkv, scale = k.shape[-3], params.scale
    ke, ve = expand_kv(k, q.shape[-3]), expand_kv(v, q.shape[-3])
    acc = acc_dtype(q.dtype)
    s = masked((q @ ke.transpose(-2, -1)).to(acc) * scale, params)
    p = torch.exp(s - lse_for_probabilities(lse).unsqueeze(-1))
    z = keep_scale(p, params)
    dp = dropped((do @ ve.transpose(-2, -1)).to(acc), z)
    D = (do.to(acc) * o.to(acc)).sum(-1)
    if dlse is not None:
        D = D - dlse
    ds = p * (dp - D.unsqueeze(-1))
    if params.softcap:
        ds = ds * cap_slope((q @ ke.transpose(-2, -1)).to(acc) * scale, params.softcap)
    ds = ds.to(q.dtype)
    dq = (ds @ ke) * scale
    dk = reduce_kv((ds.transpose(-2, -1) @ q) * scale, hkv)
    dv = reduce_kv(dropped(p, z).to(q.dtype).transpose(-2, -1) @ do, hkv)
    return dq, dk, dv


def _bob_in_dtype(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, params):
    """The VJP of _backward_in_dtype, by autograd (every rounding of it differentiated).
    A missing dlse counts as zeros, so that gdlse is returned as the closed form returns it."""
    dlse = torch.zeros_like(lse) if dlse is None else dlse
    inputs = [t.detach().requires_grad_() for t in (q, k, v, o, lse, do, dlse)]
    with torch.enable_grad():
        grads = _backward_in_dtype(*inputs, params)
        given = [(g, c) for g, c in zip(grads, (gdq, gdk, gdv)) if c is not None]
        outs = torch.autograd.grad([g for g, _ in given], inputs, [c for _, c in given],
                                   allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(outs, inputs))


# --------------------------------------------------------------------------------------
# The contract
# --------------------------------------------------------------------------------------
def forward(q, k, v, params, upcast=True):
    """Returns (o, lse); lse is -inf for rows that see no key, and o is 0 there."""
    if not upcast:
        return _forward_in_dtype(q, k, v, params)
    out_dtype = q.dtype
    q, k, v = _upcast(q, k, v)
    k, v = expand_kv(k, q.shape[-3]), expand_kv(v, q.shape[-3])
    s = masked(params.scale * q @ k.transpose(-2, -1), params)
    lse = torch.logsumexp(s, dim=-1)
    # a +inf score leaves the row's softmax undefined (NaN in SDPA's math path), its lse too
    lse = torch.where(lse == float("inf"), float("nan"), lse)
    p = probabilities(q, k, lse, params)
    return (dropped(p, keep_scale(p, params)) @ v).to(out_dtype), lse


def forward_output(q, k, v, params):
    """o alone, for a call nothing will differentiate."""
    return forward(q, k, v, params)[0]


def backward(q, k, v, o, lse, do, dlse, params, upcast=True):
    """FA2 backward with an incoming lse cotangent: D = rowsum(dO * O) - dlse."""
    if not upcast:
        return _backward_in_dtype(q, k, v, o, lse, do, dlse, params)
    return _backward(q, k, v, o, lse, do, dlse, params)[:3]


def backward_bias(q, k, v, o, lse, do, dlse, params):
    """backward, and the cotangent of the additive mask: dS, summed over the mask's
    broadcast dims (params.sum_to_mask), in the mask's dtype."""
    *grads, ds = _backward(q, k, v, o, lse, do, dlse, params)
    return (*grads, sum_to_mask(ds, params.mask).to(params.mask.dtype))


def _backward(q, k, v, o, lse, do, dlse, params):
    """(dq, dk, dv) in their primals' dtypes and dS (the scores' cotangent, upcast)."""
    scale = params.scale
    dts = (q.dtype, k.dtype, v.dtype)
    hkv = k.shape[-3]
    q, k, v, o, lse, do, dlse = _upcast(q, k, v, o, lse, do, dlse)
    k, v = expand_kv(k, q.shape[-3]), expand_kv(v, q.shape[-3])
    p = probabilities(q, k, lse, params)
    z = keep_scale(p, params)
    dp = dropped(do @ v.transpose(-2, -1), z)
    D = (do * o).sum(-1)
    if dlse is not None:
        D = D - dlse
    ds = p * (dp - D.unsqueeze(-1))
    du = sloped(ds, cap_slope(scale * q @ k.transpose(-2, -1), params.softcap))
    dq = scale * du @ k
    dk = reduce_kv(scale * du.transpose(-2, -1) @ q, hkv)
    dv = reduce_kv(dropped(p, z).transpose(-2, -1) @ do, hkv)
    return dq.to(dts[0]), dk.to(dts[1]), dv.to(dts[2]), ds


def bob(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, params, upcast=True):
    """Backward-over-backward: the VJP of `backward` w.r.t. (q, k, v, o, lse, do, dlse).

    gdq/gdk/gdv are the cotangents of dq/dk/dv; any may be None (zero). Returns the seven
    cotangents named in BOB_OUTPUTS, each in its primal's dtype (gdlse like lse).
    """
    if not upcast:
        return _bob_in_dtype(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, params)
    return _bob(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, None, params)[:7]


def _bob(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, gdmask, params):
    """bob's seven cotangents, and Sbar, the scores' cotangent (upcast): with an additive
    mask's cotangent gdmask (the cotangent of backward_bias's dS), dS's cotangent F gains it.
    With a soft-cap the scores are T = φ(U) (docs/second-order.md, "Score transforms"): dS
    and F are then those of T (dT = P (dP - D), F_T = φ'(U) F), Sbar is T's cotangent, and
    q and k see U's: dU = φ'(U) dT and Ubar = φ'(U) Sbar + φ''(U) dT F."""
    scale = params.scale
    dts = [t.dtype for t in (q, k, v, o, lse, do)]
    hkv = k.shape[-3]
    q, k, v, o, lse, do, dlse, gdq, gdk, gdv = _upcast(q, k, v, o, lse, do, dlse, gdq, gdk, gdv)
    k, v = expand_kv(k, q.shape[-3]), expand_kv(v, q.shape[-3])
    gdk = None if gdk is None else expand_kv(gdk, q.shape[-3])
    gdv = None if gdv is None else expand_kv(gdv, q.shape[-3])
    p = probabilities(q, k, lse, params)
    z = keep_scale(p, params)
    dp = dropped(do @ v.transpose(-2, -1), z)
    D = (do * o).sum(-1)
    if dlse is not None:
        D = D - dlse
    dp_shifted = dp - D.unsqueeze(-1)
    ds = p * dp_shifted
    zero = torch.zeros_like(p)
    # F: cotangent of dS (dq = scale dS k, dk = scale dS^T q), tile-local; with a soft-cap
    # that of dU, and F_T = φ'(U) F that of dT
    F = zero
    if gdq is not None:
        F = F + scale * gdq @ k.transpose(-2, -1)
    if gdk is not None:
        F = F + scale * q @ gdk.transpose(-2, -1)
    F_u = F
    if params.softcap:
        u = scale * q @ k.transpose(-2, -1)
        slope = cap_slope(u, params.softcap)
        F = F * slope
        du = ds * slope
    else:
        du = ds
    if gdmask is not None:
        F = F + gdmask.to(F.dtype)
    A = p * F                                   # cotangent of dP
    Dg = A.sum(-1)                              # = -(cotangent of D)
    C = dropped(do @ gdv.transpose(-2, -1), z) if gdv is not None else zero
    Sbar = p * (C + F * dp_shifted)             # cotangent of the scores S
    Ubar = Sbar
    if params.softcap:
        Ubar = Sbar * slope + cap_curvature(u, params.softcap) * ds * F_u
    gq = scale * Ubar @ k
    gk = scale * Ubar.transpose(-2, -1) @ q
    if gdk is not None:
        gq = gq + scale * du @ gdk
    if gdq is not None:
        gk = gk + scale * du.transpose(-2, -1) @ gdq
    gv = dropped(A, z).transpose(-2, -1) @ do
    go = -Dg.unsqueeze(-1) * do
    glse = -Sbar.sum(-1)
    gdo = dropped(A, z) @ v - Dg.unsqueeze(-1) * o
    if gdv is not None:
        gdo = gdo + dropped(p, z) @ gdv
    outs = (gq, reduce_kv(gk, hkv), reduce_kv(gv, hkv), go, glse, gdo, Dg)
    return (*(t.to(dt) for t, dt in zip(outs, dts + [dts[4]])), Sbar)


def bob_folded(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, dq, params, upcast=True):
    """The folded backward-over-backward: the VJP of `backward` where o and lse are
    forward(q, k, v)'s, so that their cotangents reach q, k, v through the forward. dq
    (backward's, which the kernels may read) is not used: the oracle derives everything.

    By the chain rule, independently of the kernels' affine formulas (docs/second-order.md):
    `bob`, then the cotangents (go, glse) of o and lse sent through `backward` (do := go,
    dlse := glse) and added, before any rounding to the inputs' dtypes. Returns the five
    cotangents named in BOB_FOLDED_OUTPUTS."""
    dts = [t.dtype for t in (q, k, v, do, lse)]
    if upcast:
        q, k, v, o, lse, do, dlse, gdq, gdk, gdv = _upcast(q, k, v, o, lse, do, dlse, gdq, gdk,
                                                           gdv)
    gq, gk, gv, go, glse, gdo, gdlse = bob(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, params,
                                           upcast=upcast)
    dq, dk, dv = backward(q, k, v, o, lse, go, glse, params, upcast=upcast)
    outs = (gq + dq, gk + dk, gv + dv, gdo, gdlse)
    return tuple(t.to(dt) for t, dt in zip(outs, dts))


def bob_folded_bias(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, gdmask, dq, params):
    """bob_folded where the additive mask is an input too: gdmask (may be None) is the
    cotangent of backward_bias's mask cotangent; returns BOB_FOLDED_OUTPUTS and the mask's
    cotangent last (summed over its broadcast dims, in its dtype). By the chain rule, as
    bob_folded: the chain form's scores cotangent plus the scores cotangent of the second
    backward that sends (go, glse) through the forward."""
    dts = [t.dtype for t in (q, k, v, do, lse)]
    q, k, v, o, lse, do, dlse, gdq, gdk, gdv = _upcast(q, k, v, o, lse, do, dlse, gdq, gdk, gdv)
    gq, gk, gv, go, glse, gdo, gdlse, s_bar = _bob(q, k, v, o, lse, do, dlse, gdq, gdk, gdv,
                                                    gdmask, params)
    dq, dk, dv, ds = _backward(q, k, v, o, lse, go, glse, params)
    outs = (gq + dq, gk + dk, gv + dv, gdo, gdlse)
    gmask = sum_to_mask(s_bar + ds, params.mask).to(params.mask.dtype)
    return (*(t.to(dt) for t, dt in zip(outs, dts)), gmask)


def forward_jvp(q, k, v, o, lse, tq, tk, tv, params):
    """Tangents (to, tlse) of forward() along (tq, tk, tv); None tangents are zero."""
    scale = params.scale
    out_dtype = o.dtype
    q, k, v, o, lse, tq, tk, tv = _upcast(q, k, v, o, lse, tq, tk, tv)
    H = q.shape[-3]
    k, v = expand_kv(k, H), expand_kv(v, H)
    p = probabilities(q, k, lse, params)
    z = keep_scale(p, params)
    ts = torch.zeros_like(p)
    if tq is not None:
        ts = ts + scale * tq @ k.transpose(-2, -1)
    if tk is not None:
        ts = ts + scale * q @ expand_kv(tk, H).transpose(-2, -1)
    ts = sloped(ts, cap_slope(scale * q @ k.transpose(-2, -1), params.softcap))
    tlse = (p * ts).sum(-1)
    to = dropped(p * ts, z) @ v - tlse.unsqueeze(-1) * o
    if tv is not None:
        to = to + dropped(p, z) @ expand_kv(tv, H)
    return to.to(out_dtype), tlse


def backward_jvp(q, k, v, o, lse, do, dlse, tq, tk, tv, to, tlse, tdo, tdlse, params):
    """Tangents (tdq, tdk, tdv) of backward() along all seven tangents (None = zero)."""
    scale = params.scale
    dts = (q.dtype, k.dtype, v.dtype)
    hkv, H = k.shape[-3], q.shape[-3]
    q, k, v, o, lse, do, dlse, tq, tk, tv, to, tlse, tdo, tdlse = _upcast(
        q, k, v, o, lse, do, dlse, tq, tk, tv, to, tlse, tdo, tdlse)
    k, v = expand_kv(k, H), expand_kv(v, H)
    tk = None if tk is None else expand_kv(tk, H)
    tv = None if tv is None else expand_kv(tv, H)
    p = probabilities(q, k, lse, params)
    z = keep_scale(p, params)
    dp = dropped(do @ v.transpose(-2, -1), z)
    D = (do * o).sum(-1)
    if dlse is not None:
        D = D - dlse
    ds = p * (dp - D.unsqueeze(-1))
    zero = torch.zeros_like(p)
    tu = zero       # the tangent of U = scale q kᵀ; ts: that of the capped scores, less tlse
    if tq is not None:
        tu = tu + scale * tq @ k.transpose(-2, -1)
    if tk is not None:
        tu = tu + scale * q @ tk.transpose(-2, -1)
    u = scale * q @ k.transpose(-2, -1) if params.softcap else None
    slope = cap_slope(u, params.softcap)
    ts = sloped(tu, slope)
    if tlse is not None:
        ts = ts - tlse.unsqueeze(-1)
    tp = p * ts
    tdp = zero
    tD = torch.zeros_like(D)
    if tdo is not None:
        tdp = tdp + dropped(tdo @ v.transpose(-2, -1), z)
        tD = tD + (tdo * o).sum(-1)
    if tv is not None:
        tdp = tdp + dropped(do @ tv.transpose(-2, -1), z)
    if to is not None:
        tD = tD + (do * to).sum(-1)
    if tdlse is not None:
        tD = tD - tdlse
    tds = tp * (dp - D.unsqueeze(-1)) + p * (tdp - tD.unsqueeze(-1))
    tdv = dropped(tp, z).transpose(-2, -1) @ do
    if params.softcap:      # U's: tdU = φ' tdT + φ'' tU dT, dU = φ' dT
        tds = tds * slope + cap_curvature(u, params.softcap) * tu * ds
        ds = ds * slope
    tdq = scale * tds @ k
    tdk = scale * tds.transpose(-2, -1) @ q
    if tk is not None:
        tdq = tdq + scale * ds @ tk
    if tq is not None:
        tdk = tdk + scale * ds.transpose(-2, -1) @ tq
    if tdo is not None:
        tdv = tdv + dropped(p, z).transpose(-2, -1) @ tdo
    outs = (tdq, reduce_kv(tdk, hkv), reduce_kv(tdv, hkv))
    return tuple(t.to(dt) for t, dt in zip(outs, dts))


def sdpa_math(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
              dropout_scale=None, softcap=0.0):
    """softmax(q kᵀ · scale, top-left causal mask, attn_mask) v with ordinary ops, SDPA's
    signature (any leading dims): what the tests differentiate with autograd for their
    answers. Rows that see no key are 0, as in SDPA (a plain softmax gives NaN there); mask
    values <= HIDDEN_AT_OR_BELOW hide their key (bob_compile/kernels/params.py).
    dropout_scale: a given dropout's Z (keep / (1 - p), broadcastable to the scores),
    multiplying the probabilities; softcap: c > 0 caps the scaled scores at c tanh(s / c)
    before any mask (Gemma 2)."""
    if enable_gqa:
        k, v = expand_kv(k, q.shape[-3]), expand_kv(v, q.shape[-3])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-2, -1) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if is_causal:
        s = s.masked_fill(~causal_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    if attn_mask is not None:
        s = apply_mask(s, attn_mask)
    if attn_mask is None:
        p = torch.softmax(s, dim=-1)
    else:
        empty = (s == float("-inf")).all(-1, keepdim=True)
        p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return dropped(p, dropout_scale) @ v
