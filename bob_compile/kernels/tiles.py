"""Pieces shared by the Triton attention kernels on the device: tile loads, causal bounds,
mask tiles, and the host helpers that size them.

Conventions used by every kernel in `triton_forward`, `triton_backward` and `triton_bob`:
- one program owns one block of query rows (a "row" kernel) or one block of key columns
  (a "column" kernel) of one (batch, head);
- scores are kept in base 2: s2 = (q . k) * scale * log2(e), and the saved natural-log lse
  is loaded as lse2 = lse * log2(e), so P = exp2(s2 - lse2) costs one FMA and one EX2;
- query rows past L load lse2 = +inf, which makes their P exactly 0 without a mask;
- key columns past S and causal (j > i) pairs are masked only in the few "edge" blocks;
  the loops over the interior blocks carry no mask at all (constexpr MASKED=False).
Launch configs are chosen in tuning.py, launched through launching.py.
"""
import torch
import triton
import triton.language as tl

# exp(x) = exp2(x * log2(e)); the kernels work in base 2 because EX2 is one instruction.
LOG2E = 1.4426950408889634


def dot_precision(dtype):
    """Triton's dot mode for this input dtype.

    float32 inputs must not silently drop to tf32 (3e-4 relative error, 100x PyTorch's own
    float32 error): "tf32x3" splits each operand into two tf32 halves and keeps ~fp32 accuracy
    on the tensor cores. Half inputs use the plain tensor-core path ("ieee" is a no-op there).
    """
    return "tf32x3" if dtype == torch.float32 else "ieee"


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
def add_score_tile(base, value, offs_rows, offs_cols, stride_rows, stride_cols, num_rows,
                   num_cols):
    """Add a score-shaped tile (a learned bias's cotangent, fp32) into an (L, S) buffer by
    atomics: the buffer's broadcast dims have stride 0, so programs of several (batch,
    head)s add into the same elements."""
    ptrs = base + offs_rows[:, None] * stride_rows + offs_cols[None, :] * stride_cols
    tl.atomic_add(ptrs, value, mask=(offs_rows[:, None] < num_rows)
                  & (offs_cols[None, :] < num_cols), sem="relaxed")


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
def _ranges_at(ranges_ptr, sre, offs, n):
    """The (first, end) pairs at offs of a list of n (KEY_RANGE's per-row or per-column
    ranges, triton_masks.py); past n: (2^31 - 1, 0), nothing."""
    inside = offs < n
    firsts = tl.load(ranges_ptr + 2 * offs * sre, mask=inside, other=2147483647)
    ends = tl.load(ranges_ptr + (2 * offs + 1) * sre, mask=inside, other=0)
    return firsts, ends


@triton.jit
def key_intervals_of_rows(summary_ptr, sre, offs_m, L):
    """Per query row of offs_m, the keys [first, end) it sees (exactly those on the
    INDICES_PATH: mask_from_indices)."""
    return _ranges_at(summary_ptr + 3 * sre, sre, offs_m, L)


@triton.jit
def query_intervals_of_keys(summary_ptr, sre, offs_n, L, S):
    """Per key of offs_n, the queries [first, end) that see it (exactly those on the
    INDICES_PATH)."""
    return _ranges_at(summary_ptr + (3 + 2 * L) * sre, sre, offs_n, S)


@triton.jit
def key_loops_within_mask(lo1, hi1, lo2, hi2, m0, summary_ptr, sre, L, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    """A row-block-major kernel's two key loops [lo1, hi1) and [lo2, hi2) (lo1, lo2
    multiples of BLOCK_N) for rows [m0, m0 + BLOCK_M), restricted to the key blocks holding
    keys these rows see (KEY_RANGE's per-row ranges, triton_masks.py: a padded batch's
    visible keys, a sliding window's, a packed document's, none above the diagonal of a
    causal mask); then those per-row ranges (key_intervals_of_rows), which the INDICES_PATH
    applies."""
    firsts, ends = key_intervals_of_rows(summary_ptr, sre, m0 + tl.arange(0, BLOCK_M), L)
    seen_first = tl.min(firsts, 0)
    seen_end = tl.max(ends, 0)
    block_of_first = (seen_first // BLOCK_N) * BLOCK_N
    return (tl.maximum(lo1, block_of_first), tl.minimum(hi1, seen_end),
            tl.maximum(lo2, block_of_first), tl.minimum(hi2, seen_end), firsts, ends)


@triton.jit
def row_loops_within_mask(m_lo, m_mid, m_hi, n0, summary_ptr, sre, L, S, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    """A key-block-major kernel's two query loops [m_lo, m_mid) and [m_mid, m_hi) for keys
    [n0, n0 + BLOCK_N), restricted to the query blocks that see these keys (KEY_RANGE's
    per-key ranges): none when the mask hides every key of the block; then those per-key
    ranges (query_intervals_of_keys), which the INDICES_PATH applies."""
    firsts, ends = query_intervals_of_keys(summary_ptr, sre, n0 + tl.arange(0, BLOCK_N), L, S)
    seen_first = tl.minimum(tl.min(firsts, 0), L)
    seen_end = tl.max(ends, 0)
    m_lo = tl.maximum(m_lo, (seen_first // BLOCK_M) * BLOCK_M)
    m_hi = tl.maximum(tl.minimum(m_hi, seen_end), m_lo)
    m_mid = tl.minimum(tl.maximum(m_mid, m_lo), m_hi)
    return m_lo, m_mid, m_hi, firsts, ends


@triton.jit
def unmasked_key_blocks(lo1, hi1, hi2, firsts, ends, offs_m, L, BLOCK_N: tl.constexpr):
    """On the INDICES_PATH, after key_loops_within_mask, with the rows' key intervals
    (key_intervals_of_rows): (a_end, b_end) splitting a row block's visible key blocks
    [lo1, hi2) into [lo1, a_end), blocks holding some row's first key; [a_end, b_end),
    blocks every row of the block sees whole (no mask at all); and [b_end, hi2), blocks
    holding some row's end (or the diagonal). The first and last need the mask."""
    inner_first = tl.max(tl.where(offs_m < L, firsts, 0), 0)
    inner_end = tl.min(tl.where(offs_m < L, ends, 2147483647), 0)
    full_lo = ((inner_first + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    full_hi = tl.minimum(hi1, (inner_end // BLOCK_N) * BLOCK_N)
    a_end = tl.maximum(tl.minimum(full_lo, hi2), lo1)
    b_end = tl.maximum(full_hi, a_end)
    return a_end, b_end


@triton.jit
def unmasked_query_blocks(m_lo, m_mid, m_hi, firsts, ends, L, BLOCK_M: tl.constexpr):
    """On the INDICES_PATH, after row_loops_within_mask, with the keys' query intervals
    (query_intervals_of_keys): (a, b) such that the query blocks [a, b) see every key of
    the key block (past the diagonal's m_mid); [m_lo, a) and [b, m_hi) need the mask. A
    key past S has no queries, so a partial last key block is masked throughout (the
    atomic row outputs need its padded keys hidden)."""
    inner_first = tl.minimum(tl.max(firsts, 0), L)
    inner_end = tl.min(ends, 0)
    a = tl.maximum(((inner_first + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, m_mid)
    b = tl.where(inner_end >= L, m_hi, (inner_end // BLOCK_M) * BLOCK_M)
    a = tl.minimum(tl.maximum(a, m_lo), m_hi)
    b = tl.maximum(tl.minimum(b, m_hi), a)
    return a, b


# Where a loop's apply_mask_tile takes the mask from (its SOURCE), fixed per loop (a per-tile
# branch in the loop body cost the masked forward ~40 % of its time: docs/measurements.md,
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
    """Whether a (batch, head)'s mask applies from indices (KEYS_IN_RANGE[_CAUSAL],
    KEY_INTERVALS: triton_masks.py)."""
    return (structure == 1) | (structure == 2) | (structure == 4)


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
def apply_mask_tile(s2, mask_base, offs_m, offs_n, sml, sms, L, S, firsts, ends,
                    MASK_KIND: tl.constexpr, TRANSPOSED: tl.constexpr, SOURCE: tl.constexpr):
    """Base-2 scores s2 ([M, N], or [N, M] when TRANSPOSED) with the mask applied as
    AttentionParams defines it: bool False hides the pair; an additive value is added
    (times log2 e), and one at or below -1e4 (HIDDEN_AT_OR_BELOW) hides the pair. Where the
    (batch, head)'s mask is intervals, from indices (SOURCE MASK_FROM_INDICES): each row's
    keys [firsts, ends) (key_intervals_of_rows), or TRANSPOSED each key's queries
    (query_intervals_of_keys); else from a tile of the mask (MASK_READ; a BlockSparseMask,
    MASK_KIND 3, from its tables), pairs outside [0, L) x [0, S) reading as hidden."""
    if SOURCE == MASK_FROM_INDICES:
        if TRANSPOSED:
            other = offs_m[None, :]
        else:
            other = offs_n[None, :]
        visible = (other >= firsts[:, None]) & (other < ends[:, None])
        s2 = tl.where(visible, s2, float("-inf"))
    else:
        s2 = _read_mask(s2, mask_base, offs_m, offs_n, sml, sms, L, S, MASK_KIND, TRANSPOSED)
    return s2


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
    if MASK_KIND == 3:
        s2 = _read_block_sparse(s2, mask_base, offs_m, offs_n, L, S, TRANSPOSED)
    return s2


@triton.jit
def _read_block_sparse(s2, table, offs_m, offs_n, L, S, TRANSPOSED: tl.constexpr):
    """s2 with a BlockSparseMask applied (block_sparse_masks.py): `table` is this (batch,
    head)'s table (a uint8 pointer): log2 of block_q and of block_k (powers of two: a
    pair's block and place in it by shifts, not divisions), key_blocks, the byte offsets to
    the tiles and to the bias row, then per (query block, key block) -1 (empty), -2 (full)
    or its tile's index. Each pair reads its block's entry (one per block in cache), in a
    partial block its byte of the tile. A relative bias is not applied here: every loop adds
    it where its scores are formed (add_relative_bias), masked or not."""
    words = table.to(tl.pointer_type(tl.int32))
    shift_q = tl.load(words)
    shift_k = tl.load(words + 1)
    key_blocks = tl.load(words + 2)
    to_tiles = tl.load(words + 3)
    rows, keys = _pairs(offs_m, offs_n, TRANSPOSED)
    inside = (rows < L) & (keys < S)
    row_block = rows >> shift_q
    key_block = keys >> shift_k
    entry = tl.load(words + 6 + row_block * key_blocks + key_block, mask=inside, other=-1)
    in_tile = ((rows & ((1 << shift_q) - 1)) << shift_k) + (keys & ((1 << shift_k) - 1))
    tile = table + to_tiles + (entry.to(tl.int64) << (shift_q + shift_k)) + in_tile
    pair = tl.load(tile, mask=inside & (entry >= 0), other=0)
    visible = (entry == -2) | (pair != 0)
    return tl.where(visible, s2, float("-inf"))


@triton.jit
def _pairs(offs_m, offs_n, TRANSPOSED: tl.constexpr):
    """(query, key) indices of a tile's pairs, broadcast to [M, N] (or [N, M] TRANSPOSED)."""
    if TRANSPOSED:
        rows = offs_m[None, :]
        keys = offs_n[:, None]
    else:
        rows = offs_m[:, None]
        keys = offs_n[None, :]
    return rows, keys


@triton.jit
def add_relative_bias(s2, table, offs_m, offs_n, L, S, TRANSPOSED: tl.constexpr):
    """Base-2 scores s2 plus a BlockSparseMask's relative bias (RELATIVE: every loop of a
    kernel, masked or not, forms its scores with it; the mask itself then applies as its
    summary says, from indices where it is intervals, or read): the pair (q, k) reads q - k
    + S - 1 of this (batch, head)'s row (L + S - 1 float32 values, in cache), whose byte
    offset from `table` is the table's fifth word; a bias at or below -1e4 hides the pair,
    as an additive mask's does (params.HIDDEN_AT_OR_BELOW)."""
    to_bias = tl.load(table.to(tl.pointer_type(tl.int32)) + 4)
    bias_row = (table + to_bias).to(tl.pointer_type(tl.float32))
    rows, keys = _pairs(offs_m, offs_n, TRANSPOSED)
    bias = tl.load(bias_row + (rows - keys + S - 1), mask=(rows < L) & (keys < S), other=0.0)
    return tl.where(bias <= -1e4, float("-inf"), s2 + bias * 1.4426950408889634)
