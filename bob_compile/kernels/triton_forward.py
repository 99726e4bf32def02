"""Attention forward in Triton: o = softmax(scale q k^T) v and its natural-log lse (the scores
soft-capped first where SOFTCAP is on: triton_softcap.py).

One program per (block of BLOCK_M query rows, batch x query head); it streams the key/value
blocks its rows can see with the online softmax (running max m, running sum l, both in base
2). Interior key blocks run without any mask; only the causal diagonal and the partial last
key block are masked. A mask tensor (MASK_KIND != 0) is read in every block, unless it is
a key range (with the causal mask folded in or not: triton_masks.py), which is applied from
indices to the blocks at the range's ends and the diagonal only.
"""
import torch
import triton
import triton.language as tl

from .layout import empty_like_order
from .launching import launch_plan, read_path_first, strides_of
from .tiles import (INDICES_PATH, LOG2E, MASK_FROM_INDICES, MASK_READ, NO_MASK_PATH, NO_MASK_SOURCE,
                    READ_PATH, add_relative_bias, apply_mask_tile, blocks, dot_precision,
                    key_blocks_of_row_block, key_loops_within_mask, load_tile, on_mask_path,
                    padded_dim, row_block_program, store_tile, unmasked_key_blocks, visibility_mask)
from .tuning import interpreting, row_bytes, wide_candidates
from .triton_dropout import dropout_arguments, dropout_flags, dropout_tile
from .triton_softcap import base2_scores, softcap_arguments, softcap_flags
from .triton_masks import (has_relative_bias, mask_flags, mask_kind_and_tensor, mask_path_work,
                           mask_paths, relative_flags)


@triton.jit
def _max_keeping_nan(a, b):
    # tl.maximum's default may drop a NaN operand (GPU max.f32 does); a NaN score must make
    # the running max NaN so that its row comes out NaN, not empty
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _forward_steps(acc, l_i, m_i, q, k_base, v_base, skn, ske, svn, sve,
                   mask_base, sml, sme, firsts, ends, offs_m, offs_e, offs_ev, n_lo,
                   n_hi, gap_lo, gap_len, L, S, qk_scale_log2, scale, softcap, seed_ptr, head,
                   m0, drop_threshold, keep_scale, HEAD_DIM: tl.constexpr,
                   HEAD_DIM_V: tl.constexpr,
                   BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                   MASK_KIND: tl.constexpr, PAD_E: tl.constexpr, PAD_EV: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, MASK_SOURCE: tl.constexpr,
                   DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, RELATIVE: tl.constexpr):
    # the key blocks [n_lo, n_hi) but those of [gap_lo, gap_lo + gap_len) (a loop over the
    # blocks at both ends of a key range: one pipeline)
    for n in range(n_lo, n_hi - gap_len, BLOCK_N):
        n0 = n + tl.where(n >= gap_lo, gap_len, 0)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = load_tile(k_base, offs_n, offs_e, skn, ske, S, HEAD_DIM, MASKED, PAD_E)
        v = load_tile(v_base, offs_n, offs_ev, svn, sve, S, HEAD_DIM_V, MASKED, PAD_EV)
        s2 = base2_scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), scale,
                          qk_scale_log2, softcap, SOFTCAP)[0]
        if RELATIVE:
            s2 = add_relative_bias(s2, mask_base, offs_m, offs_n, L, S, False)
        if MASKED:
            s2 = tl.where(visibility_mask(offs_m, offs_n, S, CAUSAL, False), s2, float("-inf"))
        if MASK_KIND != 0:
            s2 = apply_mask_tile(s2, mask_base, offs_m, offs_n, sml, sme, L, S, firsts, ends,
                                 MASK_KIND, False, MASK_SOURCE)
        m_new = _max_keeping_nan(m_i, tl.reduce(s2, 1, _max_keeping_nan))
        # rows whose scores are all -inf so far keep a finite reference point (no inf - inf)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.math.exp2(m_i - m_ref)
        p = tl.math.exp2(s2 - m_ref[:, None])
        l_i = l_i * rescale + tl.sum(p, 1)
        if DROPOUT:     # the softmax's sum is over every key; only the values see Z
            p = p * dropout_tile(seed_ptr, head, L, m0, n0, S, drop_threshold, keep_scale,
                                 offs_m.shape[0], BLOCK_N)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _forward_kernel(Q, K, V, O, LSE, MASK, KEY_RANGE, SEED,
                    sqb, sqh, sql, sqe, skb, skh, skn, ske, svb, svh, svn, sve,
                    sob, soh, sol, soe, smb, smh, sml, sme, srb, srh, srl, sre,
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
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    mask_base = MASK + b * smb + h * smh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_EV], tl.float32)
    full_end, visible_end = key_blocks_of_row_block(m0, S, BLOCK_M, BLOCK_N, CAUSAL)
    lo1, hi1, lo2, hi2 = 0, full_end, full_end, visible_end
    firsts, ends = 0, S     # the rows' key intervals, on the INDICES_PATH
    if MASK_KIND != 0:      # only the key blocks holding keys these rows see
        lo1, hi1, lo2, hi2, firsts, ends = key_loops_within_mask(
            lo1, hi1, lo2, hi2, m0, KEY_RANGE + b * srb + h * srh, sre, L,
            BLOCK_M, BLOCK_N)
    # A mask's source is fixed per launch (MASK_PATH), not decided per tile: each loop body
    # holds one kind of masking, without a branch or the other kind's mask load (with the
    # branch in its loop, the masked forward took ~2.6x the unmasked one's time per visible
    # pair on the H200: docs/measurements.md, "Masks"). A key range's launch runs the key
    # blocks wholly inside the range unmasked and its edge blocks in one loop; else no
    # mask, or the mask read per tile.
    if MASK_PATH == INDICES_PATH:
        a_end, b_end = unmasked_key_blocks(lo1, hi1, hi2, firsts, ends, offs_m, L, BLOCK_N)
        acc, l_i, m_i = _forward_steps(
            acc, l_i, m_i, q, k_base, v_base, skn, ske, svn, sve, mask_base, sml, sme, firsts,
            ends, offs_m, offs_e, offs_ev, a_end, b_end, 0, 0, L, S, qk_scale_log2, scale,
            softcap, SEED, head, m0, drop_threshold, keep_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_N,
            False, CAUSAL, 0, PAD_E, PAD_EV, DOT_PRECISION, NO_MASK_SOURCE, DROPOUT,
            SOFTCAP, RELATIVE)
        acc, l_i, m_i = _forward_steps(
            acc, l_i, m_i, q, k_base, v_base, skn, ske, svn, sve, mask_base, sml, sme, firsts,
            ends, offs_m, offs_e, offs_ev, lo1, hi2, a_end, b_end - a_end, L, S,
            qk_scale_log2, scale, softcap, SEED, head, m0, drop_threshold, keep_scale, HEAD_DIM,
            HEAD_DIM_V, BLOCK_N, True, CAUSAL, MASK_KIND, PAD_E, PAD_EV, DOT_PRECISION,
            MASK_FROM_INDICES, DROPOUT, SOFTCAP, RELATIVE)
    else:
        acc, l_i, m_i = _forward_steps(
            acc, l_i, m_i, q, k_base, v_base, skn, ske, svn, sve, mask_base, sml, sme, firsts,
            ends, offs_m, offs_e, offs_ev, lo1, hi1, 0, 0, L, S, qk_scale_log2, scale, softcap,
            SEED, head, m0, drop_threshold, keep_scale, HEAD_DIM,
            HEAD_DIM_V, BLOCK_N, False, CAUSAL, MASK_KIND, PAD_E, PAD_EV, DOT_PRECISION,
            MASK_READ, DROPOUT, SOFTCAP, RELATIVE)
        acc, l_i, m_i = _forward_steps(
            acc, l_i, m_i, q, k_base, v_base, skn, ske, svn, sve, mask_base, sml, sme, firsts,
            ends, offs_m, offs_e, offs_ev, lo2, hi2, 0, 0, L, S, qk_scale_log2, scale, softcap,
            SEED, head, m0, drop_threshold, keep_scale, HEAD_DIM,
            HEAD_DIM_V, BLOCK_N, True, CAUSAL, MASK_KIND, PAD_E, PAD_EV, DOT_PRECISION,
            MASK_READ, DROPOUT, SOFTCAP, RELATIVE)

    # Without a mask every row in range sees key 0 (S > 0 is checked on the host). A running
    # max still -inf means all its scores are -inf (infinite inputs, or a mask hiding every
    # key): o = acc = 0 and lse = -inf, like SDPA's math path. A NaN score made the max
    # NaN, so NaN rows stay NaN.
    l_i = tl.where(m_i == float("-inf"), 1.0, l_i)
    o = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453   # ln 2: base 2 -> natural log
    store_tile(O + b * sob + h * soh, o.to(O.dtype.element_ty), offs_m, offs_ev, sol, soe, L,
               HEAD_DIM_V, PAD_EV)
    tl.store(LSE + row + offs_m, lse, mask=offs_m < L)


strides_of(_forward_kernel, Q="sq", K="sk", V="sv", O="so", MASK="sm", KEY_RANGE="sr")


# Candidate launch configs, best measured default first (see docs/measurements.md).
def forward_candidates(dtype, head_dim, head_dim_v, path=NO_MASK_PATH):
    """path: a masked launch's MASK_PATH (tiles.py), which has its own best first."""
    candidates = _forward_candidates(dtype, head_dim, head_dim_v)
    if path == READ_PATH:
        # 64 x 32: the fastest forward reading its mask on a padded batch (B = 8, N = 2048;
        # docs/measurements.md, "Masks")
        return read_path_first(candidates, dict(BLOCK_M=64, BLOCK_N=32, num_warps=4,
                                                num_stages=3))
    if (path == INDICES_PATH and not interpreting() and torch.version.hip is None
            and row_bytes(dtype, head_dim, head_dim_v) <= 128):
        # a key range's two loops take ~150 registers per thread where ptxas may choose,
        # one program per SM at 8 warps; bounded to 128 (an NVIDIA option) they fit without
        # a spill (sm_90), two per SM, as the unmasked forward's 120
        return [dict(candidates[0], maxnreg=128)] + candidates
    return candidates


def _forward_candidates(dtype, head_dim, head_dim_v):
    if interpreting():
        return [dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)]
    nbytes = row_bytes(dtype, head_dim, head_dim_v)
    if nbytes > 256:
        return wide_candidates(nbytes, column=False)
    if nbytes > 128:
        return [dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
                dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
                dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)]
    return [dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
            dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
            dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
            dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3)]


def attention_forward(q, k, v, params):
    """o (q's dtype, laid out like q: layout.py) and lse (float32, (B, Hq, L)); S must be > 0."""
    scale, causal = params.scale, params.causal
    B, Hq, L, E = q.shape
    Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    o = empty_like_order((B, Hq, L, Ev), q)
    lse = torch.empty((B, Hq, L), device=q.device, dtype=torch.float32)
    mask_kind, mask, key_range = mask_kind_and_tensor(params, q)
    dropout, seed, drop_threshold, keep_scale = dropout_arguments(params, lse)
    capped, softcap = softcap_arguments(params)
    relative = has_relative_bias(params)

    def launch(plan):
        plan(_forward_kernel, (blocks(L, plan.kwargs["BLOCK_M"]), B * Hq),
             Q=q, K=k, V=v, O=o, LSE=lse, MASK=mask, KEY_RANGE=key_range, SEED=seed,
             num_q_heads=Hq, kv_group=Hq // Hkv, L=L, S=S, drop_threshold=drop_threshold,
             qk_scale_log2=scale * LOG2E, scale=scale, keep_scale=keep_scale, softcap=softcap)

    for path in mask_paths(mask_kind):
        launch(launch_plan(
            "forward", q, k, v, causal,
            mask_flags(mask_kind, path) + dropout_flags(dropout) + softcap_flags(capped)
            + relative_flags(relative),
            lambda: forward_candidates(q.dtype, E, Ev, path),
            lambda: dict(HEAD_DIM=E, HEAD_DIM_V=Ev, BLOCK_E=padded_dim(E),
                         BLOCK_EV=padded_dim(Ev), CAUSAL=causal, MASK_KIND=mask_kind,
                         MASK_PATH=path, DOT_PRECISION=dot_precision(q.dtype), DROPOUT=dropout,
                         SOFTCAP=capped, RELATIVE=relative),
            launch, L * S, has_work=mask_path_work(key_range, path)))
    return o, lse
