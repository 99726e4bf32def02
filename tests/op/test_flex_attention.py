"""bob_compile.flex_attention: FlexAttention's call (BlockMask, additive score_mod) through
the op, in float64 on the CPU. The forward against PyTorch's own flex_attention (which has
no second derivative); every order against SDPA's math with the same mask and bias, built
here from the patterns' definitions, not from the code under test."""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, jvp
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

import bob_compile

B, H, E = 2, 3, 8

# the tile-by-tile and relative-bias routes at these small sizes (conftest.py)
pytestmark = pytest.mark.usefixtures("tiles_at_any_size")
BLOCK = 16                     # BlockMask blocks smaller than the lengths: partial ones too
SLOPES = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 7)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < 5) | (q_idx >= kv_idx)


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def softcap(score, b, h, q_idx, kv_idx):
    return 30 * torch.tanh(score / 30)


def bias_inside_the_cap(score, b, h, q_idx, kv_idx):    # capped with the scores: not the
    return 10 * torch.tanh((score + SLOPES[h] * (kv_idx - q_idx)) / 20)    # op's order


def documents(L, seed):
    """A packed batch: document ids of random lengths, the mask_mod that keeps attention
    causal inside each document, and the mask it defines."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 4, (L,), generator=g).sort().values

    def document_mask(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)
    q, kv = torch.arange(L)[:, None], torch.arange(L)[None, :]
    return document_mask, (ids[q] == ids[kv]) & (q >= kv)


def dense(pattern, L, S):
    q, kv = torch.arange(L)[:, None], torch.arange(S)[None, :]
    return {causal: q >= kv, sliding_window: (q >= kv) & (q - kv < 7),
            prefix_lm: (kv < 5) | (q >= kv)}[pattern]


def alibi_bias(L, S):
    q, kv = torch.arange(L)[:, None], torch.arange(S)[None, :]
    return SLOPES.view(1, H, 1, 1) * (kv - q)


def inputs(L, S, seed=0, kv_heads=H):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, dtype=torch.float64, generator=g)
    k, v = (torch.randn(B, kv_heads, S, E, dtype=torch.float64, generator=g) for _ in range(2))
    return q, k, v


def math_attention(q, k, v, visible=None, bias=None, enable_gqa=False):
    mask = torch.zeros(q.shape[-2], k.shape[-2], dtype=torch.float64) if bias is None else bias
    if visible is not None:
        mask = mask.masked_fill(~visible, float("-inf"))
    with sdpa_kernel(SDPBackend.MATH):      # the only SDPA with a double backward
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


CASES = {   # name: (mask_mod, score_mod, L, S)
    "causal": (causal, None, 37, 37),
    "sliding window + ALiBi": (sliding_window, alibi, 45, 45),
    "prefix-LM": (prefix_lm, None, 33, 33),
    "ALiBi alone": (None, alibi, 29, 35),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_equals_flex_attention(name):
    mask_mod, score_mod, L, S = CASES[name]
    q, k, v = inputs(L, S)
    block_mask = None if mask_mod is None else create_block_mask(
        mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    want = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    got = bob_compile.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def second_orders(attend, q, k, v):
    """The HVP of a nonlinear loss in (q, k, v), and forward over reverse (torch.func)."""
    def loss(q, k, v):
        return attend(q, k, v).tanh().square().sum()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(loss(*leaves), leaves, create_graph=True)
    directions = [torch.ones_like(t) for t in leaves]
    hvp = torch.autograd.grad(grads, leaves, directions)
    _, forward_over_reverse = jvp(grad(loss, argnums=(0, 1, 2)), (q, k, v), tuple(directions))
    return (*hvp, *forward_over_reverse)


@pytest.mark.parametrize("name", ["sliding window + ALiBi", "documents"])
def test_every_order_equals_math_with_the_same_mask_and_bias(name):
    if name == "documents":
        mask_mod, visible = documents(41, seed=3)
        score_mod, L = None, 41
        bias = None
    else:
        mask_mod, score_mod, L, _ = CASES[name]
        visible, bias = dense(mask_mod, L, L), alibi_bias(L, L)
    block_mask = create_block_mask(mask_mod, None, None, L, L, device="cpu", BLOCK_SIZE=BLOCK)
    assert_second_orders_equal_math(score_mod, block_mask, visible, bias, *inputs(L, L, seed=1))


def assert_second_orders_equal_math(score_mod, block_mask, visible, bias, q, k, v):
    """bob_compile.flex_attention's second orders against math with the same dense mask
    (`visible`) and bias."""
    ours = second_orders(lambda q, k, v: bob_compile.flex_attention(
        q, k, v, score_mod=score_mod, block_mask=block_mask), q, k, v)
    math_ = second_orders(lambda q, k, v: math_attention(q, k, v, visible, bias), q, k, v)
    for a, e in zip(ours, math_):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9)


def test_grouped_query_heads():
    q, k, v = inputs(30, 30, seed=2, kv_heads=1)
    block_mask = create_block_mask(causal, None, None, 30, 30, device="cpu", BLOCK_SIZE=BLOCK)
    got = bob_compile.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    want = math_attention(q, k, v, dense(causal, 30, 30), enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_blocks_a_block_mask_lists_count_not_only_its_mask_mod():
    """A BlockMask listing fewer blocks than its mask_mod's pattern hides the others, as
    FlexAttention's compiled kernels do (its eager path reads the mask_mod alone): a causal
    mask_mod with only the diagonal blocks listed is block-diagonal causal."""
    L, blocks = 48, 3
    # each query block lists one key block, its own (the rest of the row: unused entries)
    diagonal = (torch.arange(blocks, dtype=torch.int32).view(-1, 1)
                + torch.arange(blocks, dtype=torch.int32)) % blocks
    block_mask = BlockMask.from_kv_blocks(torch.ones(1, 1, blocks, dtype=torch.int32),
                                          diagonal.view(1, 1, blocks, blocks), BLOCK_SIZE=BLOCK,
                                          mask_mod=causal, seq_lengths=(L, L))
    q, k, v = inputs(L, L, seed=4)
    q_idx, kv_idx = torch.arange(L)[:, None], torch.arange(L)[None, :]
    visible = (q_idx >= kv_idx) & (q_idx // BLOCK == kv_idx // BLOCK)
    got = bob_compile.flex_attention(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(got, math_attention(q, k, v, visible), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got, math_attention(q, k, v, dense(causal, L, L)))


def test_a_bias_is_materialized_once_for_what_it_does_not_read():
    """ALiBi reads the head, not the batch entry: one (1, H, L, S) bias, not (B, H, L, S)."""
    from bob_compile.flex import additive_bias
    q, _, _ = inputs(9, 11)
    assert additive_bias(alibi, q, 9, 11).shape == (1, H, 9, 11)
    table = torch.randn(9, 11, dtype=torch.float64)
    assert additive_bias(lambda s, b, h, i, j: s + table[i, j], q, 9, 11).shape == (1, 1, 9, 11)
    shapes = []     # the same under a torch.func transform (the traced graph sees the indices)
    grad(lambda q: shapes.append(additive_bias(alibi, q, 9, 11).shape) or q.sum())(q)
    assert shapes == [(1, H, 9, 11)]


def test_a_learned_bias_in_the_score_mod_gets_its_gradient():
    L = 26
    table = torch.randn(L, L, dtype=torch.float64, requires_grad=True)

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[q_idx, kv_idx]
    q, k, v = inputs(L, L, seed=5)
    got = torch.autograd.grad(bob_compile.flex_attention(q, k, v, score_mod=relative).square().sum(),
                              table)[0]
    want = torch.autograd.grad(math_attention(q, k, v, bias=table).square().sum(), table)[0]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("score_mod,cap,with_bias", [
    (softcap, 30.0, False),
    # c tanh(a score) with a != 1 / c: a cap of c on scores scaled by a c
    (lambda score, b, h, q_idx, kv_idx: 10 * torch.tanh(score / 20), None, False),
    # Gemma 2's form in Hugging Face: cap first, then an additive term
    (lambda score, b, h, q_idx, kv_idx: 2 * torch.tanh(score * 0.5) + SLOPES[h] * (kv_idx - q_idx),
     2.0, True),
])
def test_soft_capped_scores_run_through_the_op_at_every_order(monkeypatch, score_mod, cap,
                                                                with_bias):
    """c * tanh(score / c) [+ bias]: the op's softcap, no math fallback (no warning, and the
    math path is never called), exact at every order against math with the same cap."""
    from bob_compile import flex
    monkeypatch.setattr(flex, "_math", None)        # any call of the math path fails
    L = 37
    q, k, v = (t * 3 for t in inputs(L, L, seed=4))      # scores of several units: capped
    block_mask = create_block_mask(prefix_lm, None, None, L, L, device="cpu", BLOCK_SIZE=BLOCK)
    bias = alibi_bias(L, L) if with_bias else None

    def capped(q, k, v):
        scores = score_mod(q @ k.transpose(-1, -2) / E ** 0.5, 0, 0, 0, 0) if cap is None \
            else cap * torch.tanh(q @ k.transpose(-1, -2) / E ** 0.5 / cap)
        if bias is not None:
            scores = scores + bias
        return scores.masked_fill(~dense(prefix_lm, L, L), float("-inf")).softmax(-1) @ v
    with warnings.catch_warnings():
        # bob_compile's own (the math fallback's); not PyTorch's (the first forward-mode AD
        # in a process scripts its decompositions, with a deprecation warning)
        warnings.filterwarnings("error", message="bob_compile")
        ours = second_orders(lambda q, k, v: bob_compile.flex_attention(
            q, k, v, score_mod=score_mod, block_mask=block_mask), q, k, v)
    for a, e in zip(ours, second_orders(capped, q, k, v)):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9)


def test_nonlinear_score_mods_and_the_logsumexp_run_as_math_with_a_warning():
    """A score_mod nonlinear in the score otherwise (a bias capped with the scores) and
    return_lse=True: exact at every order as math (N x N), with a warning that says so;
    a BlockMask built for other lengths is an error."""
    q, k, v = inputs(20, 20)
    block_mask = create_block_mask(causal, None, None, 20, 20, device="cpu", BLOCK_SIZE=BLOCK)

    def squashed(q, k, v):
        scores = 10 * torch.tanh((q @ k.transpose(-1, -2) / E ** 0.5 + alibi_bias(20, 20)) / 20)
        return scores.masked_fill(~dense(causal, 20, 20), float("-inf")).softmax(-1) @ v
    with pytest.warns(UserWarning, match="runs this call as math.*is not score"):
        ours = second_orders(lambda q, k, v: bob_compile.flex_attention(
            q, k, v, score_mod=bias_inside_the_cap, block_mask=block_mask), q, k, v)
    for a, e in zip(ours, second_orders(squashed, q, k, v)):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9)
    with pytest.warns(UserWarning, match="return_lse"):
        out, lse = bob_compile.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    want_out, want_lse = flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    other_lengths = create_block_mask(causal, None, None, 32, 32, device="cpu", BLOCK_SIZE=BLOCK)
    with pytest.raises(ValueError, match="build it for the call's lengths"):
        bob_compile.flex_attention(q, k, v, block_mask=other_lengths)


def test_inside_a_compiled_model(fresh_dynamo):
    """Called inside torch.compile(backend="flashbob") (the mask and bias are built between
    graphs): the Hessian-vector product of a model's parameters is eager's."""
    L = 40
    block_mask = create_block_mask(sliding_window, None, None, L, L, device="cpu",
                                   BLOCK_SIZE=BLOCK)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(E, 3 * E)

        def forward(self, x):
            q, k, v = self.proj(x).chunk(3, -1)
            out = bob_compile.flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask)
            return out.tanh().sum()
    torch.manual_seed(0)
    model = Block().double()
    x = torch.randn(B, H, L, E, dtype=torch.float64)

    def hvp(model):
        params = list(model.parameters())
        grads = torch.autograd.grad(model(x), params, create_graph=True)
        return torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params])
    want = hvp(model)
    got = hvp(torch.compile(model, backend="flashbob", options={"compiler": "aot_eager"}))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9)


def test_a_mask_mod_reading_the_batch_is_evaluated_per_batch_entry():
    """A BlockMask built once for every batch entry (B=None) whose mask_mod reads b (packed
    documents that differ per sequence): FlexAttention evaluates the mask_mod at each
    entry's own b, and so does the op; its block lists broadcast."""
    L = 21
    ids = torch.stack([torch.arange(L) // 7, torch.arange(L) // 4])

    def per_sequence_documents(b, h, q_idx, kv_idx):
        return ids[b, q_idx] == ids[b, kv_idx]
    block_mask = create_block_mask(per_sequence_documents, None, None, L, L, device="cpu",
                                   BLOCK_SIZE=32)
    q, k, v = inputs(L, L, seed=6)
    visible = (ids[:, None, :, None] == ids[:, None, None, :])
    want = math_attention(q, k, v, visible)
    got = bob_compile.flex_attention(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=block_mask), want,
                               rtol=1e-12, atol=1e-12)
    from bob_compile.block_masks import mask_mod_reads
    assert mask_mod_reads(per_sequence_documents) == (True, False)
    assert mask_mod_reads(causal) == (False, False)


@pytest.mark.parametrize("score_mod,additive", [
    (lambda s, b, h, i, j: s + SLOPES[h] * (j - i), True),                 # ALiBi
    (lambda s, b, h, i, j: s - 0.5 * (i - j).abs(), True),                # a distance penalty
    (lambda s, b, h, i, j: (i - j) * 0.1 + s, True),                      # bias first
    (lambda s, b, h, i, j: s, True),                                      # identity
    (lambda s, b, h, i, j: s + torch.tanh(s), False),                     # reads the score twice
    (lambda s, b, h, i, j: (i - j) * 0.1 - s, False),                     # the score negated
    (lambda s, b, h, i, j: s * 2, False),                                 # scaled
    (lambda s, b, h, i, j: torch.where(i >= j, s, -float("inf")), False),  # a mask in disguise
    (lambda s, b, h, i, j: s + (s > 0).to(s.dtype), False),               # depends on its sign
])
def test_which_score_mods_are_additive(score_mod, additive):
    """Only score + (a term that never reads the score) runs fused; anything else is math
    (exact), never mistaken for a bias."""
    from bob_compile.flex import AdditiveScoreMod, score_mod_form
    assert isinstance(score_mod_form(score_mod, torch.float64), AdditiveScoreMod) == additive


@pytest.mark.parametrize("score_mod,relative", [
    (lambda s, b, h, i, j: s + SLOPES[h] * (j - i), True),                 # ALiBi
    (lambda s, b, h, i, j: s - 0.5 * (i - j).abs(), True),                # a distance penalty
    (lambda s, b, h, i, j: s + SLOPES[h], True),                          # no index at all
    (lambda s, b, h, i, j: s + 0.01 * i * j, False),                      # a product
    (lambda s, b, h, i, j: s + ((i - j) * 0.1 + 0.01 * i), False),        # the query alone too
    (lambda s, b, h, i, j: s + 0.1 * (i - 2 * j), False),                 # not the difference
    (lambda s, b, h, i, j: s + 0.1 * (i + j), False),                     # their sum
    (lambda s, b, h, i, j: s + 0.1 * i, False),                           # one of them
])
def test_which_biases_are_relative(score_mod, relative):
    """A bias that reads q_idx and kv_idx only through one q_idx - kv_idx goes to the
    kernels as a row per head; anything else is materialized, never taken for one."""
    from bob_compile.flex import score_mod_form
    assert score_mod_form(score_mod, torch.float64).relative == relative


def test_mods_are_traced_on_the_device_of_what_they_capture():
    """A score_mod or mask_mod indexing a tensor it captures (ALiBi slopes, document ids on
    the GPU) is traced with indices on the call's device; traced on the CPU it fails, and
    the call would run as math (N x N)."""
    from bob_compile.block_masks import mask_mod_reads
    from bob_compile.flex import AdditiveScoreMod, score_mod_form
    slopes, ids = torch.ones(4, device="meta"), torch.zeros(16, dtype=torch.int64, device="meta")

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def documents(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]
    assert isinstance(score_mod_form(alibi, torch.float32, device="cpu"), str)
    form = score_mod_form(alibi, torch.float32, device=torch.device("meta"))
    assert isinstance(form, AdditiveScoreMod) and form.relative and form.reads_head
    assert mask_mod_reads(documents, device=torch.device("meta")) == (False, False)


def test_a_mod_is_traced_once_until_what_it_reads_changes(monkeypatch):
    """Tracing takes milliseconds: an eager call's mods are traced once, again where a
    number they read changes (a soft cap's value) and every call where what they read
    cannot be told (a list)."""
    from bob_compile import block_masks, flex
    traces, real = [], block_masks.trace_mod
    monkeypatch.setattr(flex, "trace_mod", lambda *a, **k: traces.append(1) or real(*a, **k))
    cap, factors = 30.0, [0.5]

    def capped(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    def from_list(score, b, h, q_idx, kv_idx):
        return score + factors[0] * (q_idx - kv_idx)
    assert flex.score_mod_form(capped, torch.float64).softcap == 30.0
    assert flex.score_mod_form(capped, torch.float64).softcap == 30.0 and len(traces) == 1
    cap = 50.0
    assert flex.score_mod_form(capped, torch.float64).softcap == 50.0 and len(traces) == 2
    for _ in range(2):
        flex.score_mod_form(from_list, torch.float64)
    assert len(traces) == 4


RELATIVE_TABLE = torch.randn(3, 128, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(11))


def t5_buckets(score, b, h, q_idx, kv_idx):
    """T5's bidirectional relative-position buckets (8 exact, 8 logarithmic up to 64, per
    direction) into a table per head."""
    relative = kv_idx - q_idx
    distance = relative.abs()
    large = 8 + (torch.log(distance.clamp_min(1).to(torch.float64) / 8) / math.log(64 / 8)
                 * 8).to(torch.int64)
    bucket = torch.where(distance < 8, distance, large.clamp_max(15)) + 16 * (relative > 0)
    return score + RELATIVE_TABLE[h, bucket]


def grid(L, S):
    return (torch.arange(B).view(-1, 1, 1, 1), torch.arange(H).view(1, -1, 1, 1),
            torch.arange(L).view(1, 1, -1, 1), torch.arange(S).view(1, 1, 1, -1))


@pytest.mark.parametrize("score_mod,mask_mod", [
    (t5_buckets, None), (alibi, sliding_window), (t5_buckets, prefix_lm),
    (alibi, lambda b, h, q_idx, kv_idx: (kv_idx < 4) | ((q_idx >= kv_idx) & (q_idx - kv_idx < 9)))],
    ids=["T5 buckets", "ALiBi + sliding window", "T5 buckets + prefix-LM",
         "ALiBi + sink and window"])
def test_a_relative_bias_reaches_the_op_as_a_row_per_head(monkeypatch, score_mod, mask_mod):
    """A relative bias comes as L + S - 1 values per head with the mask's tiles (nothing
    L x S: the materializing path is never called), every order equal to math with the same
    dense bias and mask; L != S."""
    from bob_compile import flex
    monkeypatch.setattr(flex, "additive_bias", None)      # any materialization fails
    monkeypatch.setattr(flex, "visible_pairs", None)
    L, S = 37, 45
    q, k, v = inputs(L, S, seed=6)
    block_mask = None if mask_mod is None else create_block_mask(
        mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    b, h, q_idx, kv_idx = grid(L, S)
    bias = score_mod(torch.zeros(()), b, h, q_idx, kv_idx).expand(B, H, L, S)
    visible = None if mask_mod is None else mask_mod(b, h, q_idx, kv_idx).expand(B, H, L, S)
    assert_second_orders_equal_math(score_mod, block_mask, visible, bias, q, k, v)


def test_a_relative_bias_beside_blocks_that_are_not_powers_of_two_is_materialized():
    """The tiles take blocks of powers of two: a BlockMask of 24-token blocks with ALiBi
    gets the bias materialized with its mask (eagerly and as a packed mask resolves),
    every order exact."""
    from bob_compile import block_masks
    L = 53
    block_mask = create_block_mask(sliding_window, None, None, L, L, device="cpu",
                                   BLOCK_SIZE=24)
    q, k, v = inputs(L, L, seed=8)
    assert_second_orders_equal_math(alibi, block_mask, dense(sliding_window, L, L),
                                    alibi_bias(L, L), q, k, v)
    blocks = block_masks.Blocks.of(block_mask)
    rows_of_the_bias = SLOPES.view(1, H, 1) * -torch.arange(-(L - 1), L)   # at q - k + L - 1
    form = block_masks.key_intervals(blocks, L, L, "cpu", B, H, relative_bias=rows_of_the_bias)
    want = alibi_bias(L, L).masked_fill(~dense(sliding_window, L, L), float("-inf"))
    assert form.dtype == torch.float64 and form.shape == (1, H, L, L)
    torch.testing.assert_close(form, want.expand(1, H, L, L))
    # a compiled graph's packed BlockMask with the bias resolves to the same
    module = torch.fx.symbolic_trace(sliding_window)
    blocks.mask_mod = module
    packed = block_masks.pack(blocks, block_masks.register_mask_mod(module), rows_of_the_bias)
    torch.testing.assert_close(block_masks.resolve(packed, B, H, L, L),
                               want.expand(B, H, L, L))


def test_a_learned_relative_bias_is_materialized_for_its_gradient():
    """A relative table that requires grad: the bias is materialized (its cotangent is
    L x S before it is summed into the table), the table's gradient exact."""
    L = 26
    table = torch.randn(2 * L - 1, dtype=torch.float64, requires_grad=True)

    def learned(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx + L - 1]
    q, k, v = inputs(L, L, seed=7)
    got = torch.autograd.grad(
        bob_compile.flex_attention(q, k, v, score_mod=learned).square().sum(), table)[0]
    positions = torch.arange(L)[:, None] - torch.arange(L)[None, :] + L - 1
    want = torch.autograd.grad(
        math_attention(q, k, v, bias=table[positions]).square().sum(), table)[0]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def per_head_window(b, h, q_idx, kv_idx):       # a window per head (3, 6, 9 keys)
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 3 * (h + 1))


@pytest.mark.parametrize("mask_mod,L,S,sizes", [
    (sliding_window, 45, 45, (None, None)), (prefix_lm, 37, 29, (None, None)),
    (per_head_window, 50, 50, (None, H)), (causal, 16, 16, (None, None))],
    ids=["sliding window", "prefix-LM, L > S", "a window per head", "one block"])
def test_both_ways_of_materializing_a_block_mask_give_its_pairs(mask_mod, L, S, sizes,
                                                               monkeypatch):
    """Eagerly the mask_mod is evaluated on the listed partial blocks only (their list read
    on the host); where no synchronization may happen (traced graphs, CUDA graph capture)
    over every pair, a chunk of rows at a time. Both must give the BlockMask's pairs: its
    mask_mod inside its listed blocks, nothing outside (odd lengths, L != S, heads)."""
    from bob_compile import block_masks
    block_mask = create_block_mask(mask_mod, *sizes, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    blocks = block_masks.Blocks.of(block_mask)
    q_idx, kv_idx = torch.arange(L)[:, None], torch.arange(S)[None, :]
    heads = torch.arange(H).view(1, -1, 1, 1)
    want = mask_mod(0, heads, q_idx, kv_idx).expand(1, H, L, S)
    by_block = block_masks.visible_pairs(blocks, L, S, "cpu", B, H)
    assert torch.equal(by_block.expand(1, H, L, S), want)
    # the route of traced graphs, where the lists cannot be read on the host
    monkeypatch.setattr(block_masks, "may_synchronize", lambda tensor: False)
    by_rows = block_masks.visible_pairs(blocks, L, S, "cpu", B, H)
    assert torch.equal(by_rows, by_block)


def test_a_traced_call_materializes_without_reading_the_block_lists():
    """Inside make_fx (as AOTAutograd traces a compiled model's flex_call) the lists are fake
    or functional tensors: the mask is evaluated over every pair, no nonzero in the graph."""
    from bob_compile import block_masks
    L = 40
    block_mask = create_block_mask(prefix_lm, None, None, L, L, device="cpu",
                                   BLOCK_SIZE=BLOCK)
    blocks = block_masks.Blocks.of(block_mask)
    lists = (blocks.kv_num_blocks, blocks.kv_indices, blocks.full_kv_num_blocks,
             blocks.full_kv_indices)
    graph = torch.fx.experimental.proxy_tensor.make_fx(
        lambda *lists: block_masks.visible_pairs(
            block_masks.Blocks((L, L), (BLOCK, BLOCK), *lists, prefix_lm, (), (False, False)),
            L, L, "cpu", 1, 1))(*lists)
    assert not any("nonzero" in str(n.target) for n in graph.graph.nodes)
    assert torch.equal(graph(*lists), block_masks.visible_pairs(blocks, L, L, "cpu", 1, 1))
    assert torch.equal(graph(*lists)[0, 0], dense(prefix_lm, L, L))
