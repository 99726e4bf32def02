"""A BlockMask without an L x S tensor (bob_compile/block_masks.py): its key intervals, the
packed form compiled graphs hand the ops, and the ops' every order with a mask given as
key intervals, in float64 on the CPU against the same mask as booleans (built here from
the patterns' definitions, or from visible_pairs, which test_flex_attention.py checks)."""
import collections
import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.func import grad, jvp, vmap
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

import bob_compile
from bob_compile import autograd, block_masks
from bob_compile.kernels import block_sparse_masks
from bob_compile.kernels import blockwise
from bob_compile.kernels.block_sparse_masks import BlockSparseMask
from bob_compile.kernels.interval_masks import KeyIntervals
from bob_compile.kernels.triton_masks import (KEY_INTERVALS, READ_THE_MASK, READ_THE_MASK_CAUSAL,
                                              summarize_with_torch)

BLOCK = 16

# the tile-by-tile and relative-bias routes at these small sizes (conftest.py)
pytestmark = pytest.mark.usefixtures("tiles_at_any_size")


def window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 7)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < 11) | (q_idx >= kv_idx)


def window_per_head(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 3 + 4 * h)


def dilated(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & ((q_idx - kv_idx) % 2 == 0)


def two_windows(b, h, q_idx, kv_idx):
    return (kv_idx < 3) | ((q_idx >= kv_idx) & (q_idx - kv_idx < 4))


def document_ids(batch, L, seed):
    """Sorted document ids per batch entry: packed sequences of random lengths."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 5, (batch, L), generator=g).sort(-1).values


def documents(ids, causal=True):
    """Attention inside each document of `ids` (batch, L), causal or not: reads b."""
    def document_mask(b, h, q_idx, kv_idx):
        same = ids[b, q_idx] == ids[b, kv_idx]
        return same & (q_idx >= kv_idx) if causal else same
    return document_mask


def dense(mask_mod, batch, heads, L, S):
    """The mask_mod at every pair, by broadcasting (no BlockMask)."""
    b = torch.arange(batch).view(-1, 1, 1, 1)
    h = torch.arange(heads).view(1, -1, 1, 1)
    return mask_mod(b, h, torch.arange(L).view(1, 1, -1, 1),
                    torch.arange(S).view(1, 1, 1, -1)).expand(batch, heads, L, S)


def blocks_of(mask_mod, batch, heads, L, S, block=BLOCK):
    block_mask = create_block_mask(mask_mod, batch, heads, L, S, device="cpu",
                                   BLOCK_SIZE=block)
    return block_masks.Blocks.of(block_mask)


INTERVAL_CASES = {     # name: (mask_mod, batch, heads, L, S)
    "sliding window": (window, None, None, 50, 50),
    "prefix-LM, L != S": (prefix_lm, None, None, 37, 53),
    "window per head": (window_per_head, None, 3, 41, 41),
    "causal documents per batch entry": (documents(document_ids(2, 45, 1)), 2, None, 45, 45),
    "documents, both ways": (documents(document_ids(2, 45, 2), causal=False), 2, None, 45, 45),
}


@pytest.mark.parametrize("name", list(INTERVAL_CASES))
@pytest.mark.parametrize("block", [BLOCK, 128])
def test_key_intervals_are_the_visible_pairs(name, block):
    """Rows and keys one interval each: the summary describes exactly the BlockMask's pairs
    (as KeyIntervals tiles and whole), with the summary the kernels make of the boolean mask."""
    mask_mod, batch, heads, L, S = INTERVAL_CASES[name]
    B, H = 2, 3
    blocks = blocks_of(mask_mod, batch, heads, L, S, block)
    summary = block_masks.key_intervals(blocks, L, S, "cpu", B, H)
    assert summary is not None and summary.dtype == torch.int32
    want = dense(mask_mod, B, H, L, S)
    intervals = KeyIntervals.of(summary, B, H, L, S)
    assert torch.equal(intervals.dense(), want)
    assert torch.equal(intervals[:, :, 5:33, 9:40], want[:, :, 5:33, 9:40])
    expected = summarize_with_torch(want)
    full = summary.expand(B, H, 1, -1)
    assert torch.equal(full[..., :2], expected[..., :2])
    assert torch.equal(full[..., 3:], expected[..., 3:])
    assert (full[..., 2] == KEY_INTERVALS).all()
    # O(L + S) per distinct batch entry and head: nothing L x S
    assert summary.shape[:2] == (batch or 1, heads or 1)


@pytest.mark.parametrize("mask_mod", [dilated, two_windows])
def test_masks_that_are_not_intervals_have_none(mask_mod, caplog, monkeypatch):
    """None as intervals; as tiles, and the log says once that such a BlockMask is read
    tile by tile, or, at most dense_up_to bytes, materialized."""
    monkeypatch.setattr(block_masks, "_said", set())
    blocks = blocks_of(mask_mod, None, None, 40, 40)
    assert block_masks.key_intervals(blocks, 40, 40, "cpu", 1, 1) is None
    with caplog.at_level("INFO", logger="bob_compile.flex"):
        for _ in range(2):
            tiles = block_masks.key_intervals(blocks, 40, 40, "cpu", 1, 1, tiles_otherwise=True)
            materialized = block_masks.key_intervals(blocks, 40, 40, "cpu", 1, 1,
                                                     tiles_otherwise=True, dense_up_to=1600)
    assert isinstance(tiles, BlockSparseMask)
    assert torch.equal(materialized, tiles.dense())
    for words in ("read it tile by tile", "it is materialized per call"):
        said = [r for r in caplog.records if words in r.getMessage()]
        assert len(said) == 1 and mask_mod.__name__ in said[0].getMessage()


def test_small_masks_are_materialized_by_default(monkeypatch):
    """Up to block_masks.TILES_ABOVE_BYTES (the default, 1 GiB) a mask of more than
    intervals is the bool mask (the kernels' plain read path, faster than the tiles'),
    resolved from a packed BlockMask too; a relative bias is materialized likewise."""
    from bob_compile import flex
    from bob_compile.kernels import settings
    monkeypatch.undo()            # the module's default threshold
    settings.reload()
    assert block_masks.TILES_ABOVE_BYTES == 1 << 30
    module = graph_of(dilated)
    key = block_masks.register_mask_mod(module)
    blocks = blocks_of(dilated, None, None, 40, 40)
    blocks.mask_mod = module
    resolved = block_masks.resolve(block_masks.pack(blocks, key), 1, 2, 40, 40)
    assert resolved.dtype == torch.bool and torch.equal(resolved, dense(dilated, 1, 2, 40, 40))
    form = flex.score_mod_form(lambda s, b, h, i, j: s + 0.1 * h * (j - i), torch.float32)
    assert form.relative and form.reads_head
    # relative rows only where asked for (BOB_COMPILE_DEV_RELATIVE_ROWS=1), and then only
    # beyond the threshold
    assert not flex.relative_pays(form, 1, 12, 16384, 16384, torch.bfloat16)
    monkeypatch.setenv("BOB_COMPILE_DEV_RELATIVE_ROWS", "1")
    settings.reload()
    assert not flex.relative_pays(form, 1, 12, 4096, 4096, torch.bfloat16)      # 384 MiB
    assert flex.relative_pays(form, 1, 12, 16384, 16384, torch.bfloat16)        # 6 GiB


def test_the_block_lists_decide_with_the_mask_mod():
    """A BlockMask whose lists name fewer blocks than its mask_mod's pattern (built with
    from_kv_blocks) hides the unlisted ones, as FlexAttention's kernels do: a causal
    mask_mod listed on the last two key blocks of each row block only is a sliding window
    of blocks, intervals still; with a block left out in the middle, not."""
    L, n = 64, 4
    rows = torch.arange(n)
    first = (rows - 1).clamp_min(0)
    kv_num_blocks = (rows - first + 1).view(1, 1, n).int()
    kv_indices = torch.stack([torch.arange(n) + f for f in first.tolist()]).clamp_max(n - 1)
    block_mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices.view(1, 1, n, n).int(),
                                          BLOCK_SIZE=BLOCK, mask_mod=lambda b, h, q, kv: q >= kv,
                                          seq_lengths=(L, L))
    blocks = block_masks.Blocks.of(block_mask)
    want = block_masks.visible_pairs(blocks, L, L, "cpu", 1, 1)
    assert not torch.equal(want[0, 0], dense(window, 1, 1, L, L)[0, 0].tril())  # lists matter
    summary = block_masks.key_intervals(blocks, L, L, "cpu", 1, 1)
    assert torch.equal(KeyIntervals.of(summary, 1, 1, L, L).dense(), want)
    holes = kv_indices.clone()
    holes[3, 0] = 0                       # row block 3 lists key blocks 0 and 3
    block_mask = BlockMask.from_kv_blocks(kv_num_blocks, holes.view(1, 1, n, n).int(),
                                          BLOCK_SIZE=BLOCK, mask_mod=lambda b, h, q, kv: q >= kv,
                                          seq_lengths=(L, L))
    assert block_masks.key_intervals(block_masks.Blocks.of(block_mask), L, L, "cpu", 1, 1) \
        is None


@settings(max_examples=15, deadline=None)
@given(L=st.integers(1, 70), S=st.integers(1, 70), width=st.integers(1, 80),
       block=st.sampled_from([8, 16, 32]), seed=st.integers(0, 2 ** 16))
def test_windows_and_documents_of_any_size(L, S, width, block, seed):
    ids = document_ids(1, max(L, S), seed)

    def documents_in_a_window(b, h, q_idx, kv_idx):
        return (ids[0, q_idx] == ids[0, kv_idx]) & (q_idx >= kv_idx) & (q_idx - kv_idx < width)
    blocks = blocks_of(documents_in_a_window, None, None, L, S, block)
    summary = block_masks.key_intervals(blocks, L, S, "cpu", 1, 1)
    assert summary is not None
    assert torch.equal(KeyIntervals.of(summary, 1, 1, L, S).dense(),
                       dense(documents_in_a_window, 1, 1, L, S))


@settings(max_examples=20, deadline=None)
@given(L=st.integers(1, 70), S=st.integers(1, 70), block=st.sampled_from([8, 16, 32]),
       heads=st.integers(1, 3), density=st.floats(0.0, 1.0), seed=st.integers(0, 2 ** 16))
def test_any_mask_tile_by_tile(L, S, block, heads, density, seed):
    """Random pairs (each head its own) of any lengths and block size: the tiles give the
    BlockMask's pairs, and the kernels' summary of them as the boolean mask's, whether or
    not they are intervals."""
    g = torch.Generator().manual_seed(seed)
    pairs = torch.rand(heads, L, S, generator=g) < density

    def random_pairs(b, h, q_idx, kv_idx):
        return pairs[h, q_idx, kv_idx]
    blocks = blocks_of(random_pairs, None, heads, L, S, block)
    form = block_masks.key_intervals(blocks, L, S, "cpu", 2, heads, tiles_otherwise=True)
    want = dense(random_pairs, 2, heads, L, S)
    if isinstance(form, BlockSparseMask):
        tiles = form.for_call(2, heads)
        assert torch.equal(tiles.dense(), want)
        summary, expected = tiles.kernel_summary(), summarize_with_torch(want)
        assert torch.equal(summary[..., :2], expected[..., :2])
        assert torch.equal(summary[..., 3:], expected[..., 3:])
        # read (a mask of more than intervals; every head, as the verdict is one), causal
        # where no pair is above the diagonal
        above = ~torch.ones(L, S, dtype=torch.bool).tril()
        causal = ~(want & above).flatten(2).any(-1, keepdim=True)
        assert torch.equal(summary[..., 2], torch.where(causal, READ_THE_MASK_CAUSAL,
                                                        READ_THE_MASK))
    else:
        assert torch.equal(KeyIntervals.of(form, 2, heads, L, S).dense(), want)


# ---------------------------------------------------------------------------- packed
def graph_of(mask_mod):
    """The mask_mod as the GraphModule Dynamo would record (its tensors as arguments)."""
    return torch.fx.symbolic_trace(mask_mod)


def documents_with_ids(b, h, q_idx, kv_idx, ids):
    return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)


@pytest.mark.parametrize("mask_mod,ids", [(window, None), (documents_with_ids, True),
                                          (dilated, None)])
def test_a_packed_block_mask_resolves_to_its_pairs(mask_mod, ids):
    B, H, L = 2, 3, 96
    module = graph_of(mask_mod)
    key = block_masks.register_mask_mod(module)
    buffers = (document_ids(B, L, 4),) if ids else ()
    def bound(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx, kv_idx, *buffers)
    block_mask = create_block_mask(bound, B if ids else None, None, L, L, device="cpu",
                                   BLOCK_SIZE=BLOCK)
    blocks = block_masks.Blocks.of(block_mask)
    blocks.mask_mod, blocks.mask_mod_buffers = module, buffers
    packed = block_masks.pack(blocks, key)
    assert packed.dtype == torch.uint8 and packed.dim() == 1 and packed.numel() < L * L
    resolved = block_masks.resolve(packed, B, H, L, L)
    want = dense(bound, B, H, L, L)
    if mask_mod is dilated:
        assert isinstance(resolved, BlockSparseMask) and torch.equal(resolved.dense(), want)
    else:
        assert isinstance(resolved, KeyIntervals) and torch.equal(resolved.dense(), want)
    # traced as a compiled graph traces it: no host read, nothing L x S in the graph
    traced = torch.fx.experimental.proxy_tensor.make_fx(
        lambda *lists: block_masks.pack(block_masks.Blocks(
            (L, L), (BLOCK, BLOCK), *lists, module, buffers, blocks.mask_mod_reads), key))(
        blocks.kv_num_blocks, blocks.kv_indices, blocks.full_kv_num_blocks,
        blocks.full_kv_indices)
    assert not any("nonzero" in str(n.target) or "item" in str(n.target)
                   for n in traced.graph.nodes)
    assert torch.equal(traced(blocks.kv_num_blocks, blocks.kv_indices,
                              blocks.full_kv_num_blocks, blocks.full_kv_indices), packed)


def test_resolving_refuses_what_it_cannot_name():
    blocks = blocks_of(window, None, None, 20, 20)
    module = graph_of(window)
    blocks.mask_mod = module
    packed = block_masks.pack(blocks, 0x1234567)         # never registered
    with pytest.raises(RuntimeError, match="not registered in this process"):
        block_masks.resolve(packed, 1, 1, 20, 20)
    key = block_masks.register_mask_mod(module)
    with pytest.raises(RuntimeError, match=r"packed for \(20, 20\)"):
        block_masks.resolve(block_masks.pack(blocks, key), 1, 1, 20, 21)
    with pytest.raises(RuntimeError, match="packed by"):
        block_masks.resolve(torch.zeros(2000, dtype=torch.uint8), 1, 1, 20, 20)
    # a mask_mod with constants of its own is not named by its code: not packed
    module.register_buffer("table", torch.ones(3))
    module.graph.get_attr("table")
    assert block_masks.register_mask_mod(module) is None


# ---------------------------------------------------------------------------- the ops
def inputs(B, H, L, S, E=8, seed=0, kv_heads=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, dtype=torch.float64, generator=g)
    k, v = (torch.randn(B, kv_heads or H, S, E, dtype=torch.float64, generator=g)
            for _ in range(2))
    return q, k, v


def every_order(attend, q, k, v):
    """Output, gradient, a Hessian-vector product and forward over reverse."""
    def loss(q, k, v):
        return (attend(q, k, v) ** 2).sum()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attend(*leaves)
    grads = torch.autograd.grad(loss(*leaves), leaves, create_graph=True)
    directions = [torch.ones_like(t) for t in leaves]
    hvp = torch.autograd.grad(grads, leaves, directions)
    _, forward_over_reverse = jvp(grad(loss, argnums=(0, 1, 2)), (q, k, v), tuple(directions))
    return (out, *grads, *hvp, *forward_over_reverse)


@pytest.mark.parametrize("kv_heads", [None, 1])
def test_the_op_takes_key_intervals_at_every_order(kv_heads):
    """The op with an int32 key-interval mask equals the op with the same boolean mask
    (and SDPA's math), every order, GQA too; tiles smaller than the intervals."""
    B, H, L, S = 2, 3, 45, 45
    mask_mod = documents(document_ids(B, L, 7))
    summary = block_masks.key_intervals(blocks_of(mask_mod, B, None, L, S), L, S, "cpu", B, H)
    visible = dense(mask_mod, B, H, L, S)
    q, k, v = inputs(B, H, L, S, kv_heads=kv_heads)
    gqa = kv_heads is not None
    with blockwise.tiles(16, 8):
        ours = every_order(lambda q, k, v: autograd.attention_with_lse(
            q, k.repeat_interleave(3, 1) if gqa else k, v.repeat_interleave(3, 1) if gqa else v,
            summary, 8 ** -0.5, False)[0], q, k, v)
    bool_mask = every_order(lambda q, k, v: bob_compile.attention(
        q, k, v, attn_mask=visible, enable_gqa=gqa), q, k, v)
    for a, e in zip(ours, bool_mask):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


def test_flex_attention_passes_key_intervals_and_vmaps():
    """bob_compile.flex_attention hands the op the key intervals (no L x S mask made), and
    torch.func.vmap over it gives each sample's own result."""
    B, H, L = 2, 3, 40
    mask_mod = documents(document_ids(B, L, 9))
    block_mask = create_block_mask(mask_mod, B, None, L, L, device="cpu", BLOCK_SIZE=BLOCK)
    real = block_masks.visible_pairs
    block_masks_visible = []

    def spy(*args, **kwargs):
        block_masks_visible.append(args)
        return real(*args, **kwargs)
    q, k, v = inputs(B, H, L, L, seed=3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bob_compile.flex, "visible_pairs", spy)
        out = bob_compile.flex_attention(q, k, v, block_mask=block_mask)
        batched = vmap(lambda q: bob_compile.flex_attention(q, k, v, block_mask=block_mask))(
            torch.stack([q, 2 * q]))
    assert not block_masks_visible
    want = bob_compile.attention(q, k, v, attn_mask=dense(mask_mod, B, H, L, L))
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(batched[1], bob_compile.attention(
        2 * q, k, v, attn_mask=dense(mask_mod, B, H, L, L)), rtol=1e-12, atol=1e-12)


def sink_and_window_per_head(b, h, q_idx, kv_idx):
    """An attention sink of 4 keys beside a causal window wider for later heads: two
    intervals per row (StreamingLLM)."""
    return (kv_idx < 4) | ((q_idx >= kv_idx) & (q_idx - kv_idx < 6 + 5 * h))


@pytest.mark.parametrize("kv_heads", [None, 1])
def test_the_op_takes_a_mask_tile_by_tile_at_every_order(kv_heads):
    """A BlockMask whose rows see two intervals reaches the op tile by tile (no L x S mask
    made): every order equals the op's with the same boolean mask, GQA too; vmap gives
    each sample's own result."""
    B, H, L, S = 2, 3, 45, 53
    block_mask = create_block_mask(sink_and_window_per_head, None, H, L, S, device="cpu",
                                   BLOCK_SIZE=BLOCK)
    visible = dense(sink_and_window_per_head, B, H, L, S)
    q, k, v = inputs(B, H, L, S, kv_heads=kv_heads, seed=5)
    gqa = kv_heads is not None
    materialized = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bob_compile.flex, "visible_pairs",
                      lambda *args: materialized.append(args))
        with blockwise.tiles(16, 8):
            ours = every_order(lambda q, k, v: bob_compile.flex_attention(
                q, k, v, block_mask=block_mask, enable_gqa=gqa), q, k, v)
            batched = vmap(lambda q: bob_compile.flex_attention(
                q, k, v, block_mask=block_mask, enable_gqa=gqa))(torch.stack([q, 2 * q]))
    assert not materialized
    bool_mask = every_order(lambda q, k, v: bob_compile.attention(
        q, k, v, attn_mask=visible, enable_gqa=gqa), q, k, v)
    for a, e in zip(ours, bool_mask):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(batched[1], bob_compile.attention(
        2 * q, k, v, attn_mask=visible, enable_gqa=gqa), rtol=1e-12, atol=1e-12)


def test_identical_tiles_are_stored_once():
    """A dilated causal mask's partial tiles are two patterns (the diagonal's and the
    rest): two tiles stored at any length, the tables O(L S / block^2); empty and full
    evaluated tiles are not stored at all."""
    L = 256
    blocks = blocks_of(dilated, None, None, L, L)
    tiles = block_masks.key_intervals(blocks, L, L, "cpu", 1, 1, tiles_otherwise=True)
    assert isinstance(tiles, BlockSparseMask) and tiles.tiles.shape[0] == 2
    assert torch.equal(tiles.dense(), dense(dilated, 1, 1, L, L))
    assert tiles.nbytes() < L * L // 8

    def listed_partial_but_all_or_nothing(b, h, q_idx, kv_idx):
        # every tile of 16 x 16 is all or nothing, but listed as partial (from_kv_blocks)
        return (q_idx // BLOCK + kv_idx // BLOCK) % 2 == 0
    block_mask = create_block_mask(listed_partial_but_all_or_nothing, None, None, 64, 64,
                                   device="cpu", BLOCK_SIZE=BLOCK)
    everything_partial = BlockMask.from_kv_blocks(
        torch.full((1, 1, 4), 4, dtype=torch.int32),
        torch.arange(4, dtype=torch.int32).expand(1, 1, 4, 4).contiguous(),
        BLOCK_SIZE=BLOCK, mask_mod=listed_partial_but_all_or_nothing)
    for mask in (block_mask, everything_partial):
        tiles = block_masks.key_intervals(block_masks.Blocks.of(mask), 64, 64, "cpu", 1, 1,
                                          tiles_otherwise=True)
        assert tiles.tiles.shape[0] == 0
        assert torch.equal(tiles.dense(), dense(listed_partial_but_all_or_nothing, 1, 1, 64,
                                                64))


def test_tiles_whose_fingerprints_collide_stay_apart(monkeypatch):
    """Tiles are grouped by a fingerprint of their bytes, checked exactly: where every
    fingerprint is made to collide, the tiles are still told apart."""
    monkeypatch.setattr(block_sparse_masks, "_groups",
                        lambda flat: torch.zeros(flat.shape[0], dtype=torch.int64))
    blocks = blocks_of(sink_and_window_per_head, None, 3, 40, 50)
    tiles = block_masks.key_intervals(blocks, 40, 50, "cpu", 2, 3, tiles_otherwise=True)
    assert tiles.tiles.shape[0] > 1
    assert torch.equal(tiles.for_call(2, 3).dense(),
                       dense(sink_and_window_per_head, 2, 3, 40, 50))


def test_a_tile_by_tile_mask_reads_back_from_its_data():
    """The data alone (a copy: not found by identity) gives the same mask, through the ops'
    resolve too; a call of other lengths or sizes is refused."""
    blocks = blocks_of(sink_and_window_per_head, None, 3, 40, 50)
    tiles = block_masks.key_intervals(blocks, 40, 50, "cpu", 2, 3, tiles_otherwise=True)
    copy = tiles.data.clone()
    assert block_sparse_masks.built(copy) is None
    for again in (BlockSparseMask(copy, batch=2, heads=3),
                  block_masks.resolve(copy, 2, 3, 40, 50)):
        assert torch.equal(again.dense(), dense(sink_and_window_per_head, 2, 3, 40, 50))
        assert torch.equal(again.kernel_summary(), tiles.for_call(2, 3).kernel_summary())
    with pytest.raises(RuntimeError, match=r"tile-by-tile mask of \(40, 50\)"):
        block_masks.resolve(tiles.data, 2, 3, 40, 51)
    with pytest.raises(RuntimeError, match=r"reached a call of \(2, 4\)"):
        block_masks.resolve(tiles.data, 2, 4, 40, 50)


def test_the_public_call_refuses_the_internal_forms():
    q, k, v = inputs(1, 1, 8, 8)
    for mask in (torch.zeros(1, 1, 1, 35, dtype=torch.int32), torch.zeros(9, dtype=torch.uint8)):
        with pytest.raises(RuntimeError, match="attn_mask must be bool"):
            bob_compile.attention(q, k, v, attn_mask=mask)


# ---------------------------------------------------------------------------- kept across calls
def counting_key_intervals(monkeypatch):
    calls, real = [], block_masks.key_intervals

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(block_masks, "key_intervals", spy)
    return calls


def counting_evaluations(monkeypatch):
    """Each evaluation of a BlockMask's partial blocks (block_masks._partial_tiles)."""
    calls, real = [], block_masks._partial_tiles
    monkeypatch.setattr(block_masks, "_partial_tiles",
                        lambda *args: calls.append(args) or real(*args))
    return calls


def test_an_eager_mask_of_more_than_intervals_is_evaluated_once_per_call(monkeypatch):
    """The verdict and the booleans come from one evaluation of the partial blocks."""
    evaluated = counting_evaluations(monkeypatch)
    block_mask = create_block_mask(dilated, None, None, 40, 40, device="cpu", BLOCK_SIZE=BLOCK)
    q, k, v = inputs(1, 2, 40, 40, seed=8)
    out = bob_compile.flex_attention(q, k, v, block_mask=block_mask)
    assert len(evaluated) == 1
    torch.testing.assert_close(out, bob_compile.attention(
        q, k, v, attn_mask=dense(dilated, 1, 2, 40, 40)), rtol=1e-12, atol=1e-12)


def test_an_eager_block_mask_is_evaluated_once_until_its_tensors_change(monkeypatch):
    """The same BlockMask call after call: its intervals are kept. The mask_mod's captured
    ids modified in place (their version changes): evaluated again, and the result follows
    the new ids (FlexAttention's semantics: the listed blocks, the mask_mod as it reads
    now)."""
    calls = counting_key_intervals(monkeypatch)
    B, H, L = 1, 2, 40
    ids = document_ids(1, L, 5)
    mask_mod = documents(ids)
    block_mask = create_block_mask(mask_mod, None, None, L, L, device="cpu", BLOCK_SIZE=BLOCK)
    q, k, v = inputs(B, H, L, L, seed=4)
    first = bob_compile.flex_attention(q, k, v, block_mask=block_mask)
    second = bob_compile.flex_attention(q, k, v, block_mask=block_mask)
    assert len(calls) == 1 and torch.equal(first, second)
    ids[0, 20:] = ids[0, 20:] + 1           # a new document boundary at 20
    third = bob_compile.flex_attention(q, k, v, block_mask=block_mask)
    assert len(calls) == 2
    want = block_masks.visible_pairs(block_masks.Blocks.of(block_mask), L, L, "cpu", B, H)
    torch.testing.assert_close(third, bob_compile.attention(q, k, v, attn_mask=want),
                               rtol=1e-12, atol=1e-12)
    assert not torch.equal(third, first)


def calls_over_two_steps(monkeypatch, mask_mod, L=30, between=lambda: None):
    """How many times a BlockMask of `mask_mod` is evaluated over two eager calls (`between`
    runs between them); each call checked against the mask as the mask_mod reads now."""
    calls = counting_key_intervals(monkeypatch)
    block_mask = create_block_mask(mask_mod, None, None, L, L, device="cpu", BLOCK_SIZE=BLOCK)
    q, k, v = inputs(1, 1, L, L)
    for step in range(2):
        if step:
            between()
        out = bob_compile.flex_attention(q, k, v, block_mask=block_mask)
        want = block_masks.visible_pairs(block_masks.Blocks.of(block_mask), L, L, "cpu", 1, 1)
        torch.testing.assert_close(out, bob_compile.attention(q, k, v, attn_mask=want),
                                   rtol=1e-12, atol=1e-12)
    return len(calls)


def test_a_mask_mod_calling_helpers_is_evaluated_once(monkeypatch):
    """Helper functions, their closures and globals, and and_masks/or_masks compositions
    (attention-gym's way to build masks): everything they read can be told, so the
    intervals are kept."""
    from torch.nn.attention.flex_attention import and_masks, or_masks
    span = 5

    def near(q_idx, kv_idx):
        return q_idx - kv_idx < span

    def helped(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & near(q_idx, kv_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    assert calls_over_two_steps(monkeypatch, helped) == 1
    assert calls_over_two_steps(monkeypatch, and_masks(causal, window)) == 1
    assert calls_over_two_steps(monkeypatch, or_masks(window, prefix_lm)) == 1


def test_a_number_the_mask_mod_reads_is_part_of_the_key(monkeypatch):
    """A closure's number changed between calls (a window grown by a curriculum): the
    mask is evaluated again and follows it (FlexAttention's semantics: the listed blocks,
    the mask_mod as it reads now)."""
    width = 4

    def near(q_idx, kv_idx):
        return q_idx - kv_idx < width

    def widened(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & near(q_idx, kv_idx)

    def grow():
        nonlocal width
        width = 9
    assert calls_over_two_steps(monkeypatch, widened, between=grow) == 2


HELPER_SPAN = 4


def near_helper(q_idx, kv_idx):
    return q_idx - kv_idx < HELPER_SPAN


def through_a_global_helper(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & near_helper(q_idx, kv_idx)


def test_a_global_helper_rebound_between_calls_is_part_of_the_key(monkeypatch):
    """The mask_mod the same object, the helper it calls by its global name another
    function: evaluated again (the reached functions are in the key)."""
    def wider(q_idx, kv_idx):       # reads the same numbers: only its identity differs
        return q_idx - kv_idx < 2 * HELPER_SPAN
    assert calls_over_two_steps(monkeypatch, through_a_global_helper, between=lambda: (
        monkeypatch.setitem(globals(), "near_helper", wider))) == 2


def test_a_mask_mod_reading_state_it_cannot_key_is_evaluated_every_call(monkeypatch):
    """A list, a dict, an object or a user's module: what they hold may change unseen."""
    import types
    limits = [5]
    config = types.ModuleType("user_config")
    config.width = 5

    def from_list(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < limits[0])

    def from_module(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < config.width)
    assert calls_over_two_steps(monkeypatch, from_list) == 2
    assert calls_over_two_steps(monkeypatch, from_module) == 2


def test_a_packed_mask_is_evaluated_once_per_content(monkeypatch):
    """Each op of a compiled step resolves the packed mask, and each step packs it anew:
    kept by its bytes; other document ids, other bytes: evaluated again."""
    calls = counting_key_intervals(monkeypatch)
    B, H, L = 2, 1, 64
    module = graph_of(documents_with_ids)
    key = block_masks.register_mask_mod(module)

    def packed(ids):
        def bound(b, h, q_idx, kv_idx):
            return documents_with_ids(b, h, q_idx, kv_idx, ids)
        blocks = block_masks.Blocks.of(create_block_mask(bound, B, None, L, L, device="cpu",
                                                         BLOCK_SIZE=BLOCK))
        blocks.mask_mod, blocks.mask_mod_buffers = module, (ids,)
        return block_masks.pack(blocks, key), bound
    ids = document_ids(B, L, 6)
    first, bound = packed(ids)
    a = block_masks.resolve(first, B, H, L, L)
    # the later ops of the same call find it by the tensor itself: no read, no hash
    hashes, blake2b = [], block_masks.hashlib.blake2b
    monkeypatch.setattr(block_masks.hashlib, "blake2b",
                        lambda *a, **k: hashes.append(1) or blake2b(*a, **k))
    assert torch.equal(block_masks.resolve(first, B, H, L, L).dense(), a.dense()) and not hashes
    b = block_masks.resolve(packed(ids.clone())[0], B, H, L, L)
    assert len(calls) == 1 and torch.equal(a.dense(), b.dense())
    other_ids = document_ids(B, L, 7)
    other, other_bound = packed(other_ids)
    c = block_masks.resolve(other, B, H, L, L)
    assert len(calls) == 2 and torch.equal(c.dense(), dense(other_bound, B, H, L, L))


def test_a_mask_packed_again_from_the_same_tensors_is_not_read(monkeypatch):
    """A compiled graph packs its BlockMask at every call (its second order's VJP pair once
    more), from the same tensors while the loop reuses the BlockMask, which the compiled
    code may pass as fresh views: packed from them again, none written since, the form is
    found without reading the packed bytes (a host synchronization on a GPU). A tensor
    written in place, or other tensors of the same content, are read again (and found by
    content); other content is evaluated again."""
    for kept in ("_by_content", "_by_sources", "_by_packed"):
        monkeypatch.setattr(block_masks, kept, collections.OrderedDict())
    calls = counting_key_intervals(monkeypatch)
    reads, blake2b = [], block_masks.hashlib.blake2b
    monkeypatch.setattr(block_masks.hashlib, "blake2b",
                        lambda *a, **k: reads.append(1) or blake2b(*a, **k))
    B, H, L = 2, 1, 64
    module = graph_of(documents_with_ids)
    key = block_masks.register_mask_mod(module)
    ids = document_ids(B, L, 6)

    def bound(b, h, q_idx, kv_idx):
        return documents_with_ids(b, h, q_idx, kv_idx, ids)
    blocks = block_masks.Blocks.of(create_block_mask(bound, B, None, L, L, device="cpu",
                                                     BLOCK_SIZE=BLOCK))
    blocks.mask_mod, blocks.mask_mod_buffers = module, (ids,)
    expected = dense(bound, B, H, L, L)

    def resolved(blocks):
        return block_masks.resolve(block_masks.pack(blocks, key), B, H, L, L).dense()
    assert torch.equal(resolved(blocks), expected) and (len(calls), len(reads)) == (1, 1)
    views = dataclasses.replace(blocks, kv_num_blocks=blocks.kv_num_blocks[:],
                                kv_indices=blocks.kv_indices.view(blocks.kv_indices.shape))
    assert torch.equal(resolved(views), expected) and (len(calls), len(reads)) == (1, 1)
    ids.add_(0)                                   # written in place: read, same content
    assert torch.equal(resolved(blocks), expected) and (len(calls), len(reads)) == (1, 2)
    assert torch.equal(resolved(blocks), expected) and (len(calls), len(reads)) == (1, 2)
    clones = dataclasses.replace(blocks, kv_indices=blocks.kv_indices.clone())
    assert torch.equal(resolved(clones), expected) and (len(calls), len(reads)) == (1, 3)
    other_ids = document_ids(B, L, 7)
    other = dataclasses.replace(blocks, mask_mod_buffers=(other_ids,))
    assert torch.equal(resolved(other), block_masks.visible_pairs(other, L, L, "cpu", B, H))
    assert len(calls) == 2


def test_a_packed_tile_by_tile_mask_lives_as_long_as_its_packed_tensor(monkeypatch):
    """A mask that is not intervals resolves tile by tile once per packed tensor (the later
    ops of its call reuse it; its partial blocks evaluated once, for the verdict and the
    tiles both), and is let go with the packed tensor."""
    evaluated = counting_evaluations(monkeypatch)
    module = graph_of(dilated)
    key = block_masks.register_mask_mod(module)
    blocks = blocks_of(dilated, None, None, 40, 40)
    blocks.mask_mod = module
    packed = block_masks.pack(blocks, key)
    first = block_masks.resolve(packed, 1, 2, 40, 40)
    assert block_masks.resolve(packed, 1, 2, 40, 40) is first and len(evaluated) == 1
    assert torch.equal(first.dense(), dense(dilated, 1, 2, 40, 40))
    kept = len(block_masks._by_packed)
    del packed
    assert len(block_masks._by_packed) == kept - 1
