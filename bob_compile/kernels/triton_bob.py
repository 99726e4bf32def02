"""Backward-over-backward in Triton: the VJP of `backward` w.r.t. (q, k, v, o, lse, do, dlse).

Chain form (o and lse are inputs of the backward; docs/second-order.md, and
bob_compile/kernels/reference.py `bob`). With the upstream cotangents gdq, gdk, gdv of dq, dk, dv:

    P = exp(scale q k^T - lse)   dP = dO v^T   D = rowsum(dO * O) - dlse   dS = P * (dP - D)
    F = scale (gdq k^T + q gdk^T)          (cotangent of dS)
    A = P * F                               (cotangent of dP)
    Sbar = P * (dO gdv^T + F * (dP - D))    (cotangent of the scores)
    gq = scale (Sbar k + dS gdk)     gk = scale (Sbar^T q + dS^T gdq)     gv = A^T dO
    Dg = rowsum(A)   go = -Dg * dO   glse = -rowsum(Sbar)   gdo = P gdv + A v - Dg * O
    gdlse = Dg

No output needs a whole-row reduction before it can be accumulated, so there are two
schedules:
- deterministic (default): `_row_kernel` (query-block major: gq, gdo, go, glse, gdlse;
  9 GEMMs per tile) and `_column_kernel` (key-block major: gk, gv; 8 GEMMs per tile);
- one pass: `_column_kernel` with ROW_ATOMICS also adds the row outputs' partials into
  fp32 buffers (12 GEMMs per tile instead of 17, plus (E + Ev + 2) fp32 atomics per row and
  key block), then `_finish_rows_kernel` turns them into the outputs.
gdq/gdk/gdv = None are constexpr flags: their GEMMs are not emitted.

Folded form (FOLD; `bob_folded`: o and lse are the forward's, and their cotangents go
into those of q, k, v; docs/second-order.md). The row pass runs first: with the row
scalars alpha = Dg and E = rowsum(Sbar) - alpha dlse it also accumulates B = P k and (where
F is non-zero) R = dS k, and returns gq = scale (Sbar k + dS gdk - alpha R - E B), gdo,
gdlse = alpha, and E in an fp32 row buffer. Given the first backward's dq (= scale R, HAS_DQ),
R is read from it instead of accumulated: one GEMM per tile and one accumulator fewer; given
B (HAS_B: an attention forward with the keys as values), B is read too, so that wide heads
keep no more accumulators than the chain form's row pass. The column pass then forms
Sbar' = P (dO gdv^T + (F - alpha)(dP - D) - E) and A' = P (F - alpha) for gk and gv.

Soft-capped scores (SOFTCAP, softcap = c; docs/second-order.md, "Score transforms"): the
scores are T = c tanh(U / c) of U = scale q k^T, before any mask. The formulas above hold
for T, with dS = dT = P * (dP - D), F_T = phi'(U) F in F's place (a learned bias's gdM adds
to F_T, not to F) and Sbar, Sbar' standing for T's cotangent Tbar (glse, E and the bias's
cotangent are built from it); what meets q and k is U's: dU = phi' dT and
Ubar = phi' Tbar + phi'' dT F. So gq = scale (Ubar k + dU gdk), gk = scale (Ubar^T q +
dU^T gdq), the folded row pass's R = dU k (still dq / scale) and B = (phi' P) k, which no
attention forward gives: the row pass accumulates it.
"""
import torch
import triton
import triton.language as tl

from .triton_backward import load_lse2_for_probabilities, row_dot
from .launching import fixed_plan, launch_plan, read_path_first, strides_of
from .tiles import (INDICES_PATH, LOG2E, MASK_FROM_INDICES, MASK_READ, NO_MASK_SOURCE, READ_PATH,
                    add_relative_bias, add_score_tile, apply_mask_tile, blocks,
                    column_block_program, dot_precision, group_on_mask_path,
                    key_blocks_of_row_block, key_loops_within_mask, load_row_vector, load_tile,
                    on_mask_path, padded_dim, row_block_program, row_blocks_of_key_block,
                    row_loops_within_mask, store_tile, unmasked_key_blocks, unmasked_query_blocks,
                    visibility_mask)
from .tuning import Untimed, interpreting, row_bytes, wide_candidates
from . import settings
from .triton_dropout import dropout_arguments, dropout_flags, dropout_tile
from .triton_softcap import (base2_scores, capped_curvature, capped_scores, capped_slope,
                             softcap_arguments, softcap_flags)
from .triton_masks import (NO_MASK, has_relative_bias, mask_flags, mask_kind_and_tensor,
                           mask_path_work, mask_paths, relative_flags)


# --------------------------------------------------------------------------------------
# Row outputs from their row-wise sums (shared by the row kernel and the atomic finish)
# --------------------------------------------------------------------------------------
@triton.jit
def _store_row_outputs(gq, gdo_sum, dg, sbar_sum, o, do, offs_m, offs_e, offs_ev, L, row,
                       GQ, GO, GDO, GLSE, GDLSE, sgql, sgol, sgdol,
                       HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                       PAD_E: tl.constexpr, PAD_EV: tl.constexpr, FOLD: tl.constexpr):
    """gq (already scaled), gdo = sum - Dg o, gdlse = Dg; in the chain form (not FOLD) also
    go = -Dg dO and glse = -rowsum(Sbar), which the folded form sends through the forward."""
    store_tile(GQ, gq.to(GQ.dtype.element_ty), offs_m, offs_e, sgql, 1, L, HEAD_DIM, PAD_E)
    gdo = gdo_sum - dg[:, None] * o.to(tl.float32)
    store_tile(GDO, gdo.to(GDO.dtype.element_ty), offs_m, offs_ev, sgdol, 1, L, HEAD_DIM_V,
               PAD_EV)
    if not FOLD:
        go = -dg[:, None] * do.to(tl.float32)
        store_tile(GO, go.to(GO.dtype.element_ty), offs_m, offs_ev, sgol, 1, L, HEAD_DIM_V,
                   PAD_EV)
        tl.store(GLSE + row + offs_m, (-sbar_sum).to(GLSE.dtype.element_ty), mask=offs_m < L)
    tl.store(GDLSE + row + offs_m, dg.to(GDLSE.dtype.element_ty), mask=offs_m < L)


# --------------------------------------------------------------------------------------
# Row pass: gq, gdo, go, glse, gdlse (query-block major, deterministic)
# --------------------------------------------------------------------------------------
@triton.jit
def _dot_halves(x, y, acc, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + x y with the fp32 tile x rounded to y's half precision; SPLIT: plus a second
    GEMM of what that rounding dropped (x's low part), so that x enters with ~16 bits."""
    high = x.to(y.dtype)
    acc += tl.dot(high, y, input_precision=DOT_PRECISION)
    if SPLIT:
        acc += tl.dot((x - high.to(tl.float32)).to(y.dtype), y, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _row_steps(gq, gdo, dg, sbar_sum, r_acc, b_acc, q, do, gdq, lse2, d,
               k_base, v_base, gdk_base, gdv_base, skn, ske, svn, sve, sgkn, sgke, sgvn, sgve,
               mask_base, sml, sme, firsts, ends, offs_m, offs_e, offs_ev, n_lo, n_hi,
               gap_lo, gap_len, L, S, qk_scale_log2, scale, seed_ptr, head, m0, drop_threshold,
               keep_scale, gdm_base, sgml, sgme, softcap, HEAD_DIM: tl.constexpr,
               HEAD_DIM_V: tl.constexpr,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               MASK_KIND: tl.constexpr, PAD_E: tl.constexpr, PAD_EV: tl.constexpr,
               HAS_GDQ: tl.constexpr, HAS_GDK: tl.constexpr, HAS_GDV: tl.constexpr,
               ACCUMULATE_B: tl.constexpr, ACCUMULATE_R: tl.constexpr,
               SPLIT_SBAR: tl.constexpr, SPLIT_ALL: tl.constexpr, DOT_PRECISION: tl.constexpr,
               MASK_SOURCE: tl.constexpr, DROPOUT: tl.constexpr, HAS_GDM: tl.constexpr,
               SOFTCAP: tl.constexpr, RELATIVE: tl.constexpr):
    """SPLIT_SBAR: Sbar's GEMM with k in two half-precision parts; SPLIT_ALL: also those of
    dS (with gdk), P (with gdv) and A (with v), the roundings behind gq's and gdo's error.
    HAS_GDM: a learned bias's cotangent gdM (gdm_base: its (batch, head)) adds to F.
    SOFTCAP: the scores are T = c tanh(U / c); what meets k or gdk is U's (dU, Ubar)."""
    HAS_F: tl.constexpr = HAS_GDQ or HAS_GDK or HAS_GDM
    # the cap's curvature term phi'' dT F of Ubar, where F (without gdM) can be non-zero
    CURVED: tl.constexpr = SOFTCAP and (HAS_GDQ or HAS_GDK)
    # the key blocks [n_lo, n_hi) but those of [gap_lo, gap_lo + gap_len) (a loop over the
    # blocks at both ends of a key range: one pipeline)
    for n in range(n_lo, n_hi - gap_len, BLOCK_N):
        n0 = n + tl.where(n >= gap_lo, gap_len, 0)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = load_tile(k_base, offs_n, offs_e, skn, ske, S, HEAD_DIM, MASKED, PAD_E)
        v = load_tile(v_base, offs_n, offs_ev, svn, sve, S, HEAD_DIM_V, MASKED, PAD_EV)
        if SOFTCAP:     # capped in natural units, before any mask (base2_scores, inlined:
            # the helper's call cost the uncapped d = 128 folded row pass 144 bytes of spills)
            t, th = capped_scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale,
                                  softcap, SOFTCAP)
            s2 = t * 1.4426950408889634    # log2(e)
        else:
            s2 = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
        if RELATIVE:
            s2 = add_relative_bias(s2, mask_base, offs_m, offs_n, L, S, False)
        if MASKED:
            s2 = tl.where(visibility_mask(offs_m, offs_n, S, CAUSAL, False), s2, float("-inf"))
        if MASK_KIND != 0:
            s2 = apply_mask_tile(s2, mask_base, offs_m, offs_n, sml, sme, L, S, firsts, ends,
                                 MASK_KIND, False, MASK_SOURCE)
        p = tl.math.exp2(s2 - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        p_v = p         # where P meets gdv: dropped
        if DROPOUT:     # Z wherever P or its cotangents meet V, gdv or dO (dropout.py)
            z = dropout_tile(seed_ptr, head, L, m0, n0, S, drop_threshold, keep_scale,
                             offs_m.shape[0], BLOCK_N)
            dp = dp * z
            p_v = p * z
        delta = dp - d[:, None]
        if HAS_GDV:
            gdv = load_tile(gdv_base, offs_n, offs_ev, sgvn, sgve, S, HEAD_DIM_V, MASKED, PAD_EV)
            cot_scores = tl.dot(do, tl.trans(gdv), input_precision=DOT_PRECISION)
            if DROPOUT:
                cot_scores = cot_scores * z
            gdo = _dot_halves(p_v, gdv, gdo, SPLIT_ALL, DOT_PRECISION)
        if SOFTCAP:
            slope = capped_slope(th)
        if HAS_GDK or ACCUMULATE_R or CURVED:
            ds = p * delta      # dT
            du = ds
            if SOFTCAP:
                du = slope * ds
        if HAS_GDK:
            gdk = load_tile(gdk_base, offs_n, offs_e, sgkn, sgke, S, HEAD_DIM, MASKED, PAD_E)
            gq = _dot_halves(du, gdk, gq, SPLIT_ALL, DOT_PRECISION)
        # the folded form's B = (phi' P) k, and R = dU k where alpha can be non-zero (each
        # unless read)
        if ACCUMULATE_B:
            if SOFTCAP:
                b_acc += tl.dot((slope * p).to(k.dtype), k, input_precision=DOT_PRECISION)
            else:
                b_acc += tl.dot(p.to(k.dtype), k, input_precision=DOT_PRECISION)
        if ACCUMULATE_R:
            r_acc = _dot_halves(du, k, r_acc, False, DOT_PRECISION)
        if HAS_F:
            if HAS_GDQ and HAS_GDK:
                f = (tl.dot(gdq, tl.trans(k), input_precision=DOT_PRECISION)
                     + tl.dot(q, tl.trans(gdk), input_precision=DOT_PRECISION)) * scale
            elif HAS_GDQ:
                f = tl.dot(gdq, tl.trans(k), input_precision=DOT_PRECISION) * scale
            elif HAS_GDK:
                f = tl.dot(q, tl.trans(gdk), input_precision=DOT_PRECISION) * scale
            else:
                f = tl.zeros_like(p)
            if SOFTCAP:     # F is dU's cotangent; dT's, which the softmax sees, is phi' F
                if CURVED:
                    curvature = capped_curvature(th, softcap) * ds * f
                f = slope * f
            if HAS_GDM:
                f += load_tile(gdm_base, offs_m, offs_n, sgml, sgme, L, S, True, True)
            a = p * f
            dg += tl.sum(a, 1)
            a_v = a     # where A meets V: dropped
            if DROPOUT:
                a_v = a * z
            gdo = _dot_halves(a_v, v, gdo, SPLIT_ALL, DOT_PRECISION)
            if HAS_GDV:
                cot_scores += f * delta
            else:
                cot_scores = f * delta
        sbar = p * cot_scores       # Tbar with a cap: glse's, and E's
        sbar_sum += tl.sum(sbar, 1)
        ubar = sbar
        if SOFTCAP:     # Ubar = phi' Tbar + phi'' dT F meets k
            ubar = slope * sbar
            if CURVED:
                ubar += curvature
        gq = _dot_halves(ubar, k, gq, SPLIT_SBAR or SPLIT_ALL, DOT_PRECISION)
    return gq, gdo, dg, sbar_sum, r_acc, b_acc


@triton.jit
def _row_kernel(Q, K, V, O, DO, LSE, D, DLSE, GDQ, GDK, GDV, DQ, KEYS_OUT, GQ, GO, GDO, GLSE,
                GDLSE, ROW_E, MASK, KEY_RANGE, SEED, GDM,
                sqb, sqh, sql, sqe, skb, skh, skn, ske, svb, svh, svn, sve,
                sob, soh, sol, soe, sdb, sdh, sdl, sde, sgqb, sgqh, sgql, sgqe,
                sgkb, sgkh, sgkn, sgke, sgvb, sgvh, sgvn, sgve, sdqb, sdqh, sdql, sdqe,
                skob, skoh, skol, skoe, smb, smh, sml, sme, srb, srh, srl, sre,
                sgmb, sgmh, sgml, sgme,
                num_q_heads, kv_group, L, S, drop_threshold, qk_scale_log2, scale, keep_scale,
                softcap, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                MASK_KIND: tl.constexpr, MASK_PATH: tl.constexpr,
                HAS_GDQ: tl.constexpr, HAS_GDK: tl.constexpr, HAS_GDV: tl.constexpr,
                FOLD: tl.constexpr, HAS_DLSE: tl.constexpr, HAS_DQ: tl.constexpr,
                HAS_B: tl.constexpr, SPLIT_SBAR: tl.constexpr, SPLIT_EDGES: tl.constexpr,
                DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr, HAS_GDM: tl.constexpr,
                SOFTCAP: tl.constexpr, RELATIVE: tl.constexpr):
    PAD_E: tl.constexpr = BLOCK_E != HEAD_DIM
    PAD_EV: tl.constexpr = BLOCK_EV != HEAD_DIM_V
    # the folded form's B and R (R only where alpha can be non-zero): accumulated, or read
    HAS_F: tl.constexpr = HAS_GDQ or HAS_GDK or HAS_GDM
    ACCUMULATE_B: tl.constexpr = FOLD and not HAS_B
    ACCUMULATE_R: tl.constexpr = FOLD and HAS_F and not HAS_DQ
    READ_R: tl.constexpr = FOLD and HAS_F and HAS_DQ
    b, h, hk, m0, offs_m, offs_e, offs_ev, row = row_block_program(
        num_q_heads, kv_group, L, BLOCK_M, BLOCK_E, BLOCK_EV, CAUSAL)
    head = b * num_q_heads + h
    if MASK_KIND != 0:      # only this launch's (batch, head)s (MASK_PATH)
        if on_mask_path(tl.load(KEY_RANGE + b * srb + h * srh + 2 * sre),
                        MASK_PATH) == 0:
            return
    q = load_tile(Q + b * sqb + h * sqh, offs_m, offs_e, sql, sqe, L, HEAD_DIM, True, PAD_E)
    do = load_tile(DO + b * sdb + h * sdh, offs_m, offs_ev, sdl, sde, L, HEAD_DIM_V, True, PAD_EV)
    gdq = q
    if HAS_GDQ:
        gdq = load_tile(GDQ + b * sgqb + h * sgqh, offs_m, offs_e, sgql, sgqe, L, HEAD_DIM, True,
                        PAD_E)
    lse2 = load_lse2_for_probabilities(LSE + row, offs_m, L)
    d = load_row_vector(D + row, offs_m, L)

    gq = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    gdo = tl.zeros([BLOCK_M, BLOCK_EV], tl.float32)
    dg = tl.zeros([BLOCK_M], tl.float32)
    sbar_sum = tl.zeros([BLOCK_M], tl.float32)
    # accumulators a configuration never updates are [1, 1]: the loop drops them
    r_acc = tl.zeros([1, 1], tl.float32)
    b_acc = tl.zeros([1, 1], tl.float32)
    if ACCUMULATE_B:
        b_acc = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    if ACCUMULATE_R:
        r_acc = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    gdk_base = GDK + b * sgkb + hk * sgkh
    gdv_base = GDV + b * sgvb + hk * sgvh
    mask_base = MASK + b * smb + h * smh
    gdm_base = GDM + b * sgmb + h * sgmh
    full_end, visible_end = key_blocks_of_row_block(m0, S, BLOCK_M, BLOCK_N, CAUSAL)
    lo1, hi1, lo2, hi2 = 0, full_end, full_end, visible_end
    firsts, ends = 0, S     # the rows' key intervals, on the INDICES_PATH
    if MASK_KIND != 0:      # only the key blocks holding keys these rows see
        lo1, hi1, lo2, hi2, firsts, ends = key_loops_within_mask(
            lo1, hi1, lo2, hi2, m0, KEY_RANGE + b * srb + h * srh, sre, L,
            BLOCK_M, BLOCK_N)
    # a key range's launch: the blocks wholly inside it unmasked, its edge blocks
    # and the diagonal from indices; else no mask, or the mask read (MASK_PATH)
    if MASK_PATH == INDICES_PATH:
        a_end, b_end = unmasked_key_blocks(lo1, hi1, hi2, firsts, ends, offs_m, L, BLOCK_N)
        gq, gdo, dg, sbar_sum, r_acc, b_acc = _row_steps(
            gq, gdo, dg, sbar_sum, r_acc, b_acc, q, do, gdq, lse2, d, k_base, v_base, gdk_base,
            gdv_base, skn, ske, svn, sve, sgkn, sgke, sgvn, sgve, mask_base, sml, sme, firsts,
            ends, offs_m, offs_e, offs_ev, a_end, b_end, 0, 0, L, S, qk_scale_log2,
            scale, SEED, head, m0, drop_threshold, keep_scale, gdm_base, sgml, sgme, softcap,
            HEAD_DIM, HEAD_DIM_V, BLOCK_N, False, CAUSAL, 0, PAD_E, PAD_EV, HAS_GDQ, HAS_GDK,
            HAS_GDV, ACCUMULATE_B, ACCUMULATE_R, SPLIT_SBAR, False, DOT_PRECISION,
            NO_MASK_SOURCE, DROPOUT, HAS_GDM, SOFTCAP, RELATIVE)
        gq, gdo, dg, sbar_sum, r_acc, b_acc = _row_steps(
            gq, gdo, dg, sbar_sum, r_acc, b_acc, q, do, gdq, lse2, d, k_base, v_base, gdk_base,
            gdv_base, skn, ske, svn, sve, sgkn, sgke, sgvn, sgve, mask_base, sml, sme, firsts,
            ends, offs_m, offs_e, offs_ev, lo1, hi2, a_end, b_end - a_end, L, S,
            qk_scale_log2, scale, SEED, head, m0, drop_threshold, keep_scale, gdm_base, sgml, sgme,
            softcap, HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, CAUSAL, MASK_KIND, PAD_E, PAD_EV, HAS_GDQ,
            HAS_GDK, HAS_GDV, ACCUMULATE_B, ACCUMULATE_R, SPLIT_SBAR, SPLIT_EDGES,
            DOT_PRECISION, MASK_FROM_INDICES, DROPOUT, HAS_GDM, SOFTCAP, RELATIVE)
    else:
        gq, gdo, dg, sbar_sum, r_acc, b_acc = _row_steps(
            gq, gdo, dg, sbar_sum, r_acc, b_acc, q, do, gdq, lse2, d, k_base, v_base, gdk_base,
            gdv_base, skn, ske, svn, sve, sgkn, sgke, sgvn, sgve, mask_base, sml, sme, firsts,
            ends, offs_m, offs_e, offs_ev, lo1, hi1, 0, 0, L, S, qk_scale_log2, scale,
            SEED, head, m0, drop_threshold, keep_scale, gdm_base, sgml, sgme, softcap,
            HEAD_DIM, HEAD_DIM_V, BLOCK_N, False, CAUSAL, MASK_KIND, PAD_E, PAD_EV, HAS_GDQ,
            HAS_GDK, HAS_GDV, ACCUMULATE_B, ACCUMULATE_R, SPLIT_SBAR, False, DOT_PRECISION,
            MASK_READ, DROPOUT, HAS_GDM, SOFTCAP, RELATIVE)
        gq, gdo, dg, sbar_sum, r_acc, b_acc = _row_steps(
            gq, gdo, dg, sbar_sum, r_acc, b_acc, q, do, gdq, lse2, d, k_base, v_base, gdk_base,
            gdv_base, skn, ske, svn, sve, sgkn, sgke, sgvn, sgve, mask_base, sml, sme, firsts,
            ends, offs_m, offs_e, offs_ev, lo2, hi2, 0, 0, L, S, qk_scale_log2, scale,
            SEED, head, m0, drop_threshold, keep_scale, gdm_base, sgml, sgme, softcap,
            HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, CAUSAL, MASK_KIND, PAD_E, PAD_EV, HAS_GDQ,
            HAS_GDK, HAS_GDV, ACCUMULATE_B, ACCUMULATE_R, SPLIT_SBAR, SPLIT_EDGES,
            DOT_PRECISION, MASK_READ, DROPOUT, HAS_GDM, SOFTCAP, RELATIVE)
    o = load_tile(O + b * sob + h * soh, offs_m, offs_ev, sol, soe, L, HEAD_DIM_V, True, PAD_EV)
    # outputs are contiguous (B, Hq, L, E|Ev): row `row + i` starts at (row + i) * E
    if FOLD:
        # alpha = Dg; E = rowsum(Sbar) - alpha dlse; gq = scale (Omega - alpha R - E B)
        e = sbar_sum
        if HAS_DLSE:
            e -= dg * load_row_vector(DLSE + row, offs_m, L)
        if not ACCUMULATE_B:
            b_acc = load_tile(KEYS_OUT + b * skob + h * skoh, offs_m, offs_e, skol, skoe, L,
                              HEAD_DIM, True, PAD_E).to(tl.float32)
        gq -= e[:, None] * b_acc
        if ACCUMULATE_R:
            gq -= dg[:, None] * r_acc
        tl.store(ROW_E + row + offs_m, e, mask=offs_m < L)
    gq *= scale
    if READ_R:      # scale alpha R = alpha dq
        dq = load_tile(DQ + b * sdqb + h * sdqh, offs_m, offs_e, sdql, sdqe, L, HEAD_DIM, True,
                       PAD_E)
        gq -= dg[:, None] * dq.to(tl.float32)
    _store_row_outputs(gq, gdo, dg, sbar_sum, o, do, offs_m, offs_e, offs_ev, L, row,
                       GQ + row * HEAD_DIM, GO + row * HEAD_DIM_V, GDO + row * HEAD_DIM_V,
                       GLSE, GDLSE, HEAD_DIM, HEAD_DIM_V, HEAD_DIM_V,
                       HEAD_DIM, HEAD_DIM_V, PAD_E, PAD_EV, FOLD)


strides_of(_row_kernel, Q="sq", K="sk", V="sv", O="so", DO="sd", GDQ="sgq", GDK="sgk",
           GDV="sgv", DQ="sdq", KEYS_OUT="sko", MASK="sm", KEY_RANGE="sr", GDM="sgm")


# --------------------------------------------------------------------------------------
# Column pass: gk, gv (key-block major; optionally the row outputs by fp32 atomics)
# --------------------------------------------------------------------------------------
@triton.jit
def _column_steps(gk, gv, k, v, gdk, gdv, q_base, do_base, gdq_base, lse_ptr, d_ptr,
                  alpha_ptr, e_ptr, row_acc, mask_base, sql, sqe, sdl, sde, sgql, sgqe, sml, sme,
                  firsts, ends, m_lo, m_hi, gap_lo, gap_len, n0, L, S, qk_scale_log2, scale, GQ_ACC,
                  GDO_ACC, DG_ACC, SBAR_ACC, seed_ptr, head, drop_threshold, keep_scale,
                  gdm_base, gm_base, sgml, sgme, sbgl, sbge, softcap,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
                  HAS_GDQ: tl.constexpr, HAS_GDK: tl.constexpr, HAS_GDV: tl.constexpr,
                  ROW_ATOMICS: tl.constexpr, FOLD: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  MASK_SOURCE: tl.constexpr, DROPOUT: tl.constexpr, HAS_GDM: tl.constexpr,
                  HAS_GM: tl.constexpr, SOFTCAP: tl.constexpr, RELATIVE: tl.constexpr):
    """HAS_GDM: a learned bias's cotangent gdM adds to F; HAS_GM: the folded form's Sbar,
    the bias's cotangent, is added into gm_base (fp32, by atomics). SOFTCAP: the scores are
    T = c tanh(U / c); what meets q, gdq or k is U's (dU, Ubar)."""
    PAD_E: tl.constexpr = BLOCK_E != HEAD_DIM
    PAD_EV: tl.constexpr = BLOCK_EV != HEAD_DIM_V
    HAS_F: tl.constexpr = HAS_GDQ or HAS_GDK or HAS_GDM
    # the cap's curvature term phi'' dT F of Ubar, where F (without gdM) can be non-zero
    CURVED: tl.constexpr = SOFTCAP and (HAS_GDQ or HAS_GDK)
    # dU meets gdq (gk) or, with the row outputs, gdk (gq); with a cap only where CURVED
    HAS_DU: tl.constexpr = HAS_GDQ or (ROW_ATOMICS and HAS_GDK)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    # the query blocks [m_lo, m_hi) but those of [gap_lo, gap_lo + gap_len) (a loop over
    # the blocks at both ends of the queries' intervals: one pipeline)
    for m in range(m_lo, m_hi - gap_len, BLOCK_M):
        m0 = m + tl.where(m >= gap_lo, gap_len, 0)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        q = load_tile(q_base, offs_m, offs_e, sql, sqe, L, HEAD_DIM, True, PAD_E)
        do = load_tile(do_base, offs_m, offs_ev, sdl, sde, L, HEAD_DIM_V, True, PAD_EV)
        lse2 = load_lse2_for_probabilities(lse_ptr, offs_m, L)
        d = load_row_vector(d_ptr, offs_m, L)
        if FOLD:        # the row pass's scalars: Sbar = P (C + (F - alpha)(dP - D) - E)
            e = load_row_vector(e_ptr, offs_m, L)
            if HAS_F:
                alpha = load_row_vector(alpha_ptr, offs_m, L)
        # tiles are [keys, queries] so that gk, gv accumulate without transposes
        s2t, tht = base2_scores(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION), scale,
                                qk_scale_log2, softcap, SOFTCAP)
        if RELATIVE:
            s2t = add_relative_bias(s2t, mask_base, offs_m, offs_n, L, S, True)
        if MASKED:
            s2t = tl.where(visibility_mask(offs_m, offs_n, S, CAUSAL, True), s2t, float("-inf"))
        if MASK_KIND != 0:
            s2t = apply_mask_tile(s2t, mask_base, offs_m, offs_n, sml, sme, L, S, firsts, ends,
                                  MASK_KIND, True, MASK_SOURCE)
        pt = tl.math.exp2(s2t - lse2[None, :])
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if DROPOUT:     # Z wherever P or its cotangents meet V, gdv or dO (dropout.py)
            zt = tl.trans(dropout_tile(seed_ptr, head, L, m0, n0, S, drop_threshold,
                                       keep_scale, BLOCK_M, BLOCK_N))
            dpt = dpt * zt
        deltat = dpt - d[None, :]
        if SOFTCAP:
            slope_t = capped_slope(tht)
            if CURVED:
                dtt = pt * deltat       # dT
        if HAS_GDV:
            cot_scores_t = tl.dot(gdv, tl.trans(do), input_precision=DOT_PRECISION)
            if DROPOUT:
                cot_scores_t = cot_scores_t * zt
        if HAS_F:
            if HAS_GDQ:
                gdq = load_tile(gdq_base, offs_m, offs_e, sgql, sgqe, L, HEAD_DIM, True, PAD_E)
            if HAS_GDQ and HAS_GDK:
                ft = (tl.dot(k, tl.trans(gdq), input_precision=DOT_PRECISION)
                      + tl.dot(gdk, tl.trans(q), input_precision=DOT_PRECISION)) * scale
            elif HAS_GDQ:
                ft = tl.dot(k, tl.trans(gdq), input_precision=DOT_PRECISION) * scale
            elif HAS_GDK:
                ft = tl.dot(gdk, tl.trans(q), input_precision=DOT_PRECISION) * scale
            else:
                ft = tl.zeros_like(pt)
            if SOFTCAP:     # F is dU's cotangent; dT's, which the softmax sees, is phi' F
                if CURVED:
                    curvature_t = capped_curvature(tht, softcap) * dtt * ft
                ft = slope_t * ft
            if HAS_GDM:     # [keys, queries]
                ft += load_tile(gdm_base, offs_n, offs_m, sgme, sgml, S, L, True, True)
            if FOLD:
                ft -= alpha[None, :]
            at = pt * ft
            at_v = at       # where A meets V (gv, gdo): dropped
            if DROPOUT:
                at_v = at * zt
            gv += tl.dot(at_v.to(do.dtype), do, input_precision=DOT_PRECISION)
            if HAS_GDV:
                cot_scores_t += ft * deltat
            else:
                cot_scores_t = ft * deltat
        if FOLD:
            cot_scores_t -= e[None, :]
        sbart = pt * cot_scores_t       # Tbar with a cap: the bias's and glse's
        if HAS_GM:
            add_score_tile(gm_base, sbart, offs_n, offs_m, sbge, sbgl, S, L)
        ubart = sbart
        if SOFTCAP:     # Ubar = phi' Tbar + phi'' dT F meets q and k
            ubart = slope_t * sbart
            if CURVED:
                ubart += curvature_t
        gk += tl.dot(ubart.to(q.dtype), q, input_precision=DOT_PRECISION)
        if HAS_DU:
            if SOFTCAP:
                dut = (slope_t * dtt).to(q.dtype)
            else:
                dut = (pt * deltat).to(q.dtype)
        if HAS_GDQ:
            gk += tl.dot(dut, gdq, input_precision=DOT_PRECISION)
        if ROW_ATOMICS:
            pt_v = pt       # where P meets gdv: dropped
            if DROPOUT:
                pt_v = pt * zt
            row_ok = offs_m < L
            gq_part = tl.dot(tl.trans(ubart.to(k.dtype)), k, input_precision=DOT_PRECISION)
            if HAS_GDK:
                gq_part += tl.dot(tl.trans(dut), gdk, input_precision=DOT_PRECISION)
            tl.atomic_add(GQ_ACC + (row_acc + offs_m[:, None]) * HEAD_DIM + offs_e[None, :],
                          gq_part * scale, mask=row_ok[:, None] & (offs_e[None, :] < HEAD_DIM),
                          sem="relaxed")
            gdo_ptrs = GDO_ACC + (row_acc + offs_m[:, None]) * HEAD_DIM_V + offs_ev[None, :]
            gdo_mask = row_ok[:, None] & (offs_ev[None, :] < HEAD_DIM_V)
            if HAS_F:
                gdo_part = tl.dot(tl.trans(at_v.to(v.dtype)), v, input_precision=DOT_PRECISION)
                if HAS_GDV:
                    gdo_part += tl.dot(tl.trans(pt_v.to(gdv.dtype)), gdv,
                                       input_precision=DOT_PRECISION)
                tl.atomic_add(gdo_ptrs, gdo_part, mask=gdo_mask, sem="relaxed")
                tl.atomic_add(DG_ACC + row_acc + offs_m, tl.sum(at, 0), mask=row_ok,
                              sem="relaxed")
            else:
                gdo_part = tl.dot(tl.trans(pt_v.to(gdv.dtype)), gdv, input_precision=DOT_PRECISION)
                tl.atomic_add(gdo_ptrs, gdo_part, mask=gdo_mask, sem="relaxed")
            tl.atomic_add(SBAR_ACC + row_acc + offs_m, tl.sum(sbart, 0), mask=row_ok,
                          sem="relaxed")
    return gk, gv


@triton.jit
def _column_kernel(Q, K, V, DO, LSE, D, ALPHA, ROW_E, GDQ, GDK, GDV, GK, GV,
                   GQ_ACC, GDO_ACC, DG_ACC, SBAR_ACC, MASK, KEY_RANGE, SEED, GDM, GM,
                   sqb, sqh, sql, sqe, skb, skh, skn, ske, svb, svh, svn, sve,
                   sdb, sdh, sdl, sde, sgqb, sgqh, sgql, sgqe,
                   sgkb, sgkh, sgkn, sgke, sgvb, sgvh, sgvn, sgve, smb, smh, sml, sme,
                   srb, srh, srl, sre, sgmb, sgmh, sgml, sgme, sbgb, sbgh, sbgl, sbge,
                   num_kv_heads, kv_group, L, S, drop_threshold, qk_scale_log2, scale, keep_scale,
                   softcap, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   MASK_KIND: tl.constexpr, MASK_PATH: tl.constexpr,
                   HAS_GDQ: tl.constexpr, HAS_GDK: tl.constexpr, HAS_GDV: tl.constexpr,
                   ROW_ATOMICS: tl.constexpr, FOLD: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   DROPOUT: tl.constexpr, HAS_GDM: tl.constexpr, HAS_GM: tl.constexpr,
                   SOFTCAP: tl.constexpr, RELATIVE: tl.constexpr):
    PAD_E: tl.constexpr = BLOCK_E != HEAD_DIM
    PAD_EV: tl.constexpr = BLOCK_EV != HEAD_DIM_V
    b, hk, n0, offs_n, offs_e, offs_ev = column_block_program(num_kv_heads, BLOCK_N, BLOCK_E,
                                                              BLOCK_EV)
    if MASK_KIND != 0:      # only this launch's key/value heads (MASK_PATH)
        if group_on_mask_path(KEY_RANGE + b * srb + hk * kv_group * srh, srh, sre,
                              kv_group, MASK_PATH) == 0:
            return
    k = load_tile(K + b * skb + hk * skh, offs_n, offs_e, skn, ske, S, HEAD_DIM, True, PAD_E)
    v = load_tile(V + b * svb + hk * svh, offs_n, offs_ev, svn, sve, S, HEAD_DIM_V, True, PAD_EV)
    gdk = k
    gdv = v
    if HAS_GDK:
        gdk = load_tile(GDK + b * sgkb + hk * sgkh, offs_n, offs_e, sgkn, sgke, S, HEAD_DIM,
                        True, PAD_E)
    if HAS_GDV:
        gdv = load_tile(GDV + b * sgvb + hk * sgvh, offs_n, offs_ev, sgvn, sgve, S, HEAD_DIM_V,
                        True, PAD_EV)
    gk = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    gv = tl.zeros([BLOCK_N, BLOCK_EV], tl.float32)
    m_first, m_unmasked = row_blocks_of_key_block(n0, L, BLOCK_M, BLOCK_N, CAUSAL)
    if ROW_ATOMICS:
        # padded keys would leak into the row sums: the partial last key block is masked
        if n0 + BLOCK_N > S:
            m_unmasked = ((L + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    num_q_heads = num_kv_heads * kv_group
    for g in range(0, kv_group):
        h = hk * kv_group + g
        head = b * num_q_heads + h
        row = head * L
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdb + h * sdh
        gdq_base = GDQ + b * sgqb + h * sgqh
        mask_base = MASK + b * smb + h * smh
        gdm_base = GDM + b * sgmb + h * sgmh
        gm_base = GM + b * sbgb + h * sbgh
        m_lo, m_mid, m_hi = m_first, m_unmasked, L
        firsts, ends = 0, S     # the keys' query intervals, on the INDICES_PATH
        if MASK_KIND != 0:      # only the query blocks that see keys of this block
            m_lo, m_mid, m_hi, firsts, ends = row_loops_within_mask(
                m_lo, m_mid, m_hi, n0, KEY_RANGE + b * srb + h * srh, sre, L, S,
                BLOCK_M, BLOCK_N)
        # a key range's launch: the blocks wholly inside it unmasked, its edge blocks
        # and the diagonal from indices; else no mask, or the mask read (MASK_PATH)
        if MASK_PATH == INDICES_PATH:
            m_a, m_b = unmasked_query_blocks(m_lo, m_mid, m_hi, firsts, ends, L, BLOCK_M)
            gk, gv = _column_steps(
                gk, gv, k, v, gdk, gdv, q_base, do_base, gdq_base, LSE + row, D + row,
                ALPHA + row, ROW_E + row, row, mask_base, sql, sqe, sdl, sde, sgql, sgqe, sml,
                sme, firsts, ends, m_lo, m_hi, m_a, m_b - m_a, n0, L, S, qk_scale_log2, scale,
                GQ_ACC, GDO_ACC, DG_ACC, SBAR_ACC, SEED, head, drop_threshold, keep_scale, gdm_base,
                gm_base, sgml, sgme, sbgl, sbge, softcap, HEAD_DIM, HEAD_DIM_V, BLOCK_E,
                BLOCK_EV, BLOCK_M, BLOCK_N, True, CAUSAL, MASK_KIND, HAS_GDQ, HAS_GDK, HAS_GDV,
                ROW_ATOMICS, FOLD, DOT_PRECISION, MASK_FROM_INDICES, DROPOUT, HAS_GDM, HAS_GM,
                SOFTCAP, RELATIVE)
            gk, gv = _column_steps(
                gk, gv, k, v, gdk, gdv, q_base, do_base, gdq_base, LSE + row, D + row,
                ALPHA + row, ROW_E + row, row, mask_base, sql, sqe, sdl, sde, sgql, sgqe, sml,
                sme, firsts, ends, m_a, m_b, 0, 0, n0, L, S, qk_scale_log2, scale,
                GQ_ACC, GDO_ACC, DG_ACC, SBAR_ACC, SEED, head, drop_threshold, keep_scale, gdm_base,
                gm_base, sgml, sgme, sbgl, sbge, softcap, HEAD_DIM, HEAD_DIM_V, BLOCK_E,
                BLOCK_EV, BLOCK_M, BLOCK_N, False, CAUSAL, 0, HAS_GDQ, HAS_GDK, HAS_GDV,
                ROW_ATOMICS, FOLD, DOT_PRECISION, NO_MASK_SOURCE, DROPOUT, HAS_GDM, HAS_GM,
                SOFTCAP, RELATIVE)
        else:
            gk, gv = _column_steps(
                gk, gv, k, v, gdk, gdv, q_base, do_base, gdq_base, LSE + row, D + row,
                ALPHA + row, ROW_E + row, row, mask_base, sql, sqe, sdl, sde, sgql, sgqe, sml,
                sme, firsts, ends, m_lo, m_mid, 0, 0, n0, L, S, qk_scale_log2, scale,
                GQ_ACC, GDO_ACC, DG_ACC, SBAR_ACC, SEED, head, drop_threshold, keep_scale, gdm_base,
                gm_base, sgml, sgme, sbgl, sbge, softcap, HEAD_DIM, HEAD_DIM_V, BLOCK_E,
                BLOCK_EV, BLOCK_M, BLOCK_N, True, CAUSAL, MASK_KIND, HAS_GDQ, HAS_GDK, HAS_GDV,
                ROW_ATOMICS, FOLD, DOT_PRECISION, MASK_READ, DROPOUT, HAS_GDM, HAS_GM,
                SOFTCAP, RELATIVE)
            gk, gv = _column_steps(
                gk, gv, k, v, gdk, gdv, q_base, do_base, gdq_base, LSE + row, D + row,
                ALPHA + row, ROW_E + row, row, mask_base, sql, sqe, sdl, sde, sgql, sgqe, sml,
                sme, firsts, ends, m_mid, m_hi, 0, 0, n0, L, S, qk_scale_log2, scale,
                GQ_ACC, GDO_ACC, DG_ACC, SBAR_ACC, SEED, head, drop_threshold, keep_scale, gdm_base,
                gm_base, sgml, sgme, sbgl, sbge, softcap, HEAD_DIM, HEAD_DIM_V, BLOCK_E,
                BLOCK_EV, BLOCK_M, BLOCK_N, False, CAUSAL, MASK_KIND, HAS_GDQ, HAS_GDK, HAS_GDV,
                ROW_ATOMICS, FOLD, DOT_PRECISION, MASK_READ, DROPOUT, HAS_GDM, HAS_GM,
                SOFTCAP, RELATIVE)
    store_tile(GK + (b * num_kv_heads + hk) * S * HEAD_DIM, (gk * scale).to(GK.dtype.element_ty),
               offs_n, offs_e, HEAD_DIM, 1, S, HEAD_DIM, PAD_E)
    store_tile(GV + (b * num_kv_heads + hk) * S * HEAD_DIM_V, gv.to(GV.dtype.element_ty),
               offs_n, offs_ev, HEAD_DIM_V, 1, S, HEAD_DIM_V, PAD_EV)


strides_of(_column_kernel, Q="sq", K="sk", V="sv", DO="sd", GDQ="sgq", GDK="sgk",
           GDV="sgv", MASK="sm", KEY_RANGE="sr", GDM="sgm", GM="sbg")


# --------------------------------------------------------------------------------------
# After the atomic column pass: row outputs from the fp32 sums
# --------------------------------------------------------------------------------------
@triton.jit
def _finish_rows_kernel(GQ_ACC, GDO_ACC, DG_ACC, SBAR_ACC, O, DO, GQ, GO, GDO, GLSE, GDLSE,
                        sob, soh, sol, soe, sdb, sdh, sdl, sde, num_q_heads, L,
                        HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr, BLOCK_M: tl.constexpr):
    PAD_E: tl.constexpr = BLOCK_E != HEAD_DIM
    PAD_EV: tl.constexpr = BLOCK_EV != HEAD_DIM_V
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_q_heads).to(tl.int64)
    h = (pid_bh % num_q_heads).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    row = pid_bh.to(tl.int64) * L
    gq = load_tile(GQ_ACC + row * HEAD_DIM, offs_m, offs_e, HEAD_DIM, 1, L, HEAD_DIM, True, PAD_E)
    gdo = load_tile(GDO_ACC + row * HEAD_DIM_V, offs_m, offs_ev, HEAD_DIM_V, 1, L, HEAD_DIM_V,
                    True, PAD_EV)
    dg = load_row_vector(DG_ACC + row, offs_m, L)
    sbar_sum = load_row_vector(SBAR_ACC + row, offs_m, L)
    o = load_tile(O + b * sob + h * soh, offs_m, offs_ev, sol, soe, L, HEAD_DIM_V, True, PAD_EV)
    do = load_tile(DO + b * sdb + h * sdh, offs_m, offs_ev, sdl, sde, L, HEAD_DIM_V, True, PAD_EV)
    _store_row_outputs(gq, gdo, dg, sbar_sum, o, do, offs_m, offs_e, offs_ev, L, row,
                       GQ + row * HEAD_DIM, GO + row * HEAD_DIM_V, GDO + row * HEAD_DIM_V,
                       GLSE, GDLSE, HEAD_DIM, HEAD_DIM_V, HEAD_DIM_V,
                       HEAD_DIM, HEAD_DIM_V, PAD_E, PAD_EV, False)


strides_of(_finish_rows_kernel, O="so", DO="sd")


# --------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------
def row_candidates(dtype, head_dim, head_dim_v, fold, reads_dq=False, read=False,
                   masked=False, dropout=False, softcap=False):
    """Launch configs of the row pass, the measured best first (the choice without tuning).
    fold: the folded form's row pass with B accumulated; reads_dq: R read from dq, not
    accumulated (what autograd runs); read: for a mask read per tile; masked: with a mask
    (read or from indices); dropout: with attention dropout; softcap: soft-capped scores."""
    if (dropout or softcap) and fold and reads_dq and not read and not interpreting() \
            and row_bytes(dtype, head_dim, head_dim_v) <= 128:
        # The mask's regeneration needs registers the 128 x 64 tile spills for: with
        # dropout 0.1 at 16K causal (H100, bench_row_configs.py --dropout 0.1), 128 x 32
        # with 8 warps took the step from 26.4 to 19.1 ms, and the tuner, given the list,
        # chose it (docs/measurements.md, "Dropout"). The cap's tanh and its derivatives
        # spill alike: compiled for sm_90a at d = 64 (kernel_resources.py --softcap), 128 x
        # 64 spills 2,224 / 2,940 bytes per thread, 128 x 32 144 / 184 (dropout: 1,900 /
        # 2,756 and 120 / 192); the capped row pass took 9.25 ms at 16K causal against 3.46
        # uncapped (H100, 128 x 64)
        return [dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3),
                dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3),
                dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)]
    candidates = _row_candidates(dtype, head_dim, head_dim_v, fold, reads_dq, masked or read)
    # 64 x 32: the fastest row pass reading its mask on a padded batch ("Masks")
    return read_path_first(candidates, dict(BLOCK_M=64, BLOCK_N=32, num_warps=4,
                                            num_stages=3)) if read else candidates


def _row_candidates(dtype, head_dim, head_dim_v, fold, reads_dq, masked):
    if interpreting():
        return [dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)]
    nbytes = row_bytes(dtype, head_dim, head_dim_v)
    if nbytes > 256:
        return wide_candidates(nbytes * (2 if fold else 1), column=False)
    if nbytes > 128:    # 128 x 32 with 8 warps: the fewest spills at d = 128 (kernel_resources.py)
        return [dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
                dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2),
                dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2),
                dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2)]
    # The folded form keeps one or two more (BLOCK_M x E) fp32 accumulators (B; R without dq).
    # Measured through autograd on the H200 at 16K (docs/measurements.md, "Row-pass launch
    # configs"): with dq read, 128 x 64 with 8 warps and three pipeline stages beats the
    # earlier choice (64 x 64, 4 warps, two stages); without dq, three stages beat two for
    # both tiles that were measured with both. Without a mask the first won every A/B
    # through autograd (16K causal and not, 64K causal; docs/measurements.md, "Three-stage
    # column pass"), but a tuner timing the launch alone took 64 x 64 at times (+2-3 %
    # per step), so unmasked calls get no choice (the others only where it does not build).
    if fold and reads_dq:
        candidates = [dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
                      dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
                      dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3),
                      dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3)]
        return candidates if masked else Untimed(candidates)
    if fold:
        return [dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3),
                dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3),
                dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)]
    # measured on the H200 (docs/measurements.md): 64 x 64 with 4 warps wins at every length
    return [dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
            dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
            dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2)]


def column_candidates(dtype, head_dim, head_dim_v, atomics, read=False, fold=False,
                      causal=False):
    """read: for a mask read per tile (its own measured best first, among the configs it
    was measured with); fold: the folded form's column pass; causal: a causal call without
    a mask."""
    candidates = _column_candidates(dtype, head_dim, head_dim_v, atomics, fold and not read,
                                    causal)
    # 32 x 64: the fastest column pass reading its mask on a padded batch ("Masks")
    return read_path_first(candidates, dict(BLOCK_M=32, BLOCK_N=64, num_warps=4,
                                            num_stages=2)) if read else candidates


def _column_candidates(dtype, head_dim, head_dim_v, atomics, fold, causal):
    if interpreting():
        return [dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)]
    nbytes = row_bytes(dtype, head_dim, head_dim_v) * (2 if atomics else 1)
    if nbytes > 256:
        return wide_candidates(nbytes, column=True)
    if nbytes > 128:
        return [dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2),
                dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
                dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)]
    # The folded column pass, forced one config at a time through autograd on the H200
    # (docs/measurements.md, "Three-stage column pass"): three pipeline stages win; causal,
    # 64 x 128 with 8 warps is the best at 16K and 2.3 % ahead of the next at 64K, where
    # the 16K bucket's decision is reused; a tuner timing the launch alone at 16K picks by
    # noise between them, so causal calls get no choice (the others only where it does not
    # build).
    if fold and causal:
        return Untimed([dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3),
                        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
                        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)])
    if fold:
        return [dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
                dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3),
                dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)]
    return [dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
            dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2),
            dict(BLOCK_M=32, BLOCK_N=128, num_warps=8, num_stages=2),
            dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2)]


def attention_bob(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, params, row_atomics=False,
                  fold=False, dq=None, keys_out=None, gdmask=None, gmask=None):
    """S > 0 and at least one of gdq/gdk/gdv (or gdmask) given. Chain form: (gq, gk, gv, go,
    glse, gdo, gdlse); folded (fold=True, two passes: row, then column): (gq, gk, gv, gdo,
    gdlse), where dq, if given, is backward(q, k, v, o, lse, do, dlse)'s (the folded row pass
    reads R from it) and keys_out, if given, is B = forward(q, k, k)'s o (read instead of
    accumulated). A learned bias (folded form only): gdmask, the cotangent of its cotangent
    (shaped like params.mask with 1 on its broadcast dims), adds to F; gmask, a buffer of that
    shape in fp32, receives the bias's cotangent Sbar. With params.softcap the row pass
    accumulates B = (phi'(U) P) k itself: keys_out must be None."""
    assert not (fold and row_atomics), "the folded form needs the row pass's scalars first"
    assert fold or (gdmask is None and gmask is None), "a learned bias takes the folded form"
    capped, softcap = softcap_arguments(params)
    relative = has_relative_bias(params)
    if capped and keys_out is not None:
        raise ValueError("attention_bob: keys_out with a softcap: the folded row pass's B is "
                         "then (phi'(U) P) k, not forward(q, k, k)'s o; pass keys_out=None")
    scale, causal = params.scale, params.causal
    B, Hq, L, E = q.shape
    Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    dev = q.device
    lse = lse.contiguous()
    d = row_dot(do, o, dlse)
    # contiguous outputs, each shaped like an input (empty_like: half the host time of empty)
    dense = torch.contiguous_format
    gq, gk, gv, gdo, gdlse = (torch.empty_like(t, memory_format=dense)
                              for t in (q, k, v, do, lse))
    if fold:
        go = glse = None
        row_e = torch.empty_like(lse, dtype=torch.float32, memory_format=dense)
    else:
        go, glse = torch.empty_like(o, memory_format=dense), torch.empty_like(lse,
                                                                              memory_format=dense)
        row_e = d       # never read without FOLD
    has_gdq, has_gdk, has_gdv = gdq is not None, gdk is not None, gdv is not None
    # a missing cotangent is never read (constexpr flag); any tensor stands in for the pointer
    gdq_arg = gdq if has_gdq else q
    gdk_arg = gdk if has_gdk else k
    gdv_arg = gdv if has_gdv else v
    has_dlse = fold and dlse is not None
    dlse_arg = dlse.contiguous() if has_dlse else d
    has_dq = fold and dq is not None and (has_gdq or has_gdk)
    dq_arg = dq if has_dq else q
    has_b = fold and keys_out is not None
    keys_out_arg = keys_out if has_b else q
    mask_kind, mask, key_range = mask_kind_and_tensor(params, q, reuse=True)
    paths = mask_paths(mask_kind)
    dropout, seed, drop_threshold, keep_scale = dropout_arguments(params, lse)
    # a learned bias's tensors as (B, Hq, L, S) views, broadcast dims at stride 0
    has_gdm, has_gm = gdmask is not None, gmask is not None
    gdm_arg = gdmask.expand(B, Hq, L, S) if has_gdm else q
    gm_arg = gmask.expand(B, Hq, L, S) if has_gm else q

    def flag_key(path):
        return (int(has_gdq), int(has_gdk), int(has_gdv), *mask_flags(mask_kind, path),
                int(fold), *dropout_flags(dropout), *softcap_flags(capped),
                *relative_flags(relative)) \
            + (("gdmask",) if has_gdm else ())

    def common(path):
        return dict(HEAD_DIM=E, HEAD_DIM_V=Ev, BLOCK_E=padded_dim(E), BLOCK_EV=padded_dim(Ev),
                    CAUSAL=causal, MASK_KIND=mask_kind, MASK_PATH=path,
                    DOT_PRECISION=dot_precision(q.dtype), HAS_GDQ=has_gdq, HAS_GDK=has_gdk,
                    HAS_GDV=has_gdv, FOLD=fold, DROPOUT=dropout, HAS_GDM=has_gdm,
                    SOFTCAP=capped, RELATIVE=relative)

    def launch_rows(plan):
        plan(_row_kernel, (blocks(L, plan.kwargs["BLOCK_M"]), B * Hq),
             Q=q, K=k, V=v, O=o, DO=do, LSE=lse, D=d, DLSE=dlse_arg, GDQ=gdq_arg, GDK=gdk_arg,
             GDV=gdv_arg, DQ=dq_arg, KEYS_OUT=keys_out_arg, GQ=gq, GO=gq if fold else go,
             GDO=gdo, GLSE=row_e if fold else glse, GDLSE=gdlse, ROW_E=row_e, MASK=mask,
             KEY_RANGE=key_range, SEED=seed, GDM=gdm_arg, num_q_heads=Hq, kv_group=Hq // Hkv, L=L, S=S,
             drop_threshold=drop_threshold, qk_scale_log2=scale * LOG2E, scale=scale,
             keep_scale=keep_scale, softcap=softcap)

    # gq's score cotangent as two half-precision GEMMs (BOB_COMPILE_DEV_SBAR_SPLIT); the tuning
    # key grows a flag for each split compiled in, so that the keys of a kernel without
    # them stay as they were
    switches = settings.current()
    split = switches.sbar_split and q.dtype != torch.float32
    # the masked tiles' (the causal diagonal's, a mask's edges') half-precision roundings of
    # Sbar, dS, P and A as two GEMMs each (BOB_COMPILE_DEV_EDGE_SPLIT, default on): the first
    # rows of a causal call see few keys, with large probabilities, and carry much of gq's
    # and gdo's rounding error (docs/measurements.md, "Split roundings on the diagonal");
    # all their keys lie in the diagonal's tiles. Without a mask or causality the masked
    # tiles are a ragged end only: the kernel stays as it was.
    edges = (switches.edge_split and q.dtype != torch.float32
             and (causal or mask_kind != 0))

    def run_rows():
        for path in paths:
            launch_rows(launch_plan(
                "bob_rows", q, k, v, causal,
                (*flag_key(path), int(has_dlse), int(has_dq), int(has_b))
                + ((1,) if split else ()) + (("edge_split",) if edges else ()),
                lambda: row_candidates(q.dtype, E, Ev, fold and not has_b, reads_dq=has_dq,
                                       read=path == READ_PATH, masked=mask_kind != NO_MASK,
                                       dropout=dropout, softcap=capped),
                lambda: dict(common(path), HAS_DLSE=has_dlse, HAS_DQ=has_dq, HAS_B=has_b,
                             SPLIT_SBAR=split, SPLIT_EDGES=edges), launch_rows, L * S,
                has_work=mask_path_work(key_range, path)))

    if row_atomics:
        gq_acc = torch.empty((B, Hq, L, E), device=dev, dtype=torch.float32)
        gdo_acc = torch.empty((B, Hq, L, Ev), device=dev, dtype=torch.float32)
        dg_acc = torch.empty((B, Hq, L), device=dev, dtype=torch.float32)
        sbar_acc = torch.empty((B, Hq, L), device=dev, dtype=torch.float32)
    else:
        gq_acc = gdo_acc = dg_acc = sbar_acc = gq  # never touched without ROW_ATOMICS

    if fold:        # the column pass reads the row pass's alpha (gdlse) and E
        run_rows()
    def launch_columns(plan):
        plan(_column_kernel, (blocks(S, plan.kwargs["BLOCK_N"]), B * Hkv),
             Q=q, K=k, V=v, DO=do, LSE=lse, D=d, ALPHA=gdlse, ROW_E=row_e, GDQ=gdq_arg,
             GDK=gdk_arg, GDV=gdv_arg, GK=gk, GV=gv, GQ_ACC=gq_acc, GDO_ACC=gdo_acc,
             DG_ACC=dg_acc, SBAR_ACC=sbar_acc, MASK=mask, KEY_RANGE=key_range, SEED=seed,
             GDM=gdm_arg, GM=gm_arg,
             num_kv_heads=Hkv, kv_group=Hq // Hkv, L=L, S=S, drop_threshold=drop_threshold,
             qk_scale_log2=scale * LOG2E, scale=scale, keep_scale=keep_scale, softcap=softcap)

    # the plans first (tuning runs the kernels), then the launches: the atomic row sums add
    # into buffers zeroed once before them, a masked kernel's two launches included
    plans = [launch_plan(
        "bob_columns", q, k, v, causal,
        (row_atomics, *flag_key(path)) + (("gmask",) if has_gm else ()),
        lambda: column_candidates(q.dtype, E, Ev, row_atomics, read=path == READ_PATH,
                                  fold=fold, causal=causal and mask_kind == NO_MASK),
        lambda: dict(common(path), ROW_ATOMICS=row_atomics, HAS_GM=has_gm), launch_columns,
        L * S,
        has_work=mask_path_work(key_range, path, Hq // Hkv)) for path in paths]
    if row_atomics:
        for t in (gq_acc, gdo_acc, dg_acc, sbar_acc):
            t.zero_()
    if has_gm:      # after the plans: tuning runs the kernels
        gmask.zero_()
    for plan in plans:
        launch_columns(plan)
    if fold:
        return gq, gk, gv, gdo, gdlse

    if row_atomics:
        block_m = 16 if interpreting() else 64
        plan = fixed_plan(("bob_finish_rows", E, Ev, block_m), lambda: dict(
            HEAD_DIM=E, HEAD_DIM_V=Ev, BLOCK_E=padded_dim(E), BLOCK_EV=padded_dim(Ev),
            BLOCK_M=block_m, num_warps=4))
        plan(_finish_rows_kernel, (blocks(L, block_m), B * Hq),
             GQ_ACC=gq_acc, GDO_ACC=gdo_acc, DG_ACC=dg_acc, SBAR_ACC=sbar_acc, O=o, DO=do,
             GQ=gq, GO=go, GDO=gdo, GLSE=glse, GDLSE=gdlse, num_q_heads=Hq, L=L)
        return gq, gk, gv, go, glse, gdo, gdlse
    run_rows()
    return gq, gk, gv, go, glse, gdo, gdlse
