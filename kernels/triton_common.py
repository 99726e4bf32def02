"""Pieces shared by the Triton attention kernels: tile loads, causal bounds, launch configs.

Conventions used by every kernel in `triton_forward`, `triton_backward` and `triton_bob`:
- one program owns one block of query rows (a "row" kernel) or one block of key columns
  (a "column" kernel) of one (batch, head);
- scores are kept in base 2: s2 = (q . k) * scale * log2(e), and the saved natural-log lse
  is loaded as lse2 = lse * log2(e), so P = exp2(s2 - lse2) costs one FMA and one EX2;
- query rows past L load lse2 = +inf, which makes their P exactly 0 without a mask;
- key columns past S and causal (j > i) pairs are masked only in the few "edge" blocks;
  the loops over the interior blocks carry no mask at all (constexpr MASKED=False).
"""
import json
import math
import os
import threading

import torch
import triton
import triton.language as tl

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


def padded_dim(d):
    """Head dims are tiled by the next power of two (>= 16, the smallest tl.dot size)."""
    return max(16, triton.next_power_of_2(d))


def strides4(t):
    """The four strides of a (B, H, N, E) tensor, as kernel arguments."""
    return (t.stride(0), t.stride(1), t.stride(2), t.stride(3))


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
# Launch configurations: a few candidates per kernel, timed once per shape bucket and
# remembered in a JSON file so that later processes skip the timing.
# --------------------------------------------------------------------------------------
def interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
    return torch.tensor([], dtype=dtype).element_size() * padded_dim(max(head_dim, head_dim_v))


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
    return min(max(triton.next_power_of_2(max(n, 1)), 1024), 16384)


class TuningCache:
    """Remembers the fastest launch config per key, in memory and in a small JSON file."""

    def __init__(self):
        root = os.environ.get("BOB_COMPILE_CACHE_DIR",
                              os.path.join(os.path.expanduser("~"), ".cache", "bob_compile"))
        self.path = os.path.join(root, "triton_attention_configs.json")
        self.lock = threading.Lock()
        self.entries = None

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


def tuning_enabled():
    return os.environ.get("BOB_COMPILE_TUNE", "1") != "0" and not interpreting()


def choose_config(key, candidates, run, pairs=0):
    """The fastest of `candidates` for `key`; `run(config)` launches the kernel once.

    Without tuning (interpreter, BOB_COMPILE_TUNE=0, one candidate, or a problem of more
    than TUNE_MAX_PAIRS (query, key) pairs per head with no decision cached yet) the first
    candidate is the choice, so the candidate lists put the measured best default first.
    """
    if len(candidates) == 1 or not tuning_enabled():
        return candidates[0]
    known = TUNING_CACHE.get(key)
    if known is not None and known in candidates:
        return known
    if pairs > TUNE_MAX_PAIRS:
        return candidates[0]
    best, best_ms = candidates[0], math.inf
    for config in candidates:
        try:
            ms = triton.testing.do_bench(lambda: run(config), warmup=3, rep=12,
                                         return_mode="median")
        except Exception:  # e.g. out of shared memory for this block shape: not a candidate
            continue
        if ms < best_ms:
            best, best_ms = config, ms
    TUNING_CACHE.put(key, best)
    return best


def tuning_key(kernel, q, k, v, causal, *flags):
    return "|".join(str(x) for x in (
        kernel, torch.cuda.get_device_name(q.device) if q.is_cuda else "cpu", q.dtype,
        q.shape[-1], v.shape[-1], causal, length_bucket(q.shape[-2]), length_bucket(k.shape[-2]),
        *flags))
