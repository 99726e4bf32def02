"""Forward-mode derivatives of attention in Triton: the JVP of the forward and of the backward.

With P = exp(scale q k^T - lse) from the saved lse (docs/second-order.md, forward mode):

JVP of the forward, along tangents tq, tk, tv of q, k, v (any may be None):
    tS = scale (tq k^T + q tk^T),   tlse = rowsum(P * tS),   to = (P * tS) v + P tv - tlse o

JVP of the backward (dq, dk, dv of triton_backward.py) along tangents of all seven inputs
(tq, tk, tv, to, tlse, tdo, tdlse; any may be None), D = rowsum(dO * o) - dlse:
    tD   = rowsum(tdO * o) + rowsum(dO * to) - tdlse
    dP'  = dO v^T - D,                       dS  = P * dP'
    tS'  = scale (tq k^T + q tk^T) - tlse,   tP  = P * tS'
    tdP' = tdO v^T + dO tv^T - tD,           tdS = tP * dP' + P * tdP'
    tdq = scale (tdS k + dS tk),   tdk = scale (tdS^T q + dS^T tq),   tdv = P^T tdO + tP^T dO

Kernels (one pass over the visible (query, key) pairs each, nothing of size L x S stored):
- `_forward_jvp_kernel`: one program per (query block, batch x head): to, tlse;
- `_tangent_row_dot_kernel`: tD per query row (row-local, like row_dot's D);
- `_backward_jvp_rows_kernel`: tdq, one program per query block;
- `_backward_jvp_columns_kernel`: tdk, tdv, one program per (key block, kv head), walking
  every query head of its GQA group, so the group sums are deterministic.
A missing tangent is a constexpr flag (HAS_*): its GEMMs are not compiled, and any tensor
stands in for its pointer. No mask tensor: masked calls take the blockwise path
(triton_attention.py).
"""
import torch
import triton
import triton.language as tl

from .layout import empty_like_order
from .triton_backward import load_lse2_for_probabilities, row_dot
from .launching import fixed_plan, launch_plan, strides_of
from .tiles import (LOG2E, blocks, column_block_program, dot_precision, key_blocks_of_row_block,
                    load_row_vector, load_tile, padded_dim, row_block_program,
                    row_blocks_of_key_block, store_tile, visibility_mask)
from .triton_dropout import dropout_arguments, dropout_flags, dropout_tile
from .tuning import interpreting, row_bytes, wide_candidates


# --------------------------------------------------------------------------------------
# JVP of the forward: to, tlse (query-block major)
# --------------------------------------------------------------------------------------
@triton.jit
def _forward_jvp_steps(acc, tlse, q, tq, lse2, k_base, v_base, tk_base, tv_base,
                       skn, ske, svn, sve, stkn, stke, stvn, stve,
                       offs_m, offs_e, offs_ev, n_lo, n_hi, S, qk_scale_log2, scale,
                       seed_ptr, head, L, m0, drop_threshold, keep_scale,
                       HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                       PAD_E: tl.constexpr, PAD_EV: tl.constexpr, HAS_TQ: tl.constexpr,
                       HAS_TK: tl.constexpr, HAS_TV: tl.constexpr, HAS_TS: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr):
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = load_tile(k_base, offs_n, offs_e, skn, ske, S, HEAD_DIM, MASKED, PAD_E)
        s2 = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
        if MASKED:
            s2 = tl.where(visibility_mask(offs_m, offs_n, S, CAUSAL, False), s2, float("-inf"))
        p = tl.math.exp2(s2 - lse2[:, None])
        p_v = p         # where P (and its tangent) meet V or tv: dropped
        if DROPOUT:
            z = dropout_tile(seed_ptr, head, L, m0, n0, S, drop_threshold, keep_scale, BLOCK_M,
                             BLOCK_N)
            p_v = p * z
        if HAS_TS:
            ts = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            if HAS_TQ:
                ts += tl.dot(tq, tl.trans(k), input_precision=DOT_PRECISION)
            if HAS_TK:
                tk = load_tile(tk_base, offs_n, offs_e, stkn, stke, S, HEAD_DIM, MASKED, PAD_E)
                ts += tl.dot(q, tl.trans(tk), input_precision=DOT_PRECISION)
            tlse += tl.sum(p * ts * scale, 1)
            v = load_tile(v_base, offs_n, offs_ev, svn, sve, S, HEAD_DIM_V, MASKED, PAD_EV)
            acc += tl.dot((p_v * ts * scale).to(v.dtype), v, input_precision=DOT_PRECISION)
        if HAS_TV:
            tv = load_tile(tv_base, offs_n, offs_ev, stvn, stve, S, HEAD_DIM_V, MASKED, PAD_EV)
            acc += tl.dot(p_v.to(tv.dtype), tv, input_precision=DOT_PRECISION)
    return acc, tlse


@triton.jit
def _forward_jvp_kernel(Q, K, V, O, LSE, TQ, TK, TV, TO, TLSE, SEED,
                        sqb, sqh, sql, sqe, skb, skh, skn, ske, svb, svh, svn, sve,
                        sob, soh, sol, soe, stqb, stqh, stql, stqe, stkb, stkh, stkn, stke,
                        stvb, stvh, stvn, stve, stob, stoh, stol, stoe,
                        num_q_heads, kv_group, L, S, drop_threshold, qk_scale_log2, scale,
                        keep_scale,
                        HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                        HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr, HAS_TV: tl.constexpr,
                        HAS_TS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        DROPOUT: tl.constexpr):
    PAD_E: tl.constexpr = BLOCK_E != HEAD_DIM
    PAD_EV: tl.constexpr = BLOCK_EV != HEAD_DIM_V
    b, h, hk, m0, offs_m, offs_e, offs_ev, row = row_block_program(
        num_q_heads, kv_group, L, BLOCK_M, BLOCK_E, BLOCK_EV, CAUSAL)
    head = b * num_q_heads + h
    q = load_tile(Q + b * sqb + h * sqh, offs_m, offs_e, sql, sqe, L, HEAD_DIM, True, PAD_E)
    tq = q
    if HAS_TQ:
        tq = load_tile(TQ + b * stqb + h * stqh, offs_m, offs_e, stql, stqe, L, HEAD_DIM, True,
                       PAD_E)
    lse2 = load_lse2_for_probabilities(LSE + row, offs_m, L)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    tk_base = TK + b * stkb + hk * stkh
    tv_base = TV + b * stvb + hk * stvh
    acc = tl.zeros([BLOCK_M, BLOCK_EV], tl.float32)
    tlse = tl.zeros([BLOCK_M], tl.float32)
    full_end, visible_end = key_blocks_of_row_block(m0, S, BLOCK_M, BLOCK_N, CAUSAL)
    acc, tlse = _forward_jvp_steps(
        acc, tlse, q, tq, lse2, k_base, v_base, tk_base, tv_base, skn, ske, svn, sve,
        stkn, stke, stvn, stve, offs_m, offs_e, offs_ev, 0, full_end, S, qk_scale_log2, scale,
        SEED, head, L, m0, drop_threshold, keep_scale,
        HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, False, CAUSAL, PAD_E, PAD_EV, HAS_TQ, HAS_TK,
        HAS_TV, HAS_TS, DOT_PRECISION, DROPOUT)
    acc, tlse = _forward_jvp_steps(
        acc, tlse, q, tq, lse2, k_base, v_base, tk_base, tv_base, skn, ske, svn, sve,
        stkn, stke, stvn, stve, offs_m, offs_e, offs_ev, full_end, visible_end, S,
        qk_scale_log2, scale, SEED, head, L, m0, drop_threshold, keep_scale, HEAD_DIM, HEAD_DIM_V,
        BLOCK_M, BLOCK_N, True, CAUSAL, PAD_E, PAD_EV, HAS_TQ, HAS_TK, HAS_TV, HAS_TS,
        DOT_PRECISION, DROPOUT)
    o = load_tile(O + b * sob + h * soh, offs_m, offs_ev, sol, soe, L, HEAD_DIM_V, True, PAD_EV)
    to = acc - tlse[:, None] * o.to(tl.float32)
    store_tile(TO + b * stob + h * stoh, to.to(TO.dtype.element_ty), offs_m, offs_ev, stol,
               stoe, L, HEAD_DIM_V, PAD_EV)
    tl.store(TLSE + row + offs_m, tlse, mask=offs_m < L)


strides_of(_forward_jvp_kernel, Q="sq", K="sk", V="sv", O="so", TQ="stq", TK="stk", TV="stv",
           TO="sto")


# --------------------------------------------------------------------------------------
# tD = rowsum(tdO * o) + rowsum(dO * to) - tdlse
# --------------------------------------------------------------------------------------
@triton.jit
def _tangent_row_dot_kernel(O, DO, TO, TDO, TDLSE, TD, sob, soh, sol, soe, sdb, sdh, sdl, sde,
                            stob, stoh, stol, stoe, stdb, stdh, stdl, stde, num_q_heads, L,
                            HEAD_DIM_V: tl.constexpr, BLOCK_EV: tl.constexpr,
                            BLOCK_M: tl.constexpr, HAS_TO: tl.constexpr,
                            HAS_TDO: tl.constexpr, HAS_TDLSE: tl.constexpr):
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_q_heads).to(tl.int64)
    h = (pid_bh % num_q_heads).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_ev = tl.arange(0, BLOCK_EV)
    PAD_EV: tl.constexpr = BLOCK_EV != HEAD_DIM_V
    td = tl.zeros([BLOCK_M], tl.float32)
    if HAS_TDO:
        o = load_tile(O + b * sob + h * soh, offs_m, offs_ev, sol, soe, L, HEAD_DIM_V, True,
                      PAD_EV)
        tdo = load_tile(TDO + b * stdb + h * stdh, offs_m, offs_ev, stdl, stde, L, HEAD_DIM_V,
                        True, PAD_EV)
        td += tl.sum(tdo.to(tl.float32) * o.to(tl.float32), 1)
    if HAS_TO:
        do = load_tile(DO + b * sdb + h * sdh, offs_m, offs_ev, sdl, sde, L, HEAD_DIM_V, True,
                       PAD_EV)
        to = load_tile(TO + b * stob + h * stoh, offs_m, offs_ev, stol, stoe, L, HEAD_DIM_V,
                       True, PAD_EV)
        td += tl.sum(do.to(tl.float32) * to.to(tl.float32), 1)
    row = pid_bh.to(tl.int64) * L
    if HAS_TDLSE:
        td -= load_row_vector(TDLSE + row, offs_m, L).to(tl.float32)
    tl.store(TD + row + offs_m, td, mask=offs_m < L)


strides_of(_tangent_row_dot_kernel, O="so", DO="sd", TO="sto", TDO="std")


# --------------------------------------------------------------------------------------
# JVP of the backward: tdq (query-block major)
# --------------------------------------------------------------------------------------
@triton.jit
def _backward_jvp_row_steps(tdq, q, do, tq, tdo, lse2, d, td, tlse, k_base, v_base, tk_base,
                            tv_base, skn, ske, svn, sve, stkn, stke, stvn, stve,
                            offs_m, offs_e, offs_ev, n_lo, n_hi, S, qk_scale_log2, scale,
                            seed_ptr, head, L, m0, drop_threshold, keep_scale,
                            HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            MASKED: tl.constexpr, CAUSAL: tl.constexpr, PAD_E: tl.constexpr,
                            PAD_EV: tl.constexpr, HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr,
                            HAS_TV: tl.constexpr, HAS_TLSE: tl.constexpr,
                            HAS_TDO: tl.constexpr, DOT_PRECISION: tl.constexpr,
                            DROPOUT: tl.constexpr):
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = load_tile(k_base, offs_n, offs_e, skn, ske, S, HEAD_DIM, MASKED, PAD_E)
        v = load_tile(v_base, offs_n, offs_ev, svn, sve, S, HEAD_DIM_V, MASKED, PAD_EV)
        s2 = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
        if MASKED:
            s2 = tl.where(visibility_mask(offs_m, offs_n, S, CAUSAL, False), s2, float("-inf"))
        p = tl.math.exp2(s2 - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if DROPOUT:     # Z on dP = dO Vᵀ and its tangent (dropout.py)
            z = dropout_tile(seed_ptr, head, L, m0, n0, S, drop_threshold, keep_scale, BLOCK_M,
                             BLOCK_N)
            dp = dp * z
        dps = dp - d[:, None]
        # tangent of the scores minus that of lse, and of dP - D
        ts = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if HAS_TQ:
            ts += tl.dot(tq, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if HAS_TK:
            tk = load_tile(tk_base, offs_n, offs_e, stkn, stke, S, HEAD_DIM, MASKED, PAD_E)
            ts += tl.dot(q, tl.trans(tk), input_precision=DOT_PRECISION) * scale
        if HAS_TLSE:
            ts -= tlse[:, None]
        tdp = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if HAS_TDO:
            tdp += tl.dot(tdo, tl.trans(v), input_precision=DOT_PRECISION)
        if HAS_TV:
            tv = load_tile(tv_base, offs_n, offs_ev, stvn, stve, S, HEAD_DIM_V, MASKED, PAD_EV)
            tdp += tl.dot(do, tl.trans(tv), input_precision=DOT_PRECISION)
        if DROPOUT:
            tdp = tdp * z
        tdp -= td[:, None]
        tds = p * (ts * dps + tdp)
        tdq += tl.dot(tds.to(k.dtype), k, input_precision=DOT_PRECISION)
        if HAS_TK:
            ds = p * dps
            tdq += tl.dot(ds.to(tk.dtype), tk, input_precision=DOT_PRECISION)
    return tdq


@triton.jit
def _backward_jvp_rows_kernel(Q, K, V, DO, LSE, D, TD, TQ, TK, TV, TLSE, TDO, TDQ, SEED,
                              sqb, sqh, sql, sqe, skb, skh, skn, ske, svb, svh, svn, sve,
                              sdb, sdh, sdl, sde, stqb, stqh, stql, stqe,
                              stkb, stkh, stkn, stke, stvb, stvh, stvn, stve,
                              stdb, stdh, stdl, stde, stgb, stgh, stgl, stge,
                              num_q_heads, kv_group, L, S, drop_threshold, qk_scale_log2, scale,
                              keep_scale,
                              HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                              BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              CAUSAL: tl.constexpr, HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr,
                              HAS_TV: tl.constexpr, HAS_TLSE: tl.constexpr,
                              HAS_TDO: tl.constexpr, DOT_PRECISION: tl.constexpr,
                              DROPOUT: tl.constexpr):
    PAD_E: tl.constexpr = BLOCK_E != HEAD_DIM
    PAD_EV: tl.constexpr = BLOCK_EV != HEAD_DIM_V
    b, h, hk, m0, offs_m, offs_e, offs_ev, row = row_block_program(
        num_q_heads, kv_group, L, BLOCK_M, BLOCK_E, BLOCK_EV, CAUSAL)
    head = b * num_q_heads + h
    q = load_tile(Q + b * sqb + h * sqh, offs_m, offs_e, sql, sqe, L, HEAD_DIM, True, PAD_E)
    do = load_tile(DO + b * sdb + h * sdh, offs_m, offs_ev, sdl, sde, L, HEAD_DIM_V, True, PAD_EV)
    tq, tdo, tlse = q, do, load_row_vector(D + row, offs_m, L)    # stand-ins, never read
    if HAS_TQ:
        tq = load_tile(TQ + b * stqb + h * stqh, offs_m, offs_e, stql, stqe, L, HEAD_DIM, True,
                       PAD_E)
    if HAS_TDO:
        tdo = load_tile(TDO + b * stdb + h * stdh, offs_m, offs_ev, stdl, stde, L, HEAD_DIM_V,
                        True, PAD_EV)
    if HAS_TLSE:
        tlse = load_row_vector(TLSE + row, offs_m, L)
    lse2 = load_lse2_for_probabilities(LSE + row, offs_m, L)
    d = load_row_vector(D + row, offs_m, L)
    td = load_row_vector(TD + row, offs_m, L)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    tk_base = TK + b * stkb + hk * stkh
    tv_base = TV + b * stvb + hk * stvh
    tdq = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    full_end, visible_end = key_blocks_of_row_block(m0, S, BLOCK_M, BLOCK_N, CAUSAL)
    tdq = _backward_jvp_row_steps(
        tdq, q, do, tq, tdo, lse2, d, td, tlse, k_base, v_base, tk_base, tv_base,
        skn, ske, svn, sve, stkn, stke, stvn, stve, offs_m, offs_e, offs_ev, 0, full_end, S,
        qk_scale_log2, scale, SEED, head, L, m0, drop_threshold, keep_scale, HEAD_DIM, HEAD_DIM_V,
        BLOCK_M, BLOCK_N, False, CAUSAL, PAD_E, PAD_EV, HAS_TQ, HAS_TK, HAS_TV, HAS_TLSE,
        HAS_TDO, DOT_PRECISION, DROPOUT)
    tdq = _backward_jvp_row_steps(
        tdq, q, do, tq, tdo, lse2, d, td, tlse, k_base, v_base, tk_base, tv_base,
        skn, ske, svn, sve, stkn, stke, stvn, stve, offs_m, offs_e, offs_ev, full_end,
        visible_end, S, qk_scale_log2, scale, SEED, head, L, m0, drop_threshold, keep_scale,
        HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, True, CAUSAL, PAD_E, PAD_EV, HAS_TQ, HAS_TK, HAS_TV,
        HAS_TLSE, HAS_TDO, DOT_PRECISION, DROPOUT)
    store_tile(TDQ + b * stgb + h * stgh, (tdq * scale).to(TDQ.dtype.element_ty), offs_m,
               offs_e, stgl, stge, L, HEAD_DIM, PAD_E)


strides_of(_backward_jvp_rows_kernel, Q="sq", K="sk", V="sv", DO="sd", TQ="stq", TK="stk",
           TV="stv", TDO="std", TDQ="stg")


# --------------------------------------------------------------------------------------
# JVP of the backward: tdk, tdv (key-block major, transposed tiles [keys, queries])
# --------------------------------------------------------------------------------------
@triton.jit
def _backward_jvp_column_steps(tdk, tdv, k, v, tk, tv, q_base, do_base, tq_base, tdo_base,
                               lse_ptr, d_ptr, td_ptr, tlse_ptr, sql, sqe, sdl, sde, stql,
                               stqe, stdl, stde, m_lo, m_hi, n0, L, S, qk_scale_log2, scale,
                               seed_ptr, head, drop_threshold, keep_scale,
                               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                               BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                               HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr, HAS_TV: tl.constexpr,
                               HAS_TLSE: tl.constexpr, HAS_TDO: tl.constexpr,
                               DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr):
    PAD_E: tl.constexpr = BLOCK_E != HEAD_DIM
    PAD_EV: tl.constexpr = BLOCK_EV != HEAD_DIM_V
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    for m0 in range(m_lo, m_hi, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        q = load_tile(q_base, offs_m, offs_e, sql, sqe, L, HEAD_DIM, True, PAD_E)
        do = load_tile(do_base, offs_m, offs_ev, sdl, sde, L, HEAD_DIM_V, True, PAD_EV)
        lse2 = load_lse2_for_probabilities(lse_ptr, offs_m, L)
        d = load_row_vector(d_ptr, offs_m, L)
        td = load_row_vector(td_ptr, offs_m, L)
        s2t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale_log2
        if MASKED:
            s2t = tl.where(visibility_mask(offs_m, offs_n, S, CAUSAL, True), s2t, float("-inf"))
        pt = tl.math.exp2(s2t - lse2[None, :])
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        pt_v = pt       # where P and its tangent meet dO or tdO: dropped
        if DROPOUT:     # Z on dP, its tangent, and where P meets dO (dropout.py)
            zt = tl.trans(dropout_tile(seed_ptr, head, L, m0, n0, S, drop_threshold,
                                       keep_scale, BLOCK_M, BLOCK_N))
            dpt = dpt * zt
            pt_v = pt * zt
        dpst = dpt - d[None, :]
        tst = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        if HAS_TQ:
            tq = load_tile(tq_base, offs_m, offs_e, stql, stqe, L, HEAD_DIM, True, PAD_E)
            tst += tl.dot(k, tl.trans(tq), input_precision=DOT_PRECISION) * scale
        if HAS_TK:
            tst += tl.dot(tk, tl.trans(q), input_precision=DOT_PRECISION) * scale
        if HAS_TLSE:
            tst -= load_row_vector(tlse_ptr, offs_m, L)[None, :]
        tdpt = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        if HAS_TDO:
            tdo = load_tile(tdo_base, offs_m, offs_ev, stdl, stde, L, HEAD_DIM_V, True, PAD_EV)
            tdpt += tl.dot(v, tl.trans(tdo), input_precision=DOT_PRECISION)
        if HAS_TV:
            tdpt += tl.dot(tv, tl.trans(do), input_precision=DOT_PRECISION)
        if DROPOUT:
            tdpt = tdpt * zt
        tdpt -= td[None, :]
        tdst = pt * tst * dpst + pt * tdpt
        tdk += tl.dot(tdst.to(q.dtype), q, input_precision=DOT_PRECISION)
        tdv += tl.dot((pt_v * tst).to(do.dtype), do, input_precision=DOT_PRECISION)
        if HAS_TQ:
            dst = pt * dpst
            tdk += tl.dot(dst.to(tq.dtype), tq, input_precision=DOT_PRECISION)
        if HAS_TDO:
            tdv += tl.dot(pt_v.to(tdo.dtype), tdo, input_precision=DOT_PRECISION)
    return tdk, tdv


@triton.jit
def _backward_jvp_columns_kernel(Q, K, V, DO, LSE, D, TD, TQ, TK, TV, TLSE, TDO, TDK, TDV,
                                 SEED,
                                 sqb, sqh, sql, sqe, skb, skh, skn, ske, svb, svh, svn, sve,
                                 sdb, sdh, sdl, sde, stqb, stqh, stql, stqe,
                                 stkb, stkh, stkn, stke, stvb, stvh, stvn, stve,
                                 stdb, stdh, stdl, stde, sgkb, sgkh, sgkn, sgke,
                                 sgvb, sgvh, sgvn, sgve,
                                 num_kv_heads, kv_group, L, S, drop_threshold, qk_scale_log2,
                                 scale, keep_scale,
                                 HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                                 BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 CAUSAL: tl.constexpr, HAS_TQ: tl.constexpr,
                                 HAS_TK: tl.constexpr, HAS_TV: tl.constexpr,
                                 HAS_TLSE: tl.constexpr, HAS_TDO: tl.constexpr,
                                 DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr):
    PAD_E: tl.constexpr = BLOCK_E != HEAD_DIM
    PAD_EV: tl.constexpr = BLOCK_EV != HEAD_DIM_V
    b, hk, n0, offs_n, offs_e, offs_ev = column_block_program(num_kv_heads, BLOCK_N, BLOCK_E,
                                                              BLOCK_EV)
    k = load_tile(K + b * skb + hk * skh, offs_n, offs_e, skn, ske, S, HEAD_DIM, True, PAD_E)
    v = load_tile(V + b * svb + hk * svh, offs_n, offs_ev, svn, sve, S, HEAD_DIM_V, True, PAD_EV)
    tk, tv = k, v                                            # stand-ins, never read
    if HAS_TK:
        tk = load_tile(TK + b * stkb + hk * stkh, offs_n, offs_e, stkn, stke, S, HEAD_DIM, True,
                       PAD_E)
    if HAS_TV:
        tv = load_tile(TV + b * stvb + hk * stvh, offs_n, offs_ev, stvn, stve, S, HEAD_DIM_V,
                       True, PAD_EV)
    tdk = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    tdv = tl.zeros([BLOCK_N, BLOCK_EV], tl.float32)
    m_first, m_unmasked = row_blocks_of_key_block(n0, L, BLOCK_M, BLOCK_N, CAUSAL)
    num_q_heads = num_kv_heads * kv_group
    for g in range(0, kv_group):
        h = hk * kv_group + g
        head = b * num_q_heads + h
        row = head * L
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdb + h * sdh
        tq_base = TQ + b * stqb + h * stqh
        tdo_base = TDO + b * stdb + h * stdh
        tdk, tdv = _backward_jvp_column_steps(
            tdk, tdv, k, v, tk, tv, q_base, do_base, tq_base, tdo_base, LSE + row, D + row,
            TD + row, TLSE + row, sql, sqe, sdl, sde, stql, stqe, stdl, stde, m_first,
            m_unmasked, n0, L, S, qk_scale_log2, scale, SEED, head, drop_threshold, keep_scale,
            HEAD_DIM, HEAD_DIM_V, BLOCK_E, BLOCK_EV, BLOCK_M, BLOCK_N, True, CAUSAL, HAS_TQ,
            HAS_TK, HAS_TV, HAS_TLSE, HAS_TDO, DOT_PRECISION, DROPOUT)
        tdk, tdv = _backward_jvp_column_steps(
            tdk, tdv, k, v, tk, tv, q_base, do_base, tq_base, tdo_base, LSE + row, D + row,
            TD + row, TLSE + row, sql, sqe, sdl, sde, stql, stqe, stdl, stde, m_unmasked, L,
            n0, L, S, qk_scale_log2, scale, SEED, head, drop_threshold, keep_scale, HEAD_DIM,
            HEAD_DIM_V, BLOCK_E, BLOCK_EV, BLOCK_M, BLOCK_N, False, CAUSAL, HAS_TQ, HAS_TK,
            HAS_TV, HAS_TLSE, HAS_TDO, DOT_PRECISION, DROPOUT)
    store_tile(TDK + b * sgkb + hk * sgkh, (tdk * scale).to(TDK.dtype.element_ty), offs_n,
               offs_e, sgkn, sgke, S, HEAD_DIM, PAD_E)
    store_tile(TDV + b * sgvb + hk * sgvh, tdv.to(TDV.dtype.element_ty), offs_n, offs_ev,
               sgvn, sgve, S, HEAD_DIM_V, PAD_EV)


strides_of(_backward_jvp_columns_kernel, Q="sq", K="sk", V="sv", DO="sd", TQ="stq", TK="stk",
           TV="stv", TDO="std", TDK="sgk", TDV="sgv")


# --------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------
# Launch configs, the measured best first (the choice without tuning), in half precision:
# `narrow` for heads up to 64 wide, `wide` for 65-128. Each kernel's configs forced one at
# a time through the forward-over-reverse step on the H200 at 16K causal, kernel time from
# the profiler (docs/measurements.md, "Forward over reverse" and "Forward-mode kernels at
# d = 128"). At d <= 64 three pipeline stages win for all three kernels, and the column
# pass gains most from 128-key blocks with 8 warps. At d = 128, 128-row blocks with 8 warps
# win the row kernels and 32 x 128 with 8 warps the column pass, 3.3-4x faster than the
# small single-stage tiles used before (with 4 warps it is 5x slower). Where two were
# within 1 %, the one that also fits an A100's 163 KiB of shared memory comes first.
def _candidates(dtype, head_dim, head_dim_v, column, interpreter_tile, narrow, wide):
    if interpreting():
        return [dict(BLOCK_M=interpreter_tile[0], BLOCK_N=interpreter_tile[1], num_warps=4,
                     num_stages=1)]
    nbytes = row_bytes(dtype, head_dim, head_dim_v)
    if nbytes <= 128:
        measured = narrow
    elif nbytes <= 256 and dtype.itemsize == 2:
        measured = wide
    else:   # fp32 inputs, or heads above 128: operand tiles about twice the backward's
        return wide_candidates(nbytes * 2, column=column)
    return [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s) for m, n, w, s in measured]


def forward_jvp_candidates(dtype, head_dim, head_dim_v):
    return _candidates(dtype, head_dim, head_dim_v, False, (16, 16),
                       narrow=[(64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 8, 3)],
                       wide=[(128, 64, 8, 2), (128, 32, 8, 3), (64, 32, 4, 2)])


def backward_jvp_row_candidates(dtype, head_dim, head_dim_v):
    return _candidates(dtype, head_dim, head_dim_v, False, (16, 16),
                       narrow=[(128, 64, 8, 3), (64, 64, 4, 2), (64, 32, 4, 2)],
                       wide=[(128, 32, 8, 3), (128, 64, 8, 2), (64, 32, 4, 2)])


def backward_jvp_column_candidates(dtype, head_dim, head_dim_v):
    return _candidates(dtype, head_dim, head_dim_v, True, (16, 32),
                       narrow=[(64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3)],
                       wide=[(32, 128, 8, 3), (32, 128, 8, 2), (32, 64, 4, 2)])


def _flag_key(flags):
    """A launch plan's flags: the HAS_* flags as they were (their tuning keys unchanged),
    then dropout's."""
    return (*(int(v) for k, v in flags.items() if k != "DROPOUT"),
            *dropout_flags(flags["DROPOUT"]))


def _constexprs(q, v, causal, **flags):
    E, Ev = q.shape[3], v.shape[3]
    return dict(HEAD_DIM=E, HEAD_DIM_V=Ev, BLOCK_E=padded_dim(E), BLOCK_EV=padded_dim(Ev),
                CAUSAL=causal, DOT_PRECISION=dot_precision(q.dtype), **flags)


def attention_forward_jvp(q, k, v, o, lse, tq, tk, tv, params):
    """(to, tlse): to laid out like o in o's dtype, tlse float32 (B, Hq, L). S, L > 0, no
    mask."""
    scale, causal = params.scale, params.causal
    B, Hq, L, E = q.shape
    Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    lse = lse.contiguous()
    to = empty_like_order(o.shape, o)
    tlse = torch.empty((B, Hq, L), device=q.device, dtype=torch.float32)
    dropout, seed, drop_threshold, keep_scale = dropout_arguments(params, lse)
    flags = dict(HAS_TQ=tq is not None, HAS_TK=tk is not None, HAS_TV=tv is not None,
                 HAS_TS=tq is not None or tk is not None,   # the scores have a tangent
                 DROPOUT=dropout)

    def launch(plan):
        plan(_forward_jvp_kernel, (blocks(L, plan.kwargs["BLOCK_M"]), B * Hq),
             Q=q, K=k, V=v, O=o, LSE=lse, TQ=q if tq is None else tq, TK=k if tk is None else tk,
             TV=v if tv is None else tv, TO=to, TLSE=tlse, SEED=seed, num_q_heads=Hq,
             kv_group=Hq // Hkv, L=L, S=S, drop_threshold=drop_threshold,
             qk_scale_log2=scale * LOG2E, scale=scale, keep_scale=keep_scale)

    launch(launch_plan(
        "forward_jvp", q, k, v, causal, _flag_key(flags),
        lambda: forward_jvp_candidates(q.dtype, E, Ev),
        lambda: _constexprs(q, v, causal, **flags), launch, pairs=L * S))
    return to, tlse


def tangent_row_dot(o, do, to, tdo, tdlse):
    """tD (float32, (B, H, L)) = rowsum(tdo * o) + rowsum(do * to) - tdlse; None terms are 0."""
    B, H, L, Ev = o.shape
    td = torch.empty((B, H, L), device=o.device, dtype=torch.float32)
    block_m = 16 if interpreting() else 64
    flags = dict(HAS_TO=to is not None, HAS_TDO=tdo is not None, HAS_TDLSE=tdlse is not None)
    plan = fixed_plan(("tangent_row_dot", Ev, block_m, *flags.values()), lambda: dict(
        HEAD_DIM_V=Ev, BLOCK_EV=padded_dim(Ev), BLOCK_M=block_m, **flags, num_warps=4))
    plan(_tangent_row_dot_kernel, (blocks(L, block_m), B * H),
         O=o, DO=do, TO=o if to is None else to, TDO=o if tdo is None else tdo,
         TDLSE=td if tdlse is None else tdlse.contiguous(), TD=td, num_q_heads=H, L=L)
    return td


def attention_backward_jvp(q, k, v, o, lse, do, dlse, tq, tk, tv, to, tlse, tdo, tdlse,
                           params):
    """(tdq, tdk, tdv), laid out like q, k, v in their dtypes. S, L > 0, no mask."""
    scale, causal = params.scale, params.causal
    B, Hq, L, E = q.shape
    Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    lse = lse.contiguous()
    d = row_dot(do, o, dlse)
    td = tangent_row_dot(o, do, to, tdo, tdlse)
    tdq = empty_like_order(q.shape, q)
    tdk = empty_like_order(k.shape, k)
    tdv = empty_like_order(v.shape, v)
    dropout, seed, drop_threshold, keep_scale = dropout_arguments(params, lse)
    flags = dict(HAS_TQ=tq is not None, HAS_TK=tk is not None, HAS_TV=tv is not None,
                 HAS_TLSE=tlse is not None, HAS_TDO=tdo is not None, DROPOUT=dropout)
    tensors = dict(Q=q, K=k, V=v, DO=do, LSE=lse, D=d, TD=td, TQ=q if tq is None else tq,
                   TK=k if tk is None else tk, TV=v if tv is None else tv,
                   TLSE=d if tlse is None else tlse.contiguous(), TDO=do if tdo is None else tdo,
                   SEED=seed)
    scalars = dict(L=L, S=S, drop_threshold=drop_threshold, qk_scale_log2=scale * LOG2E,
                   scale=scale, keep_scale=keep_scale)
    flag_key = _flag_key(flags)

    def launch_rows(plan):
        plan(_backward_jvp_rows_kernel, (blocks(L, plan.kwargs["BLOCK_M"]), B * Hq),
             **tensors, TDQ=tdq, num_q_heads=Hq, kv_group=Hq // Hkv, **scalars)

    def launch_columns(plan):
        plan(_backward_jvp_columns_kernel, (blocks(S, plan.kwargs["BLOCK_N"]), B * Hkv),
             **tensors, TDK=tdk, TDV=tdv, num_kv_heads=Hkv, kv_group=Hq // Hkv, **scalars)

    launch_rows(launch_plan(
        "backward_jvp_rows", q, k, v, causal, flag_key,
        lambda: backward_jvp_row_candidates(q.dtype, E, Ev),
        lambda: _constexprs(q, v, causal, **flags), launch_rows, pairs=L * S))
    launch_columns(launch_plan(
        "backward_jvp_columns", q, k, v, causal, flag_key,
        lambda: backward_jvp_column_candidates(q.dtype, E, Ev),
        lambda: _constexprs(q, v, causal, **flags),
        launch_columns, pairs=L * S))
    return tdq, tdk, tdv
