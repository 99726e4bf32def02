"""Attention backward in Triton (FA2 math), with an incoming lse cotangent.

    P = exp(scale q k^T - lse),  dP = dO v^T,  D = rowsum(dO * O) - dlse,  dS = P * (dP - D)
    dq = scale dS k,  dk = scale dS^T q,  dv = P^T dO

With SOFTCAP the scores are T = c tanh(U / c) of U = scale q k^T (triton_softcap.py): P is
exp(T - lse), dS above is T's cotangent dT (a learned bias's too), and where it meets k or q
it is U's, dU = φ'(U) dT.

Kernels:
- `_row_dot_kernel`: D per query row (a row-local pre-pass; dlse is a constexpr option);
- `_column_kernel`: one program per (key block, kv head); it walks every query head of its
  GQA group and every visible query block, keeping dk, dv in registers, so the group sum is
  deterministic. With DQ_ATOMICS it also adds dq partials into an fp32 buffer (FA2's choice:
  5 GEMMs per tile instead of 7, at the price of run-to-run rounding differences);
- `_dq_kernel`: the deterministic alternative for dq, one program per query block.
"""
import torch
import triton
import triton.language as tl

from .layout import empty_like_order
from .launching import fixed_plan, launch_plan, read_path_first, strides_of
from .tiles import (INDICES_PATH, LOG2E, MASK_FROM_INDICES, MASK_READ, NO_MASK_SOURCE, READ_PATH,
                    add_relative_bias, add_score_tile, apply_mask_tile, blocks,
                    column_block_program, dot_precision, group_on_mask_path,
                    key_blocks_of_row_block, key_loops_within_mask, load_lse2, load_row_vector,
                    load_tile, on_mask_path, padded_dim, row_block_program, row_blocks_of_key_block,
                    row_loops_within_mask, store_tile, unmasked_key_blocks, unmasked_query_blocks,
                    visibility_mask)
from .tuning import interpreting, row_bytes, wide_candidates
from .triton_dropout import dropout_arguments, dropout_flags, dropout_tile
from .triton_softcap import base2_scores, capped_slope, softcap_arguments, softcap_flags
from .triton_masks import (has_relative_bias, mask_flags, mask_kind_and_tensor, mask_path_work,
                           mask_paths, relative_flags)


# --------------------------------------------------------------------------------------
# The saved lse, as every P = exp2(s2 - lse2) of the backward kernels reads it
# --------------------------------------------------------------------------------------
@triton.jit
def load_lse2_for_probabilities(lse_row_ptr, offs_m, L):
    """load_lse2, with 0 on rows that see no key (lse = -inf: every score -inf, from infinite
    inputs), whose P is then exp2(-inf) = 0 as in SDPA's math path, not exp2(-inf + inf) = NaN.
    A NaN lse stays NaN."""
    lse2 = load_lse2(lse_row_ptr, offs_m, L)
    return tl.where(lse2 == float("-inf"), 0.0, lse2)


# --------------------------------------------------------------------------------------
# D = rowsum(dO * O) - dlse
# --------------------------------------------------------------------------------------
@triton.jit
def _row_dot_kernel(DO, O, DLSE, D, sdb, sdh, sdl, sde, sob, soh, sol, soe,
                    num_q_heads, L, HEAD_DIM_V: tl.constexpr, BLOCK_EV: tl.constexpr,
                    BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr):
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_q_heads).to(tl.int64)
    h = (pid_bh % num_q_heads).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_ev = tl.arange(0, BLOCK_EV)
    PAD_EV: tl.constexpr = BLOCK_EV != HEAD_DIM_V
    do = load_tile(DO + b * sdb + h * sdh, offs_m, offs_ev, sdl, sde, L, HEAD_DIM_V, True, PAD_EV)
    o = load_tile(O + b * sob + h * soh, offs_m, offs_ev, sol, soe, L, HEAD_DIM_V, True, PAD_EV)
    d = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    row = pid_bh.to(tl.int64) * L
    if HAS_DLSE:
        d -= load_row_vector(DLSE + row, offs_m, L).to(tl.float32)
    tl.store(D + row + offs_m, d, mask=offs_m < L)


strides_of(_row_dot_kernel, DO="sd", O="so")


def row_dot(do, o, dlse):
    """D (float32, (B, H, L)) = rowsum(do * o) - dlse."""
    B, H, L, Ev = do.shape
    d = torch.empty((B, H, L), device=do.device, dtype=torch.float32)
    block_m = 16 if interpreting() else 64
    dlse_arg = dlse.contiguous() if dlse is not None else d
    has_dlse = dlse is not None
    plan = fixed_plan(("row_dot", Ev, block_m, has_dlse), lambda: dict(
        HEAD_DIM_V=Ev, BLOCK_EV=padded_dim(Ev), BLOCK_M=block_m, HAS_DLSE=has_dlse, num_warps=4))
    plan(_row_dot_kernel, (blocks(L, block_m), B * H),
         DO=do, O=o, DLSE=dlse_arg, D=d, num_q_heads=H, L=L)
    return d


# --------------------------------------------------------------------------------------
# dk, dv (and optionally dq by atomics): key-block major
# --------------------------------------------------------------------------------------
@triton.jit
def _column_steps(dk, dv, k, v, q_base, do_base, lse_ptr, d_ptr, dq_base, mask_base,
                  sql, sqe, sdl, sde, sql_acc, sml, sme, firsts, ends, m_lo, m_hi, gap_lo,
                  gap_len, n0, L, S, qk_scale_log2,
                  scale, softcap, seed_ptr, head, drop_threshold, keep_scale, dm_base, sdml, sdme,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
                  DQ_ATOMICS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  MASK_SOURCE: tl.constexpr, DROPOUT: tl.constexpr, HAS_DM: tl.constexpr,
                  SOFTCAP: tl.constexpr, RELATIVE: tl.constexpr):
    PAD_E: tl.constexpr = BLOCK_E != HEAD_DIM
    PAD_EV: tl.constexpr = BLOCK_EV != HEAD_DIM_V
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
        # everything is transposed ([keys, queries]) so that dk, dv accumulate without trans
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
        if DROPOUT:     # Z where P meets V: in dV = (P Z)ᵀ dO and in dP = Z (dO Vᵀ)
            zt = tl.trans(dropout_tile(seed_ptr, head, L, m0, n0, S, drop_threshold, keep_scale,
                                       BLOCK_M, BLOCK_N))
            dv += tl.dot((pt * zt).to(do.dtype), do, input_precision=DOT_PRECISION)
            dpt = dpt * zt
        else:
            dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PRECISION)
        dst = pt * (dpt - d[None, :])
        if HAS_DM:      # a learned bias's cotangent: dS itself (dT with a cap), [keys, queries]
            add_score_tile(dm_base, dst, offs_n, offs_m, sdme, sdml, S, L)
        if SOFTCAP:
            dst = dst * capped_slope(tht)
        dst = dst.to(q.dtype)
        dk += tl.dot(dst, q, input_precision=DOT_PRECISION)
        if DQ_ATOMICS:
            dq_part = tl.dot(tl.trans(dst), k, input_precision=DOT_PRECISION) * scale
            ptrs = dq_base + offs_m[:, None] * sql_acc + offs_e[None, :]
            tl.atomic_add(ptrs, dq_part, mask=(offs_m[:, None] < L) & (offs_e[None, :] < HEAD_DIM),
                          sem="relaxed")
    return dk, dv


@triton.jit
def _column_kernel(Q, K, V, DO, LSE, D, DK, DV, DQ_ACC, MASK, KEY_RANGE, SEED, DM,
                   sqb, sqh, sql, sqe, skb, skh, skn, ske, svb, svh, svn, sve,
                   sdb, sdh, sdl, sde, sdkb, sdkh, sdkn, sdke, sdvb, sdvh, sdvn, sdve,
                   smb, smh, sml, sme, srb, srh, srl, sre, sdmb, sdmh, sdml, sdme,
                   num_kv_heads, kv_group, L, S, drop_threshold, qk_scale_log2, scale, keep_scale,
                   softcap, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   MASK_KIND: tl.constexpr, MASK_PATH: tl.constexpr, DQ_ATOMICS: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr, HAS_DM: tl.constexpr,
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
    dk = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_EV], tl.float32)
    m_first, m_unmasked = row_blocks_of_key_block(n0, L, BLOCK_M, BLOCK_N, CAUSAL)
    if DQ_ATOMICS:
        # the atomic dq needs padded keys masked too; they only occur in the last key block
        if n0 + BLOCK_N > S:
            m_unmasked = ((L + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    num_q_heads = num_kv_heads * kv_group
    for g in range(0, kv_group):
        h = hk * kv_group + g
        head = b * num_q_heads + h
        row = head * L
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdb + h * sdh
        dq_base = DQ_ACC + row * HEAD_DIM
        mask_base = MASK + b * smb + h * smh
        dm_base = DM + b * sdmb + h * sdmh
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
            dk, dv = _column_steps(
                dk, dv, k, v, q_base, do_base, LSE + row, D + row, dq_base, mask_base, sql, sqe,
                sdl, sde, HEAD_DIM, sml, sme, firsts, ends, m_lo, m_hi, m_a, m_b - m_a, n0, L, S,
                qk_scale_log2, scale, softcap, SEED, head, drop_threshold, keep_scale, dm_base,
                sdml, sdme, HEAD_DIM, HEAD_DIM_V,
                BLOCK_E, BLOCK_EV, BLOCK_M, BLOCK_N, True, CAUSAL, MASK_KIND, DQ_ATOMICS,
                DOT_PRECISION, MASK_FROM_INDICES, DROPOUT, HAS_DM, SOFTCAP, RELATIVE)
            dk, dv = _column_steps(
                dk, dv, k, v, q_base, do_base, LSE + row, D + row, dq_base, mask_base, sql, sqe,
                sdl, sde, HEAD_DIM, sml, sme, firsts, ends, m_a, m_b, 0, 0, n0, L, S,
                qk_scale_log2, scale, softcap, SEED, head, drop_threshold, keep_scale, dm_base,
                sdml, sdme, HEAD_DIM, HEAD_DIM_V,
                BLOCK_E, BLOCK_EV, BLOCK_M, BLOCK_N, False, CAUSAL, 0, DQ_ATOMICS, DOT_PRECISION,
                NO_MASK_SOURCE, DROPOUT, HAS_DM, SOFTCAP, RELATIVE)
        else:
            dk, dv = _column_steps(
                dk, dv, k, v, q_base, do_base, LSE + row, D + row, dq_base, mask_base, sql, sqe,
                sdl, sde, HEAD_DIM, sml, sme, firsts, ends, m_lo, m_mid, 0, 0, n0, L, S,
                qk_scale_log2, scale, softcap, SEED, head, drop_threshold, keep_scale, dm_base,
                sdml, sdme, HEAD_DIM, HEAD_DIM_V,
                BLOCK_E, BLOCK_EV, BLOCK_M, BLOCK_N, True, CAUSAL, MASK_KIND, DQ_ATOMICS,
                DOT_PRECISION, MASK_READ, DROPOUT, HAS_DM, SOFTCAP, RELATIVE)
            dk, dv = _column_steps(
                dk, dv, k, v, q_base, do_base, LSE + row, D + row, dq_base, mask_base, sql, sqe,
                sdl, sde, HEAD_DIM, sml, sme, firsts, ends, m_mid, m_hi, 0, 0, n0, L, S,
                qk_scale_log2, scale, softcap, SEED, head, drop_threshold, keep_scale, dm_base,
                sdml, sdme, HEAD_DIM, HEAD_DIM_V,
                BLOCK_E, BLOCK_EV, BLOCK_M, BLOCK_N, False, CAUSAL, MASK_KIND, DQ_ATOMICS,
                DOT_PRECISION, MASK_READ, DROPOUT, HAS_DM, SOFTCAP, RELATIVE)
    store_tile(DK + b * sdkb + hk * sdkh, (dk * scale).to(DK.dtype.element_ty), offs_n, offs_e,
               sdkn, sdke, S, HEAD_DIM, PAD_E)
    store_tile(DV + b * sdvb + hk * sdvh, dv.to(DV.dtype.element_ty), offs_n, offs_ev,
               sdvn, sdve, S, HEAD_DIM_V, PAD_EV)


strides_of(_column_kernel, Q="sq", K="sk", V="sv", DO="sd", DK="sdk", DV="sdv", MASK="sm",
           KEY_RANGE="sr", DM="sdm")


# --------------------------------------------------------------------------------------
# dq: query-block major (deterministic)
# --------------------------------------------------------------------------------------
@triton.jit
def _dq_steps(dq, q, do, lse2, d, k_base, v_base, skn, ske, svn, sve, mask_base, sml, sme,
              firsts, ends, offs_m, offs_e, offs_ev, n_lo, n_hi, gap_lo, gap_len, L, S,
              qk_scale_log2, scale, softcap, seed_ptr, head, m0, drop_threshold, keep_scale,
              HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
              PAD_E: tl.constexpr, PAD_EV: tl.constexpr, DOT_PRECISION: tl.constexpr,
              MASK_SOURCE: tl.constexpr, DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr,
              RELATIVE: tl.constexpr):
    # the key blocks [n_lo, n_hi) but those of [gap_lo, gap_lo + gap_len) (a loop over the
    # blocks at both ends of a key range: one pipeline)
    for n in range(n_lo, n_hi - gap_len, BLOCK_N):
        n0 = n + tl.where(n >= gap_lo, gap_len, 0)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = load_tile(k_base, offs_n, offs_e, skn, ske, S, HEAD_DIM, MASKED, PAD_E)
        v = load_tile(v_base, offs_n, offs_ev, svn, sve, S, HEAD_DIM_V, MASKED, PAD_EV)
        s2, th = base2_scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), scale,
                              qk_scale_log2, softcap, SOFTCAP)
        if RELATIVE:
            s2 = add_relative_bias(s2, mask_base, offs_m, offs_n, L, S, False)
        if MASKED:
            s2 = tl.where(visibility_mask(offs_m, offs_n, S, CAUSAL, False), s2, float("-inf"))
        if MASK_KIND != 0:
            s2 = apply_mask_tile(s2, mask_base, offs_m, offs_n, sml, sme, L, S, firsts, ends,
                                 MASK_KIND, False, MASK_SOURCE)
        p = tl.math.exp2(s2 - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if DROPOUT:
            dp = dp * dropout_tile(seed_ptr, head, L, m0, n0, S, drop_threshold, keep_scale,
                                   offs_m.shape[0], BLOCK_N)
        ds = p * (dp - d[:, None])
        if SOFTCAP:
            ds = ds * capped_slope(th)
        ds = ds.to(k.dtype)
        dq += tl.dot(ds, k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _dq_kernel(Q, K, V, DO, LSE, D, DQ, MASK, KEY_RANGE, SEED,
               sqb, sqh, sql, sqe, skb, skh, skn, ske, svb, svh, svn, sve,
               sdb, sdh, sdl, sde, sdqb, sdqh, sdql, sdqe, smb, smh, sml, sme,
               srb, srh, srl, sre,
               num_q_heads, kv_group, L, S, drop_threshold, qk_scale_log2, scale, keep_scale,
               softcap, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
               MASK_KIND: tl.constexpr, MASK_PATH: tl.constexpr, DOT_PRECISION: tl.constexpr,
               DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, RELATIVE: tl.constexpr):
    PAD_E: tl.constexpr = BLOCK_E != HEAD_DIM
    PAD_EV: tl.constexpr = BLOCK_EV != HEAD_DIM_V
    b, h, hk, m0, offs_m, offs_e, offs_ev, row = row_block_program(
        num_q_heads, kv_group, L, BLOCK_M, BLOCK_E, BLOCK_EV, CAUSAL)
    head = b * num_q_heads + h
    if MASK_KIND != 0:      # only this launch's (batch, head)s (MASK_PATH)
        if on_mask_path(tl.load(KEY_RANGE + b * srb + h * srh + 2 * sre),
                        MASK_PATH) == 0:
            return
    q = load_tile(Q + b * sqb + h * sqh, offs_m, offs_e, sql, sqe, L, HEAD_DIM, True, PAD_E)
    do = load_tile(DO + b * sdb + h * sdh, offs_m, offs_ev, sdl, sde, L, HEAD_DIM_V, True, PAD_EV)
    lse2 = load_lse2_for_probabilities(LSE + row, offs_m, L)
    d = load_row_vector(D + row, offs_m, L)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    mask_base = MASK + b * smb + h * smh
    dq = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
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
        dq = _dq_steps(dq, q, do, lse2, d, k_base, v_base, skn, ske, svn, sve, mask_base,
                       sml, sme, firsts, ends, offs_m, offs_e, offs_ev, a_end,
                       b_end, 0, 0, L, S, qk_scale_log2, scale, softcap, SEED, head, m0,
                       drop_threshold, keep_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_N, False,
                       CAUSAL, 0, PAD_E, PAD_EV, DOT_PRECISION, NO_MASK_SOURCE, DROPOUT,
                       SOFTCAP, RELATIVE)
        dq = _dq_steps(dq, q, do, lse2, d, k_base, v_base, skn, ske, svn, sve, mask_base,
                       sml, sme, firsts, ends, offs_m, offs_e, offs_ev, lo1, hi2,
                       a_end, b_end - a_end, L, S, qk_scale_log2, scale, softcap, SEED, head, m0,
                       drop_threshold, keep_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, CAUSAL,
                       MASK_KIND, PAD_E, PAD_EV, DOT_PRECISION, MASK_FROM_INDICES, DROPOUT,
                       SOFTCAP, RELATIVE)
    else:
        dq = _dq_steps(dq, q, do, lse2, d, k_base, v_base, skn, ske, svn, sve, mask_base,
                       sml, sme, firsts, ends, offs_m, offs_e, offs_ev, lo1, hi1, 0,
                       0, L, S, qk_scale_log2, scale, softcap, SEED, head, m0, drop_threshold,
                       keep_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_N, False, CAUSAL,
                       MASK_KIND, PAD_E, PAD_EV, DOT_PRECISION, MASK_READ, DROPOUT,
                       SOFTCAP, RELATIVE)
        dq = _dq_steps(dq, q, do, lse2, d, k_base, v_base, skn, ske, svn, sve, mask_base,
                       sml, sme, firsts, ends, offs_m, offs_e, offs_ev, lo2, hi2, 0,
                       0, L, S, qk_scale_log2, scale, softcap, SEED, head, m0, drop_threshold,
                       keep_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, CAUSAL,
                       MASK_KIND, PAD_E, PAD_EV, DOT_PRECISION, MASK_READ, DROPOUT,
                       SOFTCAP, RELATIVE)
    store_tile(DQ + b * sdqb + h * sdqh, (dq * scale).to(DQ.dtype.element_ty), offs_m, offs_e,
               sdql, sdqe, L, HEAD_DIM, PAD_E)


strides_of(_dq_kernel, Q="sq", K="sk", V="sv", DO="sd", DQ="sdq", MASK="sm", KEY_RANGE="sr")


# --------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------
def column_candidates(dtype, head_dim, head_dim_v, atomics, read=False):
    """read: for a mask read per tile (its own measured best first)."""
    candidates = _column_candidates(dtype, head_dim, head_dim_v, atomics)
    # 64 x 64 with 4 warps: the fastest dk/dv pass reading its mask on a padded batch
    # (docs/measurements.md, "Masks")
    return read_path_first(candidates, dict(BLOCK_M=64, BLOCK_N=64, num_warps=4,
                                            num_stages=2)) if read else candidates


def _column_candidates(dtype, head_dim, head_dim_v, atomics):
    if interpreting():
        return [dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)]
    nbytes = row_bytes(dtype, head_dim, head_dim_v) * (2 if atomics else 1)
    if nbytes > 128:
        return wide_candidates(nbytes, column=True)
    # measured on the H200: 32 x 128 (3 stages) from 8K on, 64 x 64 below
    return [dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=3),
            dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
            dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2)]


def dq_candidates(dtype, head_dim, head_dim_v, read=False):
    """read: for a mask read per tile (its own measured best first)."""
    candidates = _dq_candidates(dtype, head_dim, head_dim_v)
    # 64 x 32: the fastest dq pass reading its mask on a padded batch ("Masks")
    return read_path_first(candidates, dict(BLOCK_M=64, BLOCK_N=32, num_warps=4,
                                            num_stages=3)) if read else candidates


def _dq_candidates(dtype, head_dim, head_dim_v):
    if interpreting():
        return [dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)]
    nbytes = row_bytes(dtype, head_dim, head_dim_v)
    if nbytes > 128:
        return wide_candidates(nbytes, column=False)
    return [dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
            dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3),
            dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
            dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3)]


def attention_backward(q, k, v, o, lse, do, dlse, params, dq_atomics=False, dmask=None):
    """(dq, dk, dv), laid out like the primals (layout.py), in their dtypes; S must be > 0.
    dmask: a zeroed fp32 buffer shaped like params.mask with 1 on its broadcast dims, into
    which the column pass adds dS (a learned bias's cotangent), or None."""
    scale, causal = params.scale, params.causal
    B, Hq, L, E = q.shape
    Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    lse = lse.contiguous()
    d = row_dot(do, o, dlse)
    dk = empty_like_order(k.shape, k)
    dv = empty_like_order(v.shape, v)
    dq_acc = (torch.zeros((B, Hq, L, E), device=q.device, dtype=torch.float32)
              if dq_atomics else dk)
    mask_kind, mask, key_range = mask_kind_and_tensor(params, q, reuse=True)
    dropout, seed, drop_threshold, keep_scale = dropout_arguments(params, lse)
    capped, softcap = softcap_arguments(params)
    relative = has_relative_bias(params)
    has_dm = dmask is not None
    # broadcast dims at stride 0 (atomics add the (batch, head)s sharing an element)
    dm_arg = dmask.expand(B, Hq, L, S) if has_dm else dk

    def common(path):
        return dict(HEAD_DIM=E, HEAD_DIM_V=Ev, BLOCK_E=padded_dim(E), BLOCK_EV=padded_dim(Ev),
                    CAUSAL=causal, MASK_KIND=mask_kind, MASK_PATH=path,
                    DOT_PRECISION=dot_precision(q.dtype), DROPOUT=dropout, SOFTCAP=capped,
                    RELATIVE=relative)

    def launch_columns(plan):
        plan(_column_kernel, (blocks(S, plan.kwargs["BLOCK_N"]), B * Hkv),
             Q=q, K=k, V=v, DO=do, LSE=lse, D=d, DK=dk, DV=dv, DQ_ACC=dq_acc, MASK=mask,
             KEY_RANGE=key_range, SEED=seed, DM=dm_arg,
             num_kv_heads=Hkv, kv_group=Hq // Hkv, L=L, S=S, drop_threshold=drop_threshold,
             qk_scale_log2=scale * LOG2E, scale=scale, keep_scale=keep_scale, softcap=softcap)

    # the plans first (tuning runs the kernels), then the launches: the atomic dq adds
    # into a buffer zeroed once before them, a masked kernel's two launches included
    paths = mask_paths(mask_kind)
    plans = [launch_plan(
        "bwd_columns", q, k, v, causal,
        (dq_atomics, *mask_flags(mask_kind, path), *dropout_flags(dropout),
         *softcap_flags(capped), *relative_flags(relative)) + (("dmask",) if has_dm else ()),
        lambda: column_candidates(q.dtype, E, Ev, dq_atomics, read=path == READ_PATH),
        lambda: dict(common(path), DQ_ATOMICS=dq_atomics, HAS_DM=has_dm), launch_columns,
        L * S,
        has_work=mask_path_work(key_range, path, Hq // Hkv)) for path in paths]
    if dq_atomics:
        dq_acc.zero_()
    if has_dm:
        dmask.zero_()
    for plan in plans:
        launch_columns(plan)
    if dq_atomics:
        return dq_acc.to(q.dtype), dk, dv

    dq = empty_like_order(q.shape, q)

    def launch_rows(plan):
        plan(_dq_kernel, (blocks(L, plan.kwargs["BLOCK_M"]), B * Hq),
             Q=q, K=k, V=v, DO=do, LSE=lse, D=d, DQ=dq, MASK=mask, KEY_RANGE=key_range,
             SEED=seed, num_q_heads=Hq, kv_group=Hq // Hkv, L=L, S=S,
             drop_threshold=drop_threshold, qk_scale_log2=scale * LOG2E, scale=scale,
             keep_scale=keep_scale, softcap=softcap)

    for path in paths:
        launch_rows(launch_plan("bwd_dq", q, k, v, causal,
                                mask_flags(mask_kind, path) + dropout_flags(dropout)
                                + softcap_flags(capped) + relative_flags(relative),
                                lambda: dq_candidates(q.dtype, E, Ev, read=path == READ_PATH),
                                lambda: common(path), launch_rows, L * S,
                                has_work=mask_path_work(key_range, path)))
    return dq, dk, dv
