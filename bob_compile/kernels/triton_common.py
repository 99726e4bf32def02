"""Pieces shared by the Triton attention kernels: tile loads, causal bounds, launch configs.

Conventions used by every kernel in `triton_forward`, `triton_backward` and `triton_bob`:
- one program owns one block of query rows (a "row" kernel) or one block of key columns
  (a "column" kernel) of one (batch, head);
- scores are kept in base 2: s2 = (q . k) * scale * log2(e), and the saved natural-log lse
  is loaded as lse2 = lse * log2(e), so P = exp2(s2 - lse2) costs one FMA and one EX2;
- query rows past L load lse2 = +inf, which makes their P exactly 0 without a mask;
- key columns past S and causal (j > i) pairs are masked only in the few "edge" blocks;
  the loops over the interior blocks carry no mask at all (constexpr MASKED=False).

Host side: every launch's keyword arguments (constexprs, block sizes, warps, stages) are
chosen once per tuning bucket and remembered, and repeated launches go straight to the
compiled kernel (`LaunchPlan`), so a call costs the allocation of its outputs, its launches
and little else (benchmarks/bench_host_overhead.py measures it).
"""
import inspect
import json
import logging
import math
import os
import threading

import torch
import triton
import triton.language as tl

from . import settings

log = logging.getLogger("bob_compile.kernels")
# exp(x) = exp2(x * log2(e)); the kernels work in base 2 because EX2 is one instruction.
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def dot_precision(dtype):
    """Triton's dot mode for this input dtype.

    float32 inputs must not silently drop to tf32 (3e-4 relative error, 100x PyTorch's own
    float32 error): "tf32x3" splits each operand into two tf32 halves and keeps ~fp32 accuracy
    on the tensor cores. Half inputs use the plain tensor-core path ("ieee" is a no-op there).
    """
    return "tf32x3" if dtype == torch.float32 else "ieee"


try:        # what Triton raises when a kernel cannot be built for the device
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources
    BUILD_ERRORS = (CompilationError, OutOfResources)
except ImportError:
    BUILD_ERRORS = ()


def error_summary(error):
    """'Type: first line of the message' (at most 200 characters of it), for a log line."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


def blocks(n, block):
    """The number of blocks of `block` that cover n (a launch grid's size). triton.cdiv is a
    constexpr_function in Triton 3.6: ~3 us per call on the host, against a division."""
    return -(-n // block)


def padded_dim(d):
    """Head dims are tiled by the next power of two (>= 16, the smallest tl.dot size)."""
    return max(16, triton.next_power_of_2(d))


# --------------------------------------------------------------------------------------
# Tile loads
# --------------------------------------------------------------------------------------
@triton.jit
def load_tile(base, offs_rows, offs_cols, stride_rows, stride_cols, num_rows, num_cols,
              MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """A [rows, cols] tile; out-of-range elements read as 0 (a zero row adds nothing to a dot)."""
    ptrs = base + offs_rows[:, None] * stride_rows + offs_cols[None, :] * stride_cols
    if MASK_ROWS and MASK_COLS:
        tile = tl.load(ptrs, mask=(offs_rows[:, None] < num_rows) & (offs_cols[None, :] < num_cols),
                       other=0.0)
    elif MASK_ROWS:
        tile = tl.load(ptrs, mask=offs_rows[:, None] < num_rows, other=0.0)
    elif MASK_COLS:
        tile = tl.load(ptrs, mask=offs_cols[None, :] < num_cols, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def store_tile(base, value, offs_rows, offs_cols, stride_rows, stride_cols, num_rows, num_cols,
               MASK_COLS: tl.constexpr):
    ptrs = base + offs_rows[:, None] * stride_rows + offs_cols[None, :] * stride_cols
    if MASK_COLS:
        tl.store(ptrs, value, mask=(offs_rows[:, None] < num_rows) & (offs_cols[None, :] < num_cols))
    else:
        tl.store(ptrs, value, mask=offs_rows[:, None] < num_rows)


@triton.jit
def row_block_program(num_q_heads, kv_group, L, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_EV: tl.constexpr, CAUSAL: tl.constexpr):
    """Where a program of a query-block-major grid (row blocks, B·Hq) works: batch b, query
    head h, key/value head hk, first row m0, the row and feature offsets, and the start of
    its (b, h) row vectors. Causal grids run the last row blocks (most keys) first."""
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_q_heads).to(tl.int64)
    h = (pid_bh % num_q_heads).to(tl.int64)
    m0 = pid_m * BLOCK_M
    return (b, h, h // kv_group, m0, m0 + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_E),
            tl.arange(0, BLOCK_EV), pid_bh.to(tl.int64) * L)


@triton.jit
def column_block_program(num_kv_heads, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_EV: tl.constexpr):
    """Where a program of a key-block-major grid (key blocks, B·Hkv) works: batch b,
    key/value head hk, first key n0, and the key and feature offsets."""
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_kv_heads).to(tl.int64)
    hk = (pid_bh % num_kv_heads).to(tl.int64)
    n0 = tl.program_id(0) * BLOCK_N
    return (b, hk, n0, n0 + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_E),
            tl.arange(0, BLOCK_EV))


@triton.jit
def load_lse2(lse_row_ptr, offs_m, L):
    """lse in base 2; rows past L get +inf so that every P of theirs is exp2(-inf) = 0."""
    lse = tl.load(lse_row_ptr + offs_m, mask=offs_m < L, other=float("inf"))
    return lse * 1.4426950408889634


@triton.jit
def load_row_vector(row_ptr, offs_m, L):
    return tl.load(row_ptr + offs_m, mask=offs_m < L, other=0.0)


# --------------------------------------------------------------------------------------
# Which blocks need a mask (top-left causal: query i sees key j iff j <= i)
# --------------------------------------------------------------------------------------
@triton.jit
def key_blocks_of_row_block(m0, S, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            CAUSAL: tl.constexpr):
    """For query rows [m0, m0+BLOCK_M): (end of the unmasked key blocks, end of visible keys).

    Key blocks starting below the first returned value are entirely visible to every row of
    the block and lie inside [0, S); the blocks from there to the second value need masks.
    """
    full_end = (S // BLOCK_N) * BLOCK_N
    visible_end = S
    if CAUSAL:
        # a key block is visible to all rows iff its last key <= m0
        full_end = tl.minimum(full_end, ((m0 + 1) // BLOCK_N) * BLOCK_N)
        visible_end = tl.minimum(S, m0 + BLOCK_M)
    return full_end, visible_end


@triton.jit
def row_blocks_of_key_block(n0, L, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            CAUSAL: tl.constexpr):
    """For key columns [n0, n0+BLOCK_N): (first visible query block, first unmasked one).

    Query blocks from the first value to the second straddle the causal diagonal and need
    the mask; later blocks see every key of the column block (rows past L read lse=+inf).
    """
    first = n0 * 0  # a tensor, not a constant, so that callers may reassign it at run time
    unmasked_start = n0 * 0
    if CAUSAL:
        first = (n0 // BLOCK_M) * BLOCK_M
        # a query block sees all keys of the column block iff its first row >= the last key
        unmasked_start = tl.minimum(((n0 + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M) * BLOCK_M,
                                    ((L + BLOCK_M - 1) // BLOCK_M) * BLOCK_M)
        unmasked_start = tl.maximum(unmasked_start, first)
    return first, unmasked_start


@triton.jit
def visibility_mask(offs_m, offs_n, S, CAUSAL: tl.constexpr, TRANSPOSED: tl.constexpr):
    """True where query offs_m may attend to key offs_n, as a [M, N] (or [N, M]) tile."""
    if TRANSPOSED:
        visible = offs_n[:, None] < S
        if CAUSAL:
            visible = visible & (offs_m[None, :] >= offs_n[:, None])
    else:
        visible = offs_n[None, :] < S
        if CAUSAL:
            visible = visible & (offs_m[:, None] >= offs_n[None, :])
    return visible


# --------------------------------------------------------------------------------------
# Mask tensors (bob_compile/kernels/params.py): read per tile where the scores are formed
# --------------------------------------------------------------------------------------
# (host side, and what each (batch, head)'s mask summary says: triton_masks.py)


@triton.jit
def load_mask_summary(summary_ptr, sre):
    """(first, end, structure) of one (batch, head), from KEY_RANGE (triton_masks.py)."""
    return tl.load(summary_ptr), tl.load(summary_ptr + sre), tl.load(summary_ptr + 2 * sre)


@triton.jit
def key_loops_within_mask(lo1, hi1, lo2, hi2, m0, summary_ptr, sre, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    """A row-block-major kernel's two key loops [lo1, hi1) and [lo2, hi2) (lo1, lo2
    multiples of BLOCK_N) for rows [m0, m0 + BLOCK_M), restricted to the key blocks holding
    keys its (batch, head)'s mask lets them see: keys in [first, end), and where no row
    sees a key above the diagonal (KEYS_IN_RANGE_CAUSAL, READ_THE_MASK_CAUSAL) none past
    the block's last row; then the summary (first, end, structure) from KEY_RANGE
    (triton_masks.py)."""
    first, end, structure = load_mask_summary(summary_ptr, sre)
    below_diagonal = (structure == 2) | (structure == 3)
    end_seen = tl.where(below_diagonal, tl.minimum(end, m0 + BLOCK_M), end)
    block_of_first = (first // BLOCK_N) * BLOCK_N
    return (tl.maximum(lo1, block_of_first), tl.minimum(hi1, end_seen),
            tl.maximum(lo2, block_of_first), tl.minimum(hi2, end_seen), first, end, structure)


@triton.jit
def row_loops_within_mask(m_lo, m_mid, m_hi, n0, summary_ptr, sre, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    """A key-block-major kernel's two query loops [m_lo, m_mid) and [m_mid, m_hi) for keys
    [n0, n0 + BLOCK_N), restricted by its (batch, head)'s mask: none when it hides every
    key of the block, and where no row sees a key above the diagonal (KEYS_IN_RANGE_CAUSAL,
    READ_THE_MASK_CAUSAL) no query block above it; then the summary (first, end,
    structure) from KEY_RANGE."""
    first, end, structure = load_mask_summary(summary_ptr, sre)
    below_diagonal = (structure == 2) | (structure == 3)
    m_lo = tl.where(below_diagonal, tl.maximum(m_lo, (n0 // BLOCK_M) * BLOCK_M), m_lo)
    m_mid = tl.maximum(m_mid, m_lo)
    unseen = (n0 >= end) | (n0 + BLOCK_N <= first)
    return (m_lo, tl.where(unseen, m_lo, m_mid), tl.where(unseen, m_lo, m_hi), first, end,
            structure)


@triton.jit
def unmasked_key_blocks_of_range(lo1, hi1, hi2, m0, first, end, structure,
                                 BLOCK_N: tl.constexpr):
    """For a mask applied from indices (a key range [first, end), with the causal mask folded
    in for KEYS_IN_RANGE_CAUSAL), after key_loops_within_mask: (a_end, b_end) splitting a
    row block's visible key blocks [lo1, hi2) into [lo1, a_end), the partial block holding
    `first`; [a_end, b_end), blocks wholly inside the range that every row of the block sees
    (no mask at all); and [b_end, hi2), the blocks at the range's end and the diagonal. The
    first and last need the mask; the middle is the unmasked kernel's loop."""
    full_lo = ((first + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    full_hi = tl.minimum(hi1, (end // BLOCK_N) * BLOCK_N)
    # KEYS_IN_RANGE_CAUSAL: a key block is seen by every row iff its last key <= m0
    full_hi = tl.where(structure == 2, tl.minimum(full_hi, ((m0 + 1) // BLOCK_N) * BLOCK_N),
                       full_hi)
    a_end = tl.maximum(tl.minimum(full_lo, hi2), lo1)
    b_end = tl.maximum(full_hi, a_end)
    return a_end, b_end


@triton.jit
def unmasked_query_blocks_of_range(m_lo, m_mid, m_hi, n0, first, end, structure, L,
                                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For a mask applied from indices, after row_loops_within_mask: where a key block's
    query loop [m_lo, m_hi) can drop the mask. A key block wholly inside [first, end) is
    seen by every query block past the diagonal (past m_mid, or with the causal mask folded
    in, past the first one below the block's last key); one holding an end of the range
    needs the mask on every query block."""
    inside = (n0 >= first) & (n0 + BLOCK_N <= end)
    _, causal_start = row_blocks_of_key_block(n0, L, BLOCK_M, BLOCK_N, True)
    split = tl.where(structure == 2, tl.maximum(m_mid, causal_start), m_mid)
    split = tl.where(inside, split, m_hi)
    return tl.minimum(tl.maximum(split, m_lo), m_hi)


# Where a loop's apply_mask_tile takes the mask from (its SOURCE), fixed per loop (a per-tile
# branch in the loop body cost the masked forward ~40 % of its time: benchmarks/README.md,
# "Masks"): no mask at all (a loop over blocks every row sees), from indices (a key range's
# edge blocks), or read from the mask tensor
NO_MASK_SOURCE = tl.constexpr(0)
MASK_FROM_INDICES = tl.constexpr(1)
MASK_READ = tl.constexpr(2)


# A masked kernel runs as two launches, one per MASK_PATH: INDICES_PATH takes the
# (batch, head)s whose mask applies from indices (two loops: the key blocks wholly inside
# its range, without a mask, and those holding its ends or the diagonal), READ_PATH those
# whose mask is read per tile; a program of the other kind leaves at once (the host does not
# know the summary: it is made on the device without a synchronization). One kernel holding
# both kinds of loops needed far more registers than either, as if each loop's values were
# live for all: the masked forward at 128 x 64 took 191 registers per thread against 120
# unmasked (half the occupancy), the BoB row pass spilled 936 bytes per thread against 152.
NO_MASK_PATH = tl.constexpr(0)
INDICES_PATH = tl.constexpr(1)
READ_PATH = tl.constexpr(2)


@triton.jit
def mask_from_indices(structure):
    """Whether a (batch, head)'s mask applies from indices (KEYS_IN_RANGE[_CAUSAL])."""
    return (structure == 1) | (structure == 2)


@triton.jit
def on_mask_path(structure, MASK_PATH: tl.constexpr):
    """Whether a (batch, head) with this summary structure is this launch's (MASK_PATH)."""
    if MASK_PATH == INDICES_PATH:
        return mask_from_indices(structure)
    else:
        return mask_from_indices(structure) == 0


@triton.jit
def group_on_mask_path(summary_ptr, srh, sre, kv_group, MASK_PATH: tl.constexpr):
    """For a key-block-major program, which handles every query head of a key/value head:
    the group is INDICES_PATH's when each of its heads' masks applies from indices, else
    READ_PATH's (reading a mask is right for any structure)."""
    read = tl.zeros([], tl.int32)
    for g in range(0, kv_group):
        structure = tl.load(summary_ptr + g * srh + 2 * sre)
        read += on_mask_path(structure, READ_PATH).to(tl.int32)
    if MASK_PATH == INDICES_PATH:
        return read == 0
    else:
        return read > 0


@triton.jit
def apply_mask_tile(s2, mask_base, offs_m, offs_n, sml, sms, L, S, first, end, structure,
                    MASK_KIND: tl.constexpr, TRANSPOSED: tl.constexpr, SOURCE: tl.constexpr):
    """Base-2 scores s2 ([M, N], or [N, M] when TRANSPOSED) with the mask applied as
    AttentionParams defines it: bool False hides the pair; an additive value is added
    (times log2 e), and one at or below -1e4 (HIDDEN_AT_OR_BELOW) hides the pair. Where the
    (batch, head)'s mask is a key range [first, end) (with key <= query for
    KEYS_IN_RANGE_CAUSAL), from indices (SOURCE MASK_FROM_INDICES); else from a tile of the
    mask (MASK_READ), pairs outside [0, L) x [0, S) reading as hidden."""
    if SOURCE == MASK_FROM_INDICES:
        s2 = _mask_from_indices(s2, offs_m, offs_n, first, end, structure, TRANSPOSED)
    else:
        s2 = _read_mask(s2, mask_base, offs_m, offs_n, sml, sms, L, S, MASK_KIND, TRANSPOSED)
    return s2


@triton.jit
def _mask_from_indices(s2, offs_m, offs_n, first, end, structure, TRANSPOSED: tl.constexpr):
    if TRANSPOSED:
        keys, rows = offs_n[:, None], offs_m[None, :]
    else:
        keys, rows = offs_n[None, :], offs_m[:, None]
    in_range = (keys >= first) & (keys < end) & ((structure == 1) | (keys <= rows))
    return tl.where(in_range, s2, float("-inf"))


@triton.jit
def _read_mask(s2, mask_base, offs_m, offs_n, sml, sms, L, S, MASK_KIND: tl.constexpr,
               TRANSPOSED: tl.constexpr):
    if TRANSPOSED:
        ptrs = mask_base + offs_n[:, None] * sms + offs_m[None, :] * sml
        inside = (offs_n[:, None] < S) & (offs_m[None, :] < L)
    else:
        ptrs = mask_base + offs_m[:, None] * sml + offs_n[None, :] * sms
        inside = (offs_m[:, None] < L) & (offs_n[None, :] < S)
    if MASK_KIND == 1:
        visible = tl.load(ptrs, mask=inside, other=0) != 0
        s2 = tl.where(visible, s2, float("-inf"))
    if MASK_KIND == 2:
        bias = tl.load(ptrs, mask=inside, other=float("-inf")).to(tl.float32)
        s2 = tl.where(bias <= -1e4, float("-inf"), s2 + bias * 1.4426950408889634)
    return s2


# --------------------------------------------------------------------------------------
# Launch configurations: a few candidates per kernel, timed once per shape bucket and
# remembered in a JSON file so that later processes skip the timing.
# --------------------------------------------------------------------------------------
def interpreting():
    return settings.current().interpret


def _patch_interpreter_scalar_index():
    """Triton 3.6's interpreter keeps scalars as 1-element arrays and turns them into loop
    bounds with int(array), which NumPy >= 2.4 refuses for 1-D arrays; loops whose bounds
    are computed in the kernel then fail. Read the single element instead."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_bob_compile_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._bob_compile_patched = True
    interpreter._patch_lang_tensor = patched


if interpreting():
    _patch_interpreter_scalar_index()


def row_bytes(dtype, head_dim, head_dim_v):
    """Bytes of one row of the widest operand tile: what bounds the block sizes that fit
    in shared memory (228 KiB per program on Hopper)."""
    return dtype.itemsize * padded_dim(max(head_dim, head_dim_v))


def wide_candidates(nbytes, column):
    """Small, single-stage tiles for wide rows (fp32 inputs, head dims above 64/128):
    a row-major program keeps ~3 tiles of its rows and streams ~4 of the other side; a
    column program keeps 4 key-side tiles resident, so its query blocks stay at 16."""
    if nbytes <= 256:
        return ([dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2),
                 dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=1)] if column else
                [dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
                 dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2)])
    if nbytes <= 512:
        return ([dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)] if column else
                [dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1),
                 dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)])
    return [dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)]


# Timing candidates costs a few runs of each; above this many (query, key) pairs per head
# that would take minutes, so longer problems reuse the decision of the largest tuned
# bucket (measured on the H200: the best configs no longer change from 16K on).
TUNE_MAX_PAIRS = 16384 * 16384


def length_bucket(n):
    """Lengths that share tuning decisions: powers of two from 1K up to 16K."""
    return min(max(1 << (max(n, 1) - 1).bit_length(), 1024), 16384)   # next power of 2


class TuningCache:
    """Remembers the fastest launch config per key, in memory and in a small JSON file.

    `chosen` holds the final LaunchPlan per launch site and bucket (`launch_plan`): the
    per-call lookup, without building the string key or locking."""

    def __init__(self):
        root = settings.current().cache_dir
        self.path = os.path.join(root, "triton_attention_configs.json")
        self.lock = threading.Lock()
        self.entries = None
        self.chosen = {}

    def _load(self):
        if self.entries is None:
            try:
                with open(self.path) as f:
                    self.entries = json.load(f)
            except (OSError, ValueError):
                self.entries = {}
        return self.entries

    def get(self, key):
        with self.lock:
            return self._load().get(key)

    def put(self, key, config):
        with self.lock:
            entries = self._load()
            entries[key] = config
            try:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                tmp = f"{self.path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(entries, f, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
            except OSError:
                pass  # a read-only home only costs re-tuning in the next process


TUNING_CACHE = TuningCache()


@settings.on_reload
def _forget_choices(_settings):
    TUNING_CACHE.chosen.clear()   # BOB_COMPILE_TUNE may have changed


def tuning_enabled():
    return settings.current().tune


class Untimed(list):
    """Candidates that are not timed: the first that builds for the device is the choice.
    For launch sites whose first config won when measured through the whole step, where a
    tuner timing the launch alone picks among them by noise; the others are there for
    devices on which the first does not build."""


_builds = {}    # (tuning key, config) -> whether its kernel built and launched on the device


def _capturing():
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _first_that_builds(key, candidates, run):
    """The first candidate whose kernel builds for the device. The lists' first configs are
    sized for the H200; on a device with less shared memory (an A100 has 163 KiB, consumer
    GPUs about 100) an untimed choice must still launch. Each candidate is launched once
    per key to find out, as tuning would (the launch sites compute their plans before
    their real launches, so an extra launch changes no result); if none but the last
    builds, the last is the choice and its launch raises Triton's error. While a CUDA graph
    is being captured nothing extra is launched (it would be captured, and replayed every
    time): the first candidate stands."""
    if len(candidates) == 1 or interpreting() or _capturing():
        return candidates[0]
    for config in candidates[:-1]:
        memo = (key, tuple(sorted(config.items())))
        builds = _builds.get(memo)
        if builds is None:
            try:
                run(config)
                builds = True
            except BUILD_ERRORS as e:
                log.info("launch config %s of %s does not build on this device: %s",
                         config, key, error_summary(e))
                builds = False
            _builds[memo] = builds
        if builds:
            return config
    return candidates[-1]


def choose_config(key, candidates, run, pairs=0):
    """The fastest of `candidates` for `key`; `run(config)` launches the kernel once.

    Without tuning (interpreter, BOB_COMPILE_TUNE=0, one candidate, an `Untimed` list, or a
    problem of more than TUNE_MAX_PAIRS (query, key) pairs per head with no decision cached
    yet) the first candidate that builds for the device is the choice, so the candidate
    lists put the measured best default first.
    """
    return _choose_config(key, candidates, run, pairs)[0]


def _choose_config(key, candidates, run, pairs, has_work=None):
    """(config, final): final is False for the provisional first candidate of a problem too
    large to tune, which a later tuned decision for the same key replaces. has_work: for a
    launch whose work depends on data (a masked kernel's MASK_PATH, one of whose two
    launches may have nothing to do), whether this one has any; where not, timing would
    choose by noise (measured: the noise choices cost a mask read per tile 8 % over its
    default configs), so the first candidate stands, and is not written to the file."""
    if len(candidates) == 1 or isinstance(candidates, Untimed) or not tuning_enabled():
        return _first_that_builds(key, candidates, run), True
    known = TUNING_CACHE.get(key)
    if known is not None and known in candidates:
        return known, True
    if pairs > TUNE_MAX_PAIRS:
        return _first_that_builds(key, candidates, run), False
    if has_work is not None and not has_work():
        return _first_that_builds(key, candidates, run), True
    best, best_ms = candidates[0], math.inf
    for config in candidates:
        try:
            ms = triton.testing.do_bench(lambda: run(config), warmup=3, rep=12,
                                         return_mode="median")
        except Exception as e:  # e.g. out of shared memory for this block shape
            log.info("launch config %s of %s is not a candidate: %s", config, key,
                     error_summary(e))
            continue
        if ms < best_ms:
            best, best_ms = config, ms
    TUNING_CACHE.put(key, best)
    return best, True


_device_names = {}


def device_name(device):
    """torch.cuda.get_device_name, asked once per device ("cpu" for other devices)."""
    if device.type != "cuda":
        return "cpu"
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = _device_names.get(index)
    if name is None:
        name = _device_names[index] = torch.cuda.get_device_name(index)
    return name


def tuning_key(kernel, q, k, v, causal, *flags):
    return "|".join(str(x) for x in (
        kernel, device_name(q.device), q.dtype,
        q.shape[-1], v.shape[-1], causal, length_bucket(q.shape[-2]), length_bucket(k.shape[-2]),
        *flags))


# --------------------------------------------------------------------------------------
# Launching: what is fixed per launch site and bucket is worked out once
# --------------------------------------------------------------------------------------
# A launch through JITFunction.run binds and specializes every argument (up to 64 here),
# hashes the result to find the compiled kernel, then launches. Even a CompiledKernel's own
# launch (`compiled[grid](*args)`) asks for the current device and stream, builds launch
# metadata for hooks, calls two (empty) Python hook chains from C, and for each tensor
# calls its data_ptr() method and asks the driver to validate the pointer
# (cuPointerGetAttribute): 15 us per launch on the H200's host, against 6.4 us for the C
# launcher called directly, more than the kernel itself at short lengths
# (benchmarks/README.md, host overhead).
#
# The specialization depends only on: each tensor's dtype and whether its address is
# 16-byte aligned, each int's value (== 1 becomes a constant, multiples of 16 are marked,
# the width is 32 or 64 bit), the constexprs and options, and the current device.
# LaunchPlan keys the compiled kernel on exactly those properties (ints by value), so a
# later launch that specializes the same way goes straight to that kernel's C launcher
# with the tensors' addresses as integers, the current stream, and no hooks, as inductor
# launches its kernels. Anything else (a new specialization, a Triton launch hook set by
# a profiler such as proton, a kernel that needs scratch memory, a launcher of another
# shape) takes Triton's own path.
_MAX_SPECIALIZATIONS = 64   # per plan; varying lengths would otherwise grow it forever
_OPTIONS = ("num_warps", "num_stages", "maxnreg")


def _current_device():
    return torch._C._cuda_getDevice()


def _layout(args):
    """(number of tensors, number of ints) when args are tensors, then Python ints, then
    Python floats, as at every launch site here; None otherwise (no fast path)."""
    n = len(args)
    nt = 0
    while nt < n and isinstance(args[nt], torch.Tensor):
        nt += 1
    ni = nt
    while ni < n and type(args[ni]) is int:
        ni += 1
    if any(type(a) is not float for a in args[ni:]):
        return None
    return nt, ni - nt


try:
    from triton import knobs as _knobs
    from triton.knobs import HookChain as _HookChain
except ImportError:  # an older Triton: hooks cannot be inspected, so never skip them
    _knobs = _HookChain = None


def _no_launch_hooks():
    """True when no Triton launch hook is set (then the C launcher need not call any)."""
    if _knobs is None:
        return False
    runtime = _knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and not (type(hook) is _HookChain and not hook.calls):
            return False
    return True


class DirectLaunch:
    """A compiled kernel's C launcher entry point, with what it needs besides the arguments
    (the loaded function, its packed metadata, the launch flags). `of(compiled)` is None
    when the kernel cannot be launched this way (scratch memory, an unknown launcher)."""
    __slots__ = ("compiled", "launch", "function", "metadata", "cooperative", "pdl")

    def __init__(self, compiled, launcher):
        self.compiled = compiled
        self.launch = launcher.launch
        self.function = compiled.function
        self.metadata = compiled.packed_metadata
        self.cooperative = launcher.launch_cooperative_grid
        self.pdl = launcher.launch_pdl

    @classmethod
    def of(cls, compiled):
        try:
            launcher = compiled.run     # loads the kernel's handles if not done yet
            if launcher.global_scratch_size or launcher.profile_scratch_size:
                return None
            return cls(compiled, launcher)
        except AttributeError:
            return None



def _raw_stream(device):
    return torch._C._cuda_getCurrentRawStream(device)


# --------------------------------------------------------------------------------------
# Arguments by name
# --------------------------------------------------------------------------------------
# Launch sites pass a kernel's tensors and scalars by name; the four strides of each
# (B, H, N, X) operand are derived from the tensor itself. Each kernel declares, once,
# which tensor parameter each group of four stride parameters belongs to
# (`strides_of(kernel, Q="sq", ...)`: the parameters sqb, sqh, sql|sqn, sqe are Q's
# strides), and gets a packer: a function of its tensors and scalars by keyword only that
# returns every runtime argument in the kernel's order. It is generated code, so Python's
# own binding checks the names (a missing, unexpected or misspelled one is a TypeError that
# names it), for 1.6 us more per launch than positional arguments (3.2 against 1.6 us for
# the BoB row kernel's 51 arguments on a 2-core CI-class CPU).
_packers = {}
_stride_owners = {}     # kernel -> {stride parameter: (its tensor parameter, dimension)}


def _runtime_parameter_names(kernel):
    """The names of the kernel's non-constexpr parameters, in order (a JITFunction lists
    its params; under TRITON_INTERPRET=1 the kernel is an InterpretedFunction, whose
    Python signature's annotations say which parameters are constexprs)."""
    params = getattr(kernel, "params", None)
    if params is not None:
        return [p.name for p in params if not p.is_constexpr]
    return [name for name, p in inspect.signature(kernel.fn).parameters.items()
            if not (p.annotation is tl.constexpr or p.annotation == "tl.constexpr")]


def strides_of(kernel, **groups):
    """Declare kernel's stride parameters: tensor parameter name -> stride prefix (see
    above); make its packer. Returns the kernel."""
    names = _runtime_parameter_names(kernel)
    owner = {}
    for tensor, prefix in groups.items():
        row = "l" if f"{prefix}l" in names else "n"
        for dim, suffix in enumerate(("b", "h", row, "e")):
            name = prefix + suffix
            if name not in names or tensor not in names:
                raise ValueError(f"{kernel.fn.__name__}: no parameter {name!r} or {tensor!r}")
            owner[name] = f"_{tensor}[{dim}]"
            _stride_owners.setdefault(kernel, {})[name] = (tensor, dim)
    given = [n for n in names if n not in owner]
    strides = "".join(f"    _{tensor} = {tensor}.stride()\n" for tensor in groups)
    body = ", ".join(owner.get(n, n) for n in names)
    namespace = {}
    exec(f"def {kernel.fn.__name__}(*, {', '.join(given)}):\n{strides}    return ({body},)\n",
         namespace)
    _packers[kernel] = namespace[kernel.fn.__name__]
    return kernel


def packer(kernel):
    """The function that packs kernel's runtime arguments from its tensors and scalars by
    name (declared with strides_of)."""
    return _packers[kernel]


def runtime_parameters(kernel):
    """(names of kernel's runtime parameters in order, {stride parameter: (tensor parameter,
    dimension)}) as strides_of declared them."""
    return _runtime_parameter_names(kernel), _stride_owners.get(kernel, {})


# --------------------------------------------------------------------------------------
# Recording launches (the C++ node's plans of the BoB: bob_compile/native_node.py)
# --------------------------------------------------------------------------------------
class Recording:
    """What ran inside `recording()` on this thread: `launches`, one (kernel, grid, args,
    direct, kept) per LaunchPlan launch (args: the runtime arguments in the kernel's order;
    direct: the DirectLaunch the launch went through, None where it took another path;
    kept: whether the plan is a remembered one, not a provisional choice), and `tensors`,
    the tensors a launch site named with note_tensors."""
    __slots__ = ("launches", "tensors")

    def __init__(self):
        self.launches, self.tensors = [], {}


class _RecordingState(threading.local):
    record = None


_recording = _RecordingState()


class recording:
    """Context manager: records this thread's launches into the Recording it returns."""

    def __enter__(self):
        self.previous, _recording.record = _recording.record, Recording()
        return _recording.record

    def __exit__(self, *exc):
        _recording.record = self.previous


def note_tensors(**tensors):
    """Name tensors a launch site made (its outputs, its scratch) for a recording, if any."""
    record = _recording.record
    if record is not None:
        record.tensors.update(tensors)


class LaunchPlan:
    """One launch site at one tuning bucket: `kwargs` (constexprs, BLOCK_M/BLOCK_N,
    num_warps, num_stages) and the compiled kernels seen so far, by specialization.

    plan(kernel, grid, **args) is kernel[grid](**args, **plan.kwargs): args are the
    kernel's tensors and scalars by name, its strides derived from the tensors (see
    "Arguments by name"), and grid has two dimensions. The key of a compiled
    kernel is what Triton specializes on (see above): the current device, the ints by
    value, each tensor's dtype and 16-byte alignment; floats are passed as fp32 and never
    specialized."""
    __slots__ = ("kwargs", "kept", "_compiled", "_constexprs", "_layout")

    def __init__(self, kwargs):
        self.kwargs = kwargs
        self.kept = False         # remembered per site and bucket (launch_plan, fixed_plan)
        self._compiled = {}       # key -> DirectLaunch, or CompiledKernel where it cannot
        self._constexprs = None   # their values in the kernel's parameter order; False: none
        self._layout = None       # (tensors, ints) among the runtime arguments; False: none

    def __call__(self, kernel, grid, **named):
        self.launch(kernel, grid, *_packers[kernel](**named))

    def launch(self, kernel, grid, *args):
        """plan(...) with the runtime arguments already in the kernel's order."""
        if not settings.current().fast_launch:   # off in the interpreter
            kernel[grid](*args, **self.kwargs)
            return
        record = _recording.record
        if record is not None:      # launch as usual, then record what the launch went through
            _recording.record = None
            try:
                self.launch(kernel, grid, *args)
            finally:
                _recording.record = record
            record.launches.append((kernel, grid, args, self._direct_launch(args), self.kept))
            return
        layout = self._layout
        if layout:
            # the hot path: inlined (a Python call costs ~0.5 us on a server's host)
            nt, ni = layout
            pointers = [t.data_ptr() for t in args[:nt]]
            aligned = 0
            for p in pointers:
                aligned = aligned + aligned + (p % 16 == 0)
            device = _current_device()
            key = (device, args[nt:nt + ni], tuple([t.dtype for t in args[:nt]]), aligned)
            entry = self._compiled.get(key)
            floats = True
            for a in args[nt + ni:]:
                if type(a) is not float:
                    floats = False
                    break
            if entry is not None and floats:
                if type(entry) is DirectLaunch and _no_launch_hooks():
                    try:
                        entry.launch(grid[0], grid[1], 1, _raw_stream(device), entry.function,
                                     entry.cooperative, entry.pdl, None, None, entry.metadata,
                                     None, None, None, *pointers, *args[nt:], *self._constexprs)
                        return
                    except TypeError:
                        # the launcher parses its arguments before launching: one with
                        # another calling convention launches nothing and raises here;
                        # this kernel takes Triton's path from now on
                        self._compiled[key] = entry = entry.compiled
                # CompiledKernel[grid] takes every parameter positionally, constexprs
                # included (their values are not passed to the GPU), and a 3-D grid
                compiled = entry.compiled if type(entry) is DirectLaunch else entry
                compiled[(*grid, 1)](*args, *self._constexprs)
                return
        compiled = kernel[grid](*args, **self.kwargs)   # Triton's path (compiles if new)
        if layout is None:   # first launch: may this site take the fast path at all?
            fits = self._constexpr_values(kernel, len(args))
            self._layout = layout = (_layout(args) or False) if fits else False
            if layout:
                nt = layout[0]
                pointers = [t.data_ptr() for t in args[:nt]]
                device = _current_device()
                key = self._key(args, layout, pointers, device)
        if layout and isinstance(compiled, _CompiledKernel):
            if len(self._compiled) >= _MAX_SPECIALIZATIONS:
                self._compiled.clear()
            self._compiled[key] = DirectLaunch.of(compiled) or compiled

    def _direct_launch(self, args):
        """The DirectLaunch a launch with these arguments takes, or None where it takes
        another path."""
        if not (self._layout and self._constexprs not in (None, False) and _no_launch_hooks()):
            return None
        nt = self._layout[0]
        key = self._key(args, self._layout, [t.data_ptr() for t in args[:nt]], _current_device())
        entry = self._compiled.get(key)
        return entry if type(entry) is DirectLaunch else None

    @staticmethod
    def _key(args, layout, pointers, device):
        """The key of a compiled kernel (the hot path in `launch` computes it inline)."""
        nt, ni = layout
        aligned = 0
        for p in pointers:
            aligned = aligned + aligned + (p % 16 == 0)
        return (device, args[nt:nt + ni], tuple([t.dtype for t in args[:nt]]), aligned)

    def _constexpr_values(self, kernel, num_args):
        """Whether args + kwargs fill the kernel's parameters as runtime arguments followed
        by constexprs (true for every kernel here); remembers the constexprs' values."""
        if self._constexprs is None:
            params = kernel.params
            tail = params[num_args:]
            names = {p.name for p in tail}
            fits = (all(not p.is_constexpr for p in params[:num_args])
                    and all(p.is_constexpr and p.name in self.kwargs for p in tail)
                    and all(k in names or k in _OPTIONS for k in self.kwargs))
            self._constexprs = tuple(self.kwargs[p.name] for p in tail) if fits else False
        return self._constexprs is not False


try:
    from triton.compiler import CompiledKernel as _CompiledKernel
except ImportError:  # a Triton without it: every launch takes Triton's path
    class _CompiledKernel:
        pass


def _plan_of(constexprs, cfg):
    """The LaunchPlan of a candidate config (BLOCK_M, BLOCK_N, num_warps, num_stages, and
    optionally maxnreg: a bound on registers per thread)."""
    return LaunchPlan(dict(constexprs, **{name: cfg[name] for name in
                                          ("BLOCK_M", "BLOCK_N", *_OPTIONS) if name in cfg}))


def launch_plan(kernel, q, k, v, causal, flags, candidates, constexprs, launch, pairs,
                has_work=None):
    """The LaunchPlan of one launch site: `constexprs()` plus the chosen config's BLOCK_M,
    BLOCK_N, num_warps and num_stages. Chosen (tuned, or read from the tuning cache) on the
    first call per (kernel, device, dtype, head dims, causal, flags, length buckets) and
    then remembered, so that later calls skip the candidate lists, the string key and the
    lock: one dict lookup. `candidates()` returns the candidate configs, `launch(plan)`
    launches once (timed while tuning); flags are the extra parts of `tuning_key`, whose
    persistent keys stay as they were; has_work: see _choose_config."""
    chosen = TUNING_CACHE.chosen
    memo = (kernel, q.device, q.dtype, q.shape[-1], v.shape[-1], causal, flags,
            length_bucket(q.shape[-2]), length_bucket(k.shape[-2]))
    plan = chosen.get(memo)
    if plan is not None:
        return plan
    fixed = constexprs()

    def as_plan(cfg):
        return _plan_of(fixed, cfg)

    cfg, final = _choose_config(tuning_key(kernel, q, k, v, causal, *flags), candidates(),
                                lambda c: launch(as_plan(c)), pairs, has_work)
    plan = as_plan(cfg)
    if final:
        chosen[memo] = plan
        plan.kept = True
    return plan


def read_path_first(candidates, best):
    """The candidates with `best` first: the read path's measured best, where it is one."""
    return [best] + [c for c in candidates if c != best] if best in candidates else candidates


_fixed_plans = {}


def fixed_plan(key, kwargs):
    """The LaunchPlan of a launch site without tuning (kwargs() is called once per key)."""
    plan = _fixed_plans.get(key)
    if plan is None:
        plan = _fixed_plans[key] = LaunchPlan(kwargs())
        plan.kept = True
    return plan
