"""Memory-efficient attention in plain PyTorch: the CPU path, and the fallback wherever the
Triton kernels do not apply.

Same contract as `bob_compile/kernels/__init__.py`. Every function walks (query tile, key tile) pairs
and keeps only O(N·d) state per head: row quantities (o, lse, dq, gq, gdo, ...) live per
query tile, column quantities (dk, dv, gk, gv, ...) in full-length accumulators. No tensor
with L·S elements per head is ever created, for any L, S larger than one tile.

The probabilities are rebuilt per tile from the saved log-sum-exp, P = exp(scale q kᵀ - lse),
as the fused kernels do; the formulas are those of `bob_compile/kernels/reference.py` (chain form).
With a soft-cap (params.softcap) the scores are T = φ(U), U = scale q kᵀ, and the derivatives
take φ'(U) and φ''(U) from each tile's U (docs/second-order.md, "Score transforms").
"""
import contextlib
import contextvars
import math

import torch

from . import dropout
from .params import mask_own_shape
from .reference import (acc_dtype, apply_mask, cap_curvature, cap_slope, capped, dropped,
                        expand_kv, lse_for_probabilities, reduce_kv, sloped)

# Tile edge lengths (query rows, key columns). 256 keeps Python overhead low on CPU while
# one tile stays far below an L·S tensor; tests shrink them (`tiles`) so short sequences
# cross tile borders. A context variable, not module globals: a `tiles` block in one thread
# (or asyncio task) never changes the tiles another one runs with.
_TILES = contextvars.ContextVar("bob_compile_blockwise_tiles", default=(256, 256))


@contextlib.contextmanager
def tiles(q=None, k=None):
    """Use other tile sizes inside this block, in this thread/context only (for tests)."""
    tile_q, tile_k = _TILES.get()
    token = _TILES.set((q or tile_q, k or tile_k))
    try:
        yield
    finally:
        _TILES.reset(token)


# ----------------------------------------------------------------------------- tiling
def _row_tiles(L):
    tile_q = _TILES.get()[0]
    for r0 in range(0, L, tile_q):
        yield slice(r0, min(r0 + tile_q, L))


def _key_tiles(rows, S, causal):
    """(key slice, needs elementwise mask) for every key tile that rows can see."""
    tile_k = _TILES.get()[1]
    for c0 in range(0, S, tile_k):
        if causal and c0 > rows.stop - 1:       # this tile and all after it: above the diagonal
            return
        c1 = min(c0 + tile_k, S)
        yield slice(c0, c1), causal and c1 - 1 > rows.start


def _visible_tiles(L, S, causal):
    """(query slice, key slice, needs elementwise mask) for every tile with a visible pair."""
    for rows in _row_tiles(L):
        for cols, masked in _key_tiles(rows, S, causal):
            yield rows, cols, masked


def _natural_scores(q_tile, k_tile, params):
    """U = scale q kᵀ of one tile: the scores before any cap or mask."""
    return params.scale * q_tile @ k_tile.transpose(-2, -1)


def _scores(u, params, rows, cols, masked):
    """The tile's scores from its U: soft-capped where params say so, then masked;
    `masked`: the tile crosses the causal diagonal. The params' mask tile applies as
    reference.masked applies the whole mask."""
    s = capped(u, params.softcap)
    if masked:
        qi = torch.arange(rows.start, rows.stop, device=s.device)[:, None]
        kj = torch.arange(cols.start, cols.stop, device=s.device)[None, :]
        s = s.masked_fill(kj > qi, float("-inf"))
    if params.mask is not None:
        s = apply_mask(s, params.mask[:, :, rows, cols])
    return s


def _probs(q_tile, k_tile, lse_rows, params, rows, cols, masked):
    """(P, U) of a tile: P from the saved lse (0 where masked and on rows that see no key),
    U for the cap's derivatives."""
    u = _natural_scores(q_tile, k_tile, params)
    s = _scores(u, params, rows, cols, masked)
    return torch.exp(s - lse_for_probabilities(lse_rows).unsqueeze(-1)), u


def _curvature_term(u, params, ds, t):
    """φ''(U) ∘ dT ∘ t, the cap's curvature term: of U's cotangent where t is dU's cotangent F
    (BoB), of dU's tangent where t is U's tangent (forward mode); None where it is zero (no
    cap, or t None)."""
    if not params.softcap or t is None:
        return None
    return cap_curvature(u, params.softcap) * ds * t


def _keep(params, q, S, rows, cols):
    """Dropout's Z on the tile (dropout.py), or None without dropout."""
    B, H, L = q.shape[:3]
    return dropout.keep_scale(params, (B, H, L, S), rows, cols, q.dtype, q.device)


def _prepare(q, k, v, *kv_like):
    """Upcast to the accumulation dtype and expand key/value heads for GQA."""
    dt = acc_dtype(q.dtype)
    H = q.shape[1]
    out = [q.to(dt), expand_kv(k.to(dt), H), expand_kv(v.to(dt), H)]
    out += [None if t is None else expand_kv(t.to(dt), H) for t in kv_like]
    return out


def _up(t, dt):
    return None if t is None else t.to(dt)


def _row_delta(do, o, dlse):
    """D = rowsum(dO ∘ O) - dlse: the row term of the first backward."""
    D = (do * o).sum(-1)
    return D if dlse is None else D - dlse


# ----------------------------------------------------------------------------- forward
def forward(q, k, v, params):
    causal = params.causal
    out_dtype = q.dtype
    q, k, v = _prepare(q, k, v)
    B, H, L, _ = q.shape
    S, Ev = k.shape[2], v.shape[3]
    o = torch.zeros(B, H, L, Ev, dtype=q.dtype, device=q.device)
    lse = torch.full((B, H, L), -math.inf, dtype=q.dtype, device=q.device)
    for rows in _row_tiles(L):
        n = rows.stop - rows.start
        m = torch.full((B, H, n), -math.inf, dtype=q.dtype, device=q.device)
        denom = torch.zeros(B, H, n, dtype=q.dtype, device=q.device)
        acc = torch.zeros(B, H, n, Ev, dtype=q.dtype, device=q.device)
        for cols, masked in _key_tiles(rows, S, causal):
            s = _scores(_natural_scores(q[:, :, rows], k[:, :, cols], params), params, rows, cols,
                        masked)
            m_new = torch.maximum(m, s.amax(-1))
            # rows with every score -inf so far keep a finite reference point (no inf - inf);
            # a +inf score makes the row NaN, as softmax does
            m_ref = torch.where(m_new == -math.inf, 0.0, m_new)
            rescale = torch.exp(m - m_ref)
            p = torch.exp(s - m_ref.unsqueeze(-1))
            denom = denom * rescale + p.sum(-1)
            acc = acc * rescale.unsqueeze(-1) + dropped(p, _keep(params, q, S, rows, cols)) @ v[:, :, cols]
            m = m_new
        # A row sees no key iff its running max is still -inf (every score masked or -inf):
        # its o is then acc = 0 and its lse -inf. A NaN score makes the max NaN, so a row that
        # sees a NaN comes out NaN, as in SDPA, never as an empty row.
        denom = torch.where(m == -math.inf, 1.0, denom)
        o[:, :, rows] = acc / denom.unsqueeze(-1)
        lse[:, :, rows] = m + torch.log(denom)
    return o.to(out_dtype), lse


def forward_output(q, k, v, params):
    """o alone, for a call nothing will differentiate."""
    return forward(q, k, v, params)[0]


# ----------------------------------------------------------------------------- backward
def backward(q, k, v, o, lse, do, dlse, params):
    return _backward(q, k, v, o, lse, do, dlse, params, None)


def backward_bias(q, k, v, o, lse, do, dlse, params):
    """backward, and the cotangent of an additive mask, dS (dT with a cap; summed over its
    broadcast dims)."""
    dmask = _mask_accumulator(params.mask, acc_dtype(q.dtype))
    return (*_backward(q, k, v, o, lse, do, dlse, params, dmask), dmask.to(params.mask.dtype))


def _backward(q, k, v, o, lse, do, dlse, params, dmask):
    scale, causal = params.scale, params.causal
    dts, hkv = (q.dtype, k.dtype, v.dtype), k.shape[1]
    q, k, v = _prepare(q, k, v)
    dt = q.dtype
    o, lse, do, dlse = _up(o, dt), _up(lse, dt), _up(do, dt), _up(dlse, dt)
    L, S = q.shape[2], k.shape[2]
    D = _row_delta(do, o, dlse)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, cols, masked in _visible_tiles(L, S, causal):
        q_i, do_i, k_j, v_j = q[:, :, rows], do[:, :, rows], k[:, :, cols], v[:, :, cols]
        p, u = _probs(q_i, k_j, lse[:, :, rows], params, rows, cols, masked)
        z = _keep(params, q, S, rows, cols)
        ds = p * (dropped(do_i @ v_j.transpose(-2, -1), z) - D[:, :, rows].unsqueeze(-1))
        du = sloped(ds, cap_slope(u, params.softcap))
        dq[:, :, rows] += scale * du @ k_j
        dk[:, :, cols] += scale * du.transpose(-2, -1) @ q_i
        dv[:, :, cols] += dropped(p, z).transpose(-2, -1) @ do_i
        if dmask is not None:
            _accumulate_on_mask(dmask, ds, rows, cols)
    return dq.to(dts[0]), reduce_kv(dk, hkv).to(dts[1]), reduce_kv(dv, hkv).to(dts[2])


# ----------------------------------------------------------------------------- a mask's cotangent
def _mask_accumulator(mask, dtype):
    """Zeros in the mask's own shape (params.mask_own_shape)."""
    return torch.zeros(mask_own_shape(mask), dtype=dtype, device=mask.device)


def _on_mask(acc, rows, cols):
    """The index of a (rows, cols) tile in a mask-shaped tensor (all of a broadcast dim)."""
    return (slice(None), slice(None), rows if acc.shape[2] > 1 else slice(None),
            cols if acc.shape[3] > 1 else slice(None))


def _accumulate_on_mask(acc, t, rows, cols):
    """acc[tile] += t (B, H, rows, cols) summed over acc's broadcast dims."""
    dims = [d for d in range(4) if acc.shape[d] == 1 and t.shape[d] > 1]
    acc[_on_mask(acc, rows, cols)] += t.sum(dims, keepdim=True) if dims else t


# ----------------------------------------------------------------------------- backward-over-backward
def _second_order_inputs(q, k, v, o, lse, do, dlse, gdq, gdk, gdv):
    """Every input in the accumulation dtype, key/value heads expanded, and D."""
    q, k, v, gdk, gdv = _prepare(q, k, v, gdk, gdv)
    dt = q.dtype
    o, lse, do, dlse, gdq = _up(o, dt), _up(lse, dt), _up(do, dt), _up(dlse, dt), _up(gdq, dt)
    return q, k, v, o, lse, do, dlse, gdq, gdk, gdv, _row_delta(do, o, dlse)


def bob(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, params):
    scale, causal = params.scale, params.causal
    dts, hkv = [t.dtype for t in (q, k, v, o, lse, do)], k.shape[1]
    q, k, v, o, lse, do, dlse, gdq, gdk, gdv, D = _second_order_inputs(
        q, k, v, o, lse, do, dlse, gdq, gdk, gdv)
    L, S = q.shape[2], k.shape[2]
    gq, gk, gv, gdo = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(do)
    Dg, glse = torch.zeros_like(D), torch.zeros_like(D)
    has_f = gdq is not None or gdk is not None      # F = 0 (so A = 0) when both are None
    for rows, cols, masked in _visible_tiles(L, S, causal):
        q_i, do_i, k_j, v_j = q[:, :, rows], do[:, :, rows], k[:, :, cols], v[:, :, cols]
        p, u = _probs(q_i, k_j, lse[:, :, rows], params, rows, cols, masked)
        slope = cap_slope(u, params.softcap)
        z = _keep(params, q, S, rows, cols)
        dp_shifted = dropped(do_i @ v_j.transpose(-2, -1), z) - D[:, :, rows].unsqueeze(-1)
        ds = p * dp_shifted
        du = sloped(ds, slope)
        p_bar = torch.zeros_like(p)                 # cotangent of P (lse held fixed)
        if gdv is not None:
            p_bar = p_bar + dropped(do_i @ gdv[:, :, cols].transpose(-2, -1), z)
            gdo[:, :, rows] += dropped(p, z) @ gdv[:, :, cols]
        F = None                                    # cotangent of dS (of dU with a cap)
        if has_f:
            F = torch.zeros_like(p)
            if gdq is not None:
                F = F + scale * gdq[:, :, rows] @ k_j.transpose(-2, -1)
                gk[:, :, cols] += scale * du.transpose(-2, -1) @ gdq[:, :, rows]
            if gdk is not None:
                F = F + scale * q_i @ gdk[:, :, cols].transpose(-2, -1)
                gq[:, :, rows] += scale * du @ gdk[:, :, cols]
            F_t = sloped(F, slope)                  # cotangent of dT
            A = p * F_t                             # cotangent of dP
            p_bar = p_bar + F_t * dp_shifted
            Dg[:, :, rows] += A.sum(-1)
            gv[:, :, cols] += dropped(A, z).transpose(-2, -1) @ do_i
            gdo[:, :, rows] += dropped(A, z) @ v_j
        s_bar = p * p_bar                           # cotangent of the scores
        glse[:, :, rows] -= s_bar.sum(-1)
        u_bar = sloped(s_bar, slope)                # cotangent of U
        bend = _curvature_term(u, params, ds, F)
        if bend is not None:
            u_bar = u_bar + bend
        gq[:, :, rows] += scale * u_bar @ k_j
        gk[:, :, cols] += scale * u_bar.transpose(-2, -1) @ q_i
    go = -Dg.unsqueeze(-1) * do
    gdo = gdo - Dg.unsqueeze(-1) * o
    outs = (gq, reduce_kv(gk, hkv), reduce_kv(gv, hkv), go, glse, gdo, Dg)
    return tuple(t.to(d) for t, d in zip(outs, dts + [dts[4]]))


def bob_folded(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, dq, params):
    return _bob_folded(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, dq, params, None, None)


def bob_folded_bias(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, gdmask, dq, params):
    """bob_folded where an additive mask is an input too (the first backward returned its
    cotangent dS, whose cotangent gdmask, shaped like the mask, may be None): the mask's
    cotangent Sbar is returned last (summed over its broadcast dims). dS's cotangent F
    gains gdmask; nothing else changes (docs/second-order.md, "A learned bias")."""
    gmask = _mask_accumulator(params.mask, acc_dtype(q.dtype))
    outs = _bob_folded(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, dq, params,
                       None if gdmask is None else gdmask.to(gmask.dtype), gmask)
    return (*outs, gmask.to(params.mask.dtype))


def _bob_folded(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, dq, params, gdmask, gmask):
    """The folded form (docs/second-order.md): per query tile, a first sweep over its key
    tiles gathers the row scalars alpha = rowsum(P F) and E = rowsum(P (C + F (dP - D))) -
    alpha dlse with the row outputs' alpha-free sums; a second sweep adds the column
    outputs, whose every term carries the row's alpha and E. R = dS k is read from the
    first backward's dq (= scale R) where it is given. With a cap F is F_T = φ'(U) F, R is
    dU k, B = P k becomes (φ'(U) P) k and U's cotangent gains the curvature term
    (docs/second-order.md, "Score transforms")."""
    scale, causal = params.scale, params.causal
    dts, hkv = [t.dtype for t in (q, k, v, do, lse)], k.shape[1]
    q, k, v, o, lse, do, dlse, gdq, gdk, gdv, D = _second_order_inputs(
        q, k, v, o, lse, do, dlse, gdq, gdk, gdv)
    dq = _up(dq, q.dtype)
    L, S = q.shape[2], k.shape[2]
    gq, gk, gv, gdo = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(do)
    alpha = torch.zeros_like(D)
    # F = 0 (so alpha = 0) when every cotangent of dS is None
    has_f = gdq is not None or gdk is not None or gdmask is not None

    def tile(rows, cols, masked):
        """P, Z, dP - D, φ'(U) (None without a cap), F (that of dT with a cap; None when
        zero), C + F (dP - D), the alpha-free cotangent of P, and the cap's curvature term
        of U's cotangent (None when zero)."""
        q_i, do_i, k_j, v_j = q[:, :, rows], do[:, :, rows], k[:, :, cols], v[:, :, cols]
        p, u = _probs(q_i, k_j, lse[:, :, rows], params, rows, cols, masked)
        slope = cap_slope(u, params.softcap)
        z = _keep(params, q, S, rows, cols)
        dp_shifted = dropped(do_i @ v_j.transpose(-2, -1), z) - D[:, :, rows].unsqueeze(-1)
        F = bend = None
        if has_f:
            F = torch.zeros_like(p)
            if gdq is not None:
                F = F + scale * gdq[:, :, rows] @ k_j.transpose(-2, -1)
            if gdk is not None:
                F = F + scale * q_i @ gdk[:, :, cols].transpose(-2, -1)
            # F so far is dU's cotangent; the bias's gdmask is dT's, added after the slope
            if params.softcap:      # dT formed here only where the curvature term needs it
                bend = _curvature_term(u, params, p * dp_shifted, F)
            F = sloped(F, slope)
            if gdmask is not None:
                F = F + gdmask[_on_mask(gdmask, rows, cols)]
        p_bar = torch.zeros_like(p) if F is None else F * dp_shifted
        if gdv is not None:
            p_bar = p_bar + dropped(do_i @ gdv[:, :, cols].transpose(-2, -1), z)
        return p, z, dp_shifted, slope, F, p_bar, bend

    for rows in _row_tiles(L):
        key_tiles = list(_key_tiles(rows, S, causal))
        q_i, do_i = q[:, :, rows], do[:, :, rows]
        a_i = torch.zeros_like(D[:, :, rows])
        e_i = torch.zeros_like(a_i)
        omega, r, b = torch.zeros_like(q_i), torch.zeros_like(q_i), torch.zeros_like(q_i)
        for cols, masked in key_tiles:
            p, z, dp_shifted, slope, F, p_bar, bend = tile(rows, cols, masked)
            k_j, v_j = k[:, :, cols], v[:, :, cols]
            du = sloped(p * dp_shifted, slope)
            e_i += (p * p_bar).sum(-1)
            u_bar_free = sloped(p * p_bar, slope)   # U's cotangent without alpha and E
            if bend is not None:
                u_bar_free = u_bar_free + bend
            omega += u_bar_free @ k_j
            b += sloped(p, slope) @ k_j
            if gdv is not None:
                gdo[:, :, rows] += dropped(p, z) @ gdv[:, :, cols]
            if gdk is not None:
                omega += du @ gdk[:, :, cols]
            if F is not None:
                a_i += (p * F).sum(-1)
                if dq is None:
                    r += du @ k_j
                gdo[:, :, rows] += dropped(p * F, z) @ v_j
        if dlse is not None:
            e_i = e_i - a_i * dlse[:, :, rows]
        # scale alpha R is alpha dq where dq is read (never dq / scale: scale may be 0)
        scaled_r = scale * r if dq is None else dq[:, :, rows]
        gq[:, :, rows] = scale * (omega - e_i.unsqueeze(-1) * b) - a_i.unsqueeze(-1) * scaled_r
        gdo[:, :, rows] -= a_i.unsqueeze(-1) * o[:, :, rows]
        alpha[:, :, rows] = a_i
        for cols, masked in key_tiles:
            p, z, dp_shifted, slope, F, p_bar, bend = tile(rows, cols, masked)
            # Sbar = P (C + (F - alpha)(dP - D) - E)
            s_bar = p * (p_bar - a_i.unsqueeze(-1) * dp_shifted - e_i.unsqueeze(-1))
            u_bar = sloped(s_bar, slope)
            if bend is not None:
                u_bar = u_bar + bend
            gk[:, :, cols] += scale * u_bar.transpose(-2, -1) @ q_i
            if gmask is not None:
                _accumulate_on_mask(gmask, s_bar, rows, cols)
            if gdq is not None:
                gk[:, :, cols] += scale * sloped(p * dp_shifted, slope).transpose(-2, -1) \
                    @ gdq[:, :, rows]
            if F is not None:
                gv[:, :, cols] += dropped(p * (F - a_i.unsqueeze(-1)), z).transpose(-2, -1) @ do_i
    outs = (gq, reduce_kv(gk, hkv), reduce_kv(gv, hkv), gdo, alpha)
    return tuple(t.to(d) for t, d in zip(outs, dts))


# ----------------------------------------------------------------------------- forward mode
def forward_jvp(q, k, v, o, lse, tq, tk, tv, params):
    scale, causal = params.scale, params.causal
    out_dtype = o.dtype
    q, k, v, tk, tv = _prepare(q, k, v, tk, tv)
    dt = q.dtype
    o, lse, tq = _up(o, dt), _up(lse, dt), _up(tq, dt)
    L, S = q.shape[2], k.shape[2]
    tlse = torch.zeros_like(lse)
    to = torch.zeros_like(o)
    for rows, cols, masked in _visible_tiles(L, S, causal):
        q_i, k_j = q[:, :, rows], k[:, :, cols]
        p, u = _probs(q_i, k_j, lse[:, :, rows], params, rows, cols, masked)
        z = _keep(params, q, S, rows, cols)
        if tq is not None or tk is not None:
            ts = torch.zeros_like(p)
            if tq is not None:
                ts = ts + scale * tq[:, :, rows] @ k_j.transpose(-2, -1)
            if tk is not None:
                ts = ts + scale * q_i @ tk[:, :, cols].transpose(-2, -1)
            ts = sloped(ts, cap_slope(u, params.softcap))     # U's tangent as T's
            tlse[:, :, rows] += (p * ts).sum(-1)
            to[:, :, rows] += dropped(p * ts, z) @ v[:, :, cols]
        if tv is not None:
            to[:, :, rows] += dropped(p, z) @ tv[:, :, cols]
    to = to - tlse.unsqueeze(-1) * o
    return to.to(out_dtype), tlse


def backward_jvp(q, k, v, o, lse, do, dlse, tq, tk, tv, to, tlse, tdo, tdlse, params):
    scale, causal = params.scale, params.causal
    dts, hkv = (q.dtype, k.dtype, v.dtype), k.shape[1]
    q, k, v, tk, tv = _prepare(q, k, v, tk, tv)
    dt = q.dtype
    o, lse, do, dlse = _up(o, dt), _up(lse, dt), _up(do, dt), _up(dlse, dt)
    tq, to, tlse, tdo, tdlse = _up(tq, dt), _up(to, dt), _up(tlse, dt), _up(tdo, dt), _up(tdlse, dt)
    L, S = q.shape[2], k.shape[2]
    D = _row_delta(do, o, dlse)
    tD = torch.zeros_like(D)                        # tangent of D, row-local
    if tdo is not None:
        tD = tD + (tdo * o).sum(-1)
    if to is not None:
        tD = tD + (do * to).sum(-1)
    if tdlse is not None:
        tD = tD - tdlse
    tdq, tdk, tdv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, cols, masked in _visible_tiles(L, S, causal):
        q_i, do_i, k_j, v_j = q[:, :, rows], do[:, :, rows], k[:, :, cols], v[:, :, cols]
        p, u = _probs(q_i, k_j, lse[:, :, rows], params, rows, cols, masked)
        slope = cap_slope(u, params.softcap)
        z = _keep(params, q, S, rows, cols)
        dp_shifted = dropped(do_i @ v_j.transpose(-2, -1), z) - D[:, :, rows].unsqueeze(-1)
        ds = p * dp_shifted
        tu = torch.zeros_like(p)                    # tangent of U
        if tq is not None:
            tu = tu + scale * tq[:, :, rows] @ k_j.transpose(-2, -1)
        if tk is not None:
            tu = tu + scale * q_i @ tk[:, :, cols].transpose(-2, -1)
        ts = sloped(tu, slope)                      # tangent of the scores minus tangent of lse
        if tlse is not None:
            ts = ts - tlse[:, :, rows].unsqueeze(-1)
        tp = p * ts
        tdp = -tD[:, :, rows].unsqueeze(-1).expand_as(p)
        if tdo is not None:
            tdp = tdp + dropped(tdo[:, :, rows] @ v_j.transpose(-2, -1), z)
            tdv[:, :, cols] += dropped(p, z).transpose(-2, -1) @ tdo[:, :, rows]
        if tv is not None:
            tdp = tdp + dropped(do_i @ tv[:, :, cols].transpose(-2, -1), z)
        tds = tp * dp_shifted + p * tdp
        # q and k see U's: tdU = φ' tdT + φ'' tU dT, dU = φ' dT
        tdu, du = sloped(tds, slope), sloped(ds, slope)
        bend = _curvature_term(u, params, ds, tu)
        if bend is not None:
            tdu = tdu + bend
        tdq[:, :, rows] += scale * tdu @ k_j
        tdk[:, :, cols] += scale * tdu.transpose(-2, -1) @ q_i
        tdv[:, :, cols] += dropped(tp, z).transpose(-2, -1) @ do_i
        if tk is not None:
            tdq[:, :, rows] += scale * du @ tk[:, :, cols]
        if tq is not None:
            tdk[:, :, cols] += scale * du.transpose(-2, -1) @ tq[:, :, rows]
    return tdq.to(dts[0]), reduce_kv(tdk, hkv).to(dts[1]), reduce_kv(tdv, hkv).to(dts[2])
