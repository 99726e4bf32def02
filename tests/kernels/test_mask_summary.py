"""The mask summary (bob_compile/kernels/triton_masks.py): per (batch, head) the key range a
mask lets any query see, and whether the mask is exactly that range (key padding), or that
range with a top-left causal mask folded in (how Hugging Face builds its 4-D masks), or one
interval of keys per row and of queries per key (KEY_INTERVALS: sliding windows, packed
documents, prefix-LM), so that the Triton kernels apply it from indices and never read it.
Anything else must be read: a summary that calls a mask structured when it is not would
silently change the result.

Here the PyTorch form (summarize_with_torch); test_triton_interpret.py checks that the
Triton kernels compute the same summary."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")
from bob_compile.kernels.triton_masks import (KEY_INTERVALS, KEYS_IN_RANGE,  # noqa: E402
                                              KEYS_IN_RANGE_CAUSAL, READ_THE_MASK,
                                              READ_THE_MASK_CAUSAL, summarize_with_torch)

B, H, L, S = 3, 2, 7, 7
ROWS, KEYS = torch.arange(L)[:, None], torch.arange(S)[None, :]


def padding(lengths, left=False):
    """(B, 1, 1, S) key validity: batch b sees lengths[b] keys, at the end if left-padded."""
    keys = torch.arange(S)
    valid = [(keys >= S - n) if left else (keys < n) for n in lengths]
    return torch.stack(valid)[:, None, None, :]


def summary(mask):
    full = mask.expand(B, H, L, S) if mask.dim() == 4 else mask
    out = summarize_with_torch(full)
    assert out.shape == (B, H, 1, 3 + 2 * L + 2 * S) and out.dtype == torch.int32
    return out[:, 0, 0, :3].tolist()     # per batch: [first, end, structure]


def ranges(mask):
    """Per batch: each query's [first, end) of the keys it sees, and each key's [first, end)
    of the queries that see it."""
    out = summarize_with_torch(mask.expand(B, H, L, S))[:, 0, 0, 3:]
    return (out[:, :2 * L].view(B, L, 2).tolist(), out[:, 2 * L:].view(B, S, 2).tolist())


def test_key_padding_is_a_key_range():
    assert summary(padding([7, 4, 0])) == [[0, 7, KEYS_IN_RANGE], [0, 4, KEYS_IN_RANGE],
                                           [0, 0, KEYS_IN_RANGE]]
    assert summary(padding([7, 4, 2], left=True)) == [
        [0, 7, KEYS_IN_RANGE], [3, 7, KEYS_IN_RANGE], [5, 7, KEYS_IN_RANGE]]


@pytest.mark.parametrize("left", [False, True])
def test_padding_with_the_causal_mask_folded_in(left):
    """HF's 4-D mask: padding and top-left causal in one (B, 1, L, S) tensor."""
    mask = padding([7, 4, 2], left=left) & (KEYS <= ROWS)
    rows = summary(mask)
    assert [r[2] for r in rows] == [KEYS_IN_RANGE_CAUSAL] * 3
    assert [r[:2] for r in rows] == ([[0, 7], [3, 7], [5, 7]] if left else [[0, 7], [0, 4], [0, 2]])


def test_additive_masks_that_add_nothing_to_visible_scores():
    hidden = torch.finfo(torch.float32).min
    visible = padding([7, 4, 2]) & (KEYS <= ROWS)
    additive = torch.zeros(visible.shape).masked_fill(~visible, hidden)
    assert [r[2] for r in summary(additive)] == [KEYS_IN_RANGE_CAUSAL] * 3
    biased = additive.clone()
    biased[1, 0, 5, 1] = 0.5            # a bias on one visible pair: read the mask there
    assert [r[2] for r in summary(biased)] == [KEYS_IN_RANGE_CAUSAL, READ_THE_MASK_CAUSAL,
                                              KEYS_IN_RANGE_CAUSAL]


@pytest.mark.parametrize("change", ["a hole", "an extra key", "a diagonal shifted by one"])
def test_almost_structured_masks_are_intervals_or_read(change):
    """A key more or a shifted diagonal leave every row and every column one interval
    (KEY_INTERVALS: applied from the ranges); a hole does not: read, and where no row sees
    a key above the diagonal, with the blocks above it skipped (READ_THE_MASK_CAUSAL)."""
    mask = (padding([7, 5, 3]) & (KEYS <= ROWS)).expand(B, 1, L, S).clone()
    if change == "a hole":
        mask[1, 0, 4, 2] = False
    elif change == "an extra key":
        mask[1, 0, 2, 3] = True         # above the diagonal, inside the range
    else:
        mask[1] = padding([5])[0] & (KEYS <= ROWS + 1)
    rows = summary(mask)
    assert rows[1][2] == (READ_THE_MASK_CAUSAL if change == "a hole" else KEY_INTERVALS)
    assert rows[0][2] == rows[2][2] == KEYS_IN_RANGE_CAUSAL


DOCUMENTS = torch.tensor([0, 0, 0, 1, 1, 2, 2])
INTERVAL_MASKS = {
    # packed sequences (a causal mask within each document)
    "documents": (DOCUMENTS[:, None] == DOCUMENTS[None, :]) & (KEYS <= ROWS),
    # a causal sliding window of 3 keys (Mistral, Gemma 2's local layers)
    "sliding window": (KEYS <= ROWS) & (KEYS > ROWS - 3),
    # prefix-LM: the first 3 positions see each other, the rest causally
    "prefix-LM": (KEYS <= ROWS) | (KEYS < 3),
    # bidirectional documents (an encoder over packed sequences)
    "bidirectional documents": DOCUMENTS[:, None] == DOCUMENTS[None, :],
}


@pytest.mark.parametrize("name", sorted(INTERVAL_MASKS))
def test_masks_of_intervals_apply_from_indices(name):
    """Each row sees one interval of keys and each key is seen by one interval of rows:
    KEY_INTERVALS, the kernels apply it from the per-row and per-key ranges."""
    mask = INTERVAL_MASKS[name]
    assert [r[2] for r in summary(mask[None, None].expand(B, 1, L, S))] == [KEY_INTERVALS] * 3
    hidden = torch.finfo(torch.float32).min
    additive = torch.zeros(L, S).masked_fill(~mask, hidden)
    assert summary(additive[None, None].expand(B, 1, L, S))[0][2] == KEY_INTERVALS
    additive[4, 4] = 0.25               # a bias on one visible pair: read
    assert summary(additive[None, None].expand(B, 1, L, S))[0][2] in (READ_THE_MASK,
                                                                       READ_THE_MASK_CAUSAL)


def test_rows_of_intervals_whose_columns_are_not_are_read():
    """Every row one interval, but key 0 seen by rows 0 and 2 and not by row 1: the
    key-block-major kernels apply a mask from the keys' intervals, so it is read."""
    mask = torch.zeros(L, S, dtype=torch.bool)
    mask[0, 0:2] = mask[1, 3:5] = mask[2:, 0:2] = True
    assert summary(mask[None, None].expand(B, 1, L, S))[0][2] == READ_THE_MASK
    one_row = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    one_row[..., ::2] = True
    assert [r[2] for r in summary(one_row)] == [READ_THE_MASK] * 3


def test_rows_broadcast_cannot_hold_a_causal_mask():
    """A mask broadcast over query rows (stride 0) is the same for every row: a key range
    or nothing, never the causal form (even with one visible key)."""
    one_key = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    one_key[..., 0] = True
    assert [r[2] for r in summary(one_key)] == [KEYS_IN_RANGE] * 3
    scattered = padding([7, 7, 7]).clone()
    scattered[0, ..., 3] = False
    assert summary(scattered)[0] == [0, 7, READ_THE_MASK]


def test_heads_are_summarized_apart():
    mask = torch.ones(B, H, L, S, dtype=torch.bool)
    mask[:, 1] = KEYS <= ROWS
    out = summarize_with_torch(mask)[:, :, 0, 2]
    assert out[:, 0].tolist() == [KEYS_IN_RANGE] * 3
    assert out[:, 1].tolist() == [KEYS_IN_RANGE_CAUSAL] * 3


def test_every_call_reads_the_mask_again():
    """Nothing about a mask's contents is remembered: a write through .data, which its
    version counter does not see, changes the next summary."""
    stored = padding([7, 4, 2])
    mask = stored.expand(B, H, L, S)
    assert summary(mask)[1] == [0, 4, KEYS_IN_RANGE]
    stored.data[1, ..., 5] = True
    assert summary(mask)[1] == [0, 6, READ_THE_MASK]
    stored.data[1, ..., 4] = True
    assert summary(mask)[1] == [0, 6, KEYS_IN_RANGE]


@pytest.fixture
def summaries_made(monkeypatch):
    """summary_of_forward with mask_summary counted (and computed by the PyTorch form)."""
    from bob_compile.kernels import triton_masks
    made = []

    def counted(mask):
        made.append(1)
        return summarize_with_torch(mask)
    monkeypatch.setattr(triton_masks, "mask_summary", counted)
    monkeypatch.setattr(triton_masks, "_forward_summaries", {})
    return triton_masks.summary_of_forward, made


def test_backwards_reuse_the_summary_their_forward_made(summaries_made):
    """A forward summarizes; the backwards of that call, which receive the same mask (each
    through a new broadcast view of it, as ops.py makes one per call), reuse it."""
    summary_of_forward, made = summaries_made
    stored = padding([7, 4, 2])
    first = summary_of_forward(stored.expand(B, H, L, S), False)
    for _ in range(3):                                  # backward, BoB, second backward
        assert summary_of_forward(stored.expand(B, H, L, S), True) is first
    assert len(made) == 1
    assert summary_of_forward(stored.expand(B, H, L, S), False) is not first  # a new forward
    assert len(made) == 2


def test_nothing_is_reused_across_forwards_or_changed_masks(summaries_made):
    """Every forward summarizes afresh (a write through .data between steps is not seen by
    the version counter), and a backward never reuses the summary of another mask, another
    view of it, or a mask changed in place since."""
    summary_of_forward, made = summaries_made
    stored = padding([7, 4, 2])
    summary_of_forward(stored.expand(B, H, L, S), False)
    stored.data[1, ..., 5] = True                       # unseen by the version counter
    assert summary(stored)[1] == [0, 6, READ_THE_MASK]
    assert summary_of_forward(stored.expand(B, H, L, S), False)[1, 0, 0, :3].tolist() == \
        [0, 6, READ_THE_MASK]                           # the next forward sees it
    assert len(made) == 2
    stored[1, ..., 4] = True                            # in place: the version changes
    kept = summary_of_forward(stored.expand(B, H, L, S), True)
    assert kept[1, 0, 0, :3].tolist() == [0, 6, KEYS_IN_RANGE] and len(made) == 3
    assert summary_of_forward(stored[:, :, :, :].expand(B, H, L, S), True) is kept  # same view
    other = padding([7, 4, 2])                          # same contents, another tensor
    summary_of_forward(other.expand(B, H, L, S), True)
    rows = stored.expand(B, 1, L, S)                    # another view of the same mask
    summary_of_forward(rows, True)
    assert len(made) == 5


def test_calls_that_may_not_keep_summarize_every_time(summaries_made):
    """Calls through the op (AttentionParams.keep_mask_summary False: a compiled graph's,
    whose CUDA-graph pool must not hold memory it does not account for) neither keep a
    summary nor reuse one."""
    from bob_compile.kernels import triton_masks
    from bob_compile.kernels.params import AttentionParams
    summary_of_forward, made = summaries_made
    mask = padding([7, 4, 2]).expand(B, H, L, S)
    for keep in (False, True):
        params = AttentionParams(scale=1.0, causal=False, mask=mask, keep_mask_summary=keep)
        triton_masks.mask_kind_and_tensor(params, mask)                 # a forward
        triton_masks.mask_kind_and_tensor(params, mask, reuse=True)     # its backward
        assert len(triton_masks._forward_summaries) == keep
    assert len(made) == 3


def summary_of_structures(*structures):
    """A (1, Hq, 1, 3) summary whose heads have these structures (first 0, end S)."""
    out = torch.zeros(1, len(structures), 1, 3, dtype=torch.int32)
    out[..., 1] = S
    out[0, :, 0, 2] = torch.tensor(structures)
    return out


@pytest.mark.parametrize("structures,kv_group,indices,read", [
    ((KEYS_IN_RANGE, KEYS_IN_RANGE_CAUSAL), 1, True, False),
    ((READ_THE_MASK, READ_THE_MASK_CAUSAL), 1, False, True),
    ((KEYS_IN_RANGE, READ_THE_MASK), 1, True, True),
    # a key-block-major program takes a GQA group: the key-range launch only all-range groups
    ((KEYS_IN_RANGE, READ_THE_MASK, KEYS_IN_RANGE_CAUSAL, READ_THE_MASK_CAUSAL), 2, False, True),
    ((KEYS_IN_RANGE, READ_THE_MASK, KEYS_IN_RANGE_CAUSAL, KEYS_IN_RANGE), 2, True, True),
])
def test_which_mask_path_has_work(structures, kv_group, indices, read):
    """A masked kernel's two launches (tiles.py, MASK_PATH) each take some (batch,
    head)s; the tuner times a launch's configs only where it has some (launch_plan)."""
    from bob_compile.kernels.triton_masks import mask_path_has_work
    summary = summary_of_structures(*structures)
    assert mask_path_has_work(summary, 1, kv_group) == indices
    assert mask_path_has_work(summary, 2, kv_group) == read


def test_a_launch_without_work_is_not_timed(monkeypatch):
    """A launch with nothing to do keeps the first candidate, untimed and not written to the
    tuning file (its timing would be noise; it is launched once, to see that it builds);
    one with work is timed."""
    from bob_compile.kernels import tuning
    monkeypatch.setattr(tuning, "tuning_enabled", lambda: True)
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning, "_builds", {})
    written = []
    monkeypatch.setattr(tuning.TUNING_CACHE, "get", lambda key: None)
    monkeypatch.setattr(tuning.TUNING_CACHE, "put", lambda key, c: written.append(c))
    ran = []
    candidates = [dict(BLOCK_M=64), dict(BLOCK_M=32)]
    config, final = tuning.choose_config("key", candidates, ran.append, 1,
                                                 has_work=lambda: False)
    assert (config, final, ran, written) == (candidates[0], True, [candidates[0]], [])
    timings = iter([3.0, 1.0] * 10)
    monkeypatch.setattr(tuning.triton.testing, "do_bench",
                        lambda fn, **kw: (fn(), next(timings))[1])
    config, _ = tuning.choose_config("key", candidates, ran.append, 1,
                                             has_work=lambda: True)
    assert config == candidates[1] and written == [candidates[1]] and len(ran) == 3


def test_per_row_and_per_key_ranges():
    """What a read mask's kernels loop over: a sliding window's rows see the window, its
    keys are seen by the next rows; an empty row and an unseen key give first > end;
    key padding broadcast over the rows gives every query the padding's range and every
    visible key all the queries."""
    window = (KEYS <= ROWS) & (ROWS - KEYS < 3)
    window[5] = False                                 # row 5 sees no key
    rows, keys = ranges(window[None, None])
    assert rows[0] == [[0, 1], [0, 2], [0, 3], [1, 4], [2, 5], [S, 0], [4, 7]]
    assert keys[0] == [[0, 3], [1, 4], [2, 5], [3, 5], [4, 7], [6, 7], [6, 7]]
    rows, keys = ranges(padding([7, 4, 0]))
    assert rows[1] == [[0, 4]] * L and keys[1] == [[0, L]] * 4 + [[L, 0]] * 3
    assert rows[2] == [[S, 0]] * L and keys[2] == [[L, 0]] * S


def applied_from_the_summary(out, L, S):
    """The mask the kernels apply where the summary says it applies from indices: each
    row's keys from the per-row ranges, and (key-block-major passes) each key's queries
    from the per-key ranges; both must be the mask itself."""
    rows = out[3:3 + 2 * L].view(L, 2)
    columns = out[3 + 2 * L:].view(S, 2)
    keys, queries = torch.arange(S)[None, :], torch.arange(L)[:, None]
    by_rows = (keys >= rows[:, :1]) & (keys < rows[:, 1:])
    by_columns = (queries >= columns[:, 0]) & (queries < columns[:, 1])
    return by_rows, by_columns


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_mask_applied_from_indices_is_the_mask(data):
    """Random masks near the structured ones (intervals per row with random ends, then a
    few pairs flipped): wherever the summary says KEYS_IN_RANGE[_CAUSAL] or KEY_INTERVALS,
    the mask rebuilt from its per-row ranges and from its per-key ranges is the mask
    (an additive one adds nothing to a visible score); elsewhere it is read."""
    L = data.draw(st.integers(1, 12))
    S = data.draw(st.integers(1, 12))
    firsts = torch.tensor(data.draw(st.lists(st.integers(0, S), min_size=L, max_size=L)))
    widths = torch.tensor(data.draw(st.lists(st.integers(0, S), min_size=L, max_size=L)))
    if data.draw(st.booleans()):            # monotone ends: columns are intervals too
        firsts, widths = firsts.sort().values, widths.sort().values
    keys = torch.arange(S)[None, :]
    visible = (keys >= firsts[:, None]) & (keys < (firsts + widths)[:, None])
    for _ in range(data.draw(st.integers(0, 2))):
        i, j = data.draw(st.integers(0, L - 1)), data.draw(st.integers(0, S - 1))
        visible[i, j] = ~visible[i, j]
    additive = data.draw(st.booleans())
    mask = visible
    if additive:
        mask = torch.zeros(L, S).masked_fill(~visible, float("-inf"))
        if data.draw(st.booleans()) and visible.any():
            i, j = visible.nonzero()[0].tolist()
            mask[i, j] = 0.5                # a bias on a visible pair: must be read
    out = summarize_with_torch(mask[None, None])[0, 0, 0]
    structure = out[2].item()
    if structure in (KEYS_IN_RANGE, KEYS_IN_RANGE_CAUSAL, KEY_INTERVALS):
        by_rows, by_columns = applied_from_the_summary(out, L, S)
        assert torch.equal(by_rows, visible) and torch.equal(by_columns, visible)
        assert not additive or bool((mask[visible] == 0).all())
    else:
        assert structure in (READ_THE_MASK, READ_THE_MASK_CAUSAL)
