"""The Triton kernels under TRITON_INTERPRET=1 (CPU), against the float64 closed form.

Every output of forward, backward, bob and bob_folded is compared, on the same inputs, with
bob_compile/kernels/reference.py evaluated in float64, by relative L2 error. Shapes are tiny but cross
the interpreter's 16/32-wide tiles: odd lengths, L < S and L > S, causal and not, E != Ev,
head dims that are not powers of two, GQA, strided inputs, None cotangents, S == 0 and
L == 0, NaN and infinite inputs, masks (boolean and additive, broadcast, with rows that see
no key), and both BoB/backward schedules (deterministic two-pass and fp32 atomics).
fp32 and fp16 only: the interpreter mishandles bf16.
"""
import math
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

# TRITON_INTERPRET must be set before triton is first imported, and importing torch's and
# this package's modules (conftest does) already imports triton. So in a normal pytest run
# this module starts itself again in a fresh process with the variable set, and the tests
# below run there: those of the tier that started it (`-m "not slow"` or `-m slow`).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def in_interpreter(test):
    """Runs in the interpreter process only (deselected outside it: conftest.py); the first
    case of a parametrized test in the default tier, the sweep in the slow tier."""
    return pytest.mark.sweep(pytest.mark.interpreter_subprocess(test))


@pytest.mark.spawns
@pytest.mark.skipif(INTERPRETED, reason="already inside the interpreter process")
@pytest.mark.parametrize("tier", ["not slow", pytest.param("slow", marks=pytest.mark.slow)])
def test_kernels_under_the_interpreter(tier):
    # one intra-op thread: the shapes are tiny, and pytest-xdist runs other tests beside it
    workers = ["-n", "auto"] if tier == "slow" else []       # the sweep: ~10 CPU-minutes
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *workers, "-m", tier, os.path.abspath(__file__)],
                          env=dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]


from bob_compile.kernels import reference, settings  # noqa: E402
from bob_compile.kernels.params import AttentionParams  # noqa: E402


if INTERPRETED:
    import triton.language as tl  # noqa: E402

    from bob_compile.kernels import triton_attention, triton_forward  # noqa: E402
    from bob_compile.kernels.triton_softcap import capped_scores  # noqa: E402

    @triton.jit
    def _capped_scores_kernel(U, T, TH, n, softcap, SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        t, th = capped_scores(tl.load(U + offs, mask=offs < n), softcap, SOFTCAP)
        tl.store(T + offs, t, mask=offs < n)
        tl.store(TH + offs, th, mask=offs < n)

    if not isinstance(triton_forward._forward_kernel,
                      triton.runtime.interpreter.InterpretedFunction):
        pytest.fail("TRITON_INTERPRET=1 is set but the kernels are compiled, not interpreted")

# Relative L2 bounds. fp32 runs the same arithmetic as the reference up to rounding
# (~1e-7 here); fp16 rounds P, dS, ... to 11 bits before each product (eps = 2^-10).
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3}


def rel_err(actual, expected):
    a, e = actual.double(), expected.double()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def check(name, actual, expected, dtype):
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    # dense (ops.py gives each op output its final layout, bob_compile/kernels/layout.py)
    assert actual.untyped_storage().nbytes() == actual.numel() * actual.element_size(), \
        f"{name} is not a dense tensor of its own"
    assert torch.isfinite(actual).all(), f"{name} has NaN/inf"
    if expected.numel() == 0 or expected.double().norm() == 0:
        assert actual.double().abs().max().item() == 0 if actual.numel() else True, name
        return
    # zero up to float32 rounding (the inputs are of unit scale): e.g. the folded gv with a
    # single visible key, where F - alpha = F (1 - P) and P = 1 up to the lse's rounding
    rounding_level = 1e-5 * expected.numel() ** 0.5
    if expected.double().norm() < rounding_level:
        assert actual.double().norm() < rounding_level, name
        return
    err = rel_err(actual, expected)
    assert err <= TOLERANCE[dtype], f"{name}: relative L2 error {err:.2e} > {TOLERANCE[dtype]}"


def make_inputs(B, Hq, Hkv, L, S, E, Ev, dtype, strided=False):
    if strided:  # (B, L, H, E) storage seen as (B, H, L, E): what a model's reshape gives
        q = torch.randn(B, L, Hq, E, dtype=dtype).transpose(1, 2)
        k = torch.randn(B, S, Hkv, E, dtype=dtype).transpose(1, 2)
        v = torch.randn(B, S, Hkv, Ev, dtype=dtype).transpose(1, 2)
    else:
        q = torch.randn(B, Hq, L, E, dtype=dtype)
        k = torch.randn(B, Hkv, S, E, dtype=dtype)
        v = torch.randn(B, Hkv, S, Ev, dtype=dtype)
    return q, k, v


def f64(*ts):
    return [None if t is None else t.double() for t in ts]


def cast_like(expected, actual):
    """Reference outputs (float64) in the dtype the kernels must return."""
    return [e.to(a.dtype) if e.dtype != a.dtype else e for e, a in zip(expected, actual)]


def run_all_orders(q, k, v, causal, present, with_dlse, dtype, mask=None, dropout_p=0.0,
                   reference_mask=None):
    """Every kernel's outputs against float64 math; `reference_mask`: the mask the reference
    applies, where it differs from the kernels' only where they must not read it."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    # forward
    params = AttentionParams(scale=scale, causal=causal, mask=mask, dropout_p=dropout_p,
                             dropout_seed=torch.tensor(1234567890123) if dropout_p else None)
    exact = params if reference_mask is None else AttentionParams(
        scale=scale, causal=causal, mask=reference_mask, dropout_p=dropout_p,
        dropout_seed=params.dropout_seed)
    o, lse = triton_attention.forward(q, k, v, params)
    ro, rlse = reference.forward(*f64(q, k, v), exact)
    assert o.dtype == q.dtype and lse.dtype == torch.float32
    check("o", o, ro.to(o.dtype) if dtype == torch.float32 else ro.to(o.dtype), dtype)
    if rlse.numel():
        finite = torch.isfinite(rlse)
        assert torch.equal(torch.isfinite(lse), finite), "lse: -inf rows differ"
        if finite.any():
            assert rel_err(lse[finite], rlse[finite]) <= TOLERANCE[dtype]

    # backward, on the kernel's own (o, lse) so that both sides see the same inputs
    do = torch.randn_like(o)
    dlse = torch.randn_like(lse) if with_dlse else None
    grads = triton_attention.backward(q, k, v, o, lse, do, dlse, params)
    expected = reference.backward(*f64(q, k, v, o, lse, do, dlse), exact)
    for name, a, e in zip(("dq", "dk", "dv"), grads, expected):
        check(name, a, e.to(a.dtype), dtype)

    # backward-over-backward
    cot = [torch.randn(t.shape, dtype=t.dtype) if keep else None
           for t, keep in zip((q, k, v), present)]
    outs = triton_attention.bob(q, k, v, o, lse, do, dlse, *cot, params)
    expected = reference.bob(*f64(q, k, v, o, lse, do, dlse, *cot), exact)
    for name, a, e in zip(reference.BOB_OUTPUTS, outs, expected):
        check(name, a, e.to(a.dtype), dtype)

    # the folded form (one schedule of its own: the row pass, then the column pass)
    # R recomputed in its row pass, and read from the first backward's dq (as autograd runs it)
    if not settings.current().bob_row_atomics:
        expected = reference.bob_folded(*f64(q, k, v, o, lse, do, dlse, *cot, None), exact)
        for dq, tag in ((None, ""), (grads[0], " (dq given)")):
            outs = triton_attention.bob_folded(q, k, v, o, lse, do, dlse, *cot, dq, params)
            for name, a, e in zip(reference.BOB_FOLDED_OUTPUTS, outs, expected):
                check("folded " + name + tag, a, e.to(a.dtype), dtype)


CASES = [
    # B, Hq, Hkv, L, S, E, Ev, causal
    pytest.param(1, 2, 2, 37, 29, 16, 32, False, id="noncausal-L>S-E<Ev"),
    pytest.param(2, 1, 1, 23, 45, 32, 16, False, id="noncausal-L<S-E>Ev"),
    pytest.param(1, 2, 2, 45, 45, 16, 16, True, id="causal-square-odd"),
    pytest.param(1, 2, 1, 29, 41, 16, 16, True, id="causal-L<S-gqa2"),
    pytest.param(1, 3, 1, 41, 19, 20, 12, True, id="causal-L>S-gqa3-E20-Ev12"),
    pytest.param(1, 1, 1, 1, 1, 16, 16, True, id="causal-one-query-one-key"),
    pytest.param(1, 2, 2, 3, 70, 80, 8, False, id="noncausal-L3-S70-E80-Ev8"),
]
# attention dropout (p = 0.3): every kernel regenerates the call's mask
DROPOUT_CASES = [
    pytest.param(1, 2, 1, 29, 41, 16, 16, True, 0.3, id="dropout-causal-L<S-gqa2"),
    pytest.param(1, 2, 2, 37, 29, 16, 32, False, 0.3, id="dropout-noncausal-L>S-E<Ev"),
]


@in_interpreter
@pytest.mark.parametrize("schedule", ["two_pass", "atomic"])
@pytest.mark.parametrize("B,Hq,Hkv,L,S,E,Ev,causal,dropout_p",
                         [pytest.param(*case.values, 0.0, id=case.id) for case in CASES]
                         + DROPOUT_CASES)
def test_every_output_fp32(monkeypatch, schedule, B, Hq, Hkv, L, S, E, Ev, causal, dropout_p):
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_SCHEDULE", schedule)
    monkeypatch.setenv("BOB_COMPILE_DEV_BWD_DQ", schedule)
    settings.reload()
    q, k, v = make_inputs(B, Hq, Hkv, L, S, E, Ev, torch.float32)
    run_all_orders(q, k, v, causal, (True, True, True), True, torch.float32,
                   dropout_p=dropout_p)


@in_interpreter
@pytest.mark.parametrize("causal", [False, True])
def test_every_output_fp16_strided(causal):
    q, k, v = make_inputs(1, 2, 1, 33, 47, 32, 16, torch.float16, strided=True)
    assert not q.is_contiguous()
    run_all_orders(q, k, v, causal, (True, True, True), True, torch.float16)


@in_interpreter
@pytest.mark.parametrize("schedule", ["two_pass", "atomic"])
@pytest.mark.parametrize("present", [(True, False, False), (False, True, False),
                                     (False, False, True), (True, True, False),
                                     (False, True, True)],
                         ids=["gdq", "gdk", "gdv", "gdq+gdk", "gdk+gdv"])
def test_none_cotangents(monkeypatch, schedule, present):
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_SCHEDULE", schedule)
    settings.reload()
    q, k, v = make_inputs(1, 2, 1, 21, 34, 16, 16, torch.float32)
    run_all_orders(q, k, v, True, present, False, torch.float32)


@in_interpreter
def test_folded_with_and_without_dlse_on_one_shape():
    """The folded row pass reads dlse only when given (HAS_DLSE): calls that differ in that
    alone must not share a launch plan's compiled kernel."""
    q, k, v = make_inputs(1, 2, 2, 21, 21, 16, 16, torch.float32)
    params = AttentionParams(scale=0.25, causal=True)
    o, lse = triton_attention.forward(q, k, v, params)
    do, cot = torch.randn_like(o), [torch.randn_like(t) for t in (q, k, v)]
    for dlse in (torch.randn_like(lse), None, torch.randn_like(lse)):
        outs = triton_attention.bob_folded(q, k, v, o, lse, do, dlse, *cot, None, params)
        expected = reference.bob_folded(*f64(q, k, v, o, lse, do, dlse, *cot, None), params)
        for name, a, e in zip(reference.BOB_FOLDED_OUTPUTS, outs, expected):
            check(name, a, e.to(a.dtype), torch.float32)


@in_interpreter
def test_folded_with_and_without_dq_on_one_shape():
    """The folded row pass reads R from dq only when given (HAS_DQ): calls that differ in
    that alone must not share a launch plan's compiled kernel."""
    q, k, v = make_inputs(1, 2, 2, 21, 21, 16, 16, torch.float32)
    params = AttentionParams(scale=0.25, causal=True)
    o, lse = triton_attention.forward(q, k, v, params)
    do, cot = torch.randn_like(o), [torch.randn_like(t) for t in (q, k, v)]
    dq = triton_attention.backward(q, k, v, o, lse, do, None, params)[0]
    expected = reference.bob_folded(*f64(q, k, v, o, lse, do, None, *cot, None), params)
    for given in (dq, None, dq):
        outs = triton_attention.bob_folded(q, k, v, o, lse, do, None, *cot, given, params)
        for name, a, e in zip(reference.BOB_FOLDED_OUTPUTS, outs, expected):
            check(name, a, e.to(a.dtype), torch.float32)


@in_interpreter
@pytest.mark.parametrize("fold", [False, True])
def test_split_roundings(monkeypatch, fold):
    """The row pass's GEMMs with an fp32 operand rounded to half precision, in two parts
    (high and low): the score cotangent's on every tile (BOB_COMPILE_DEV_SBAR_SPLIT=1), and
    Sbar's, dS's, P's and A's on the masked tiles (BOB_COMPILE_DEV_EDGE_SPLIT, on by default;
    at this length nearly every tile of a causal call is on the diagonal). Both are exact
    like the single GEMMs; the first lowers gq's error, the second gq's and gdo's (measured
    0.70-0.76x and 0.56-0.73x of the single GEMMs' here)."""
    torch.manual_seed(0)
    q, k, v = make_inputs(1, 2, 1, 40, 40, 32, 32, torch.float16, strided=True)
    params = AttentionParams(scale=32 ** -0.5, causal=True)
    o, lse = triton_attention.forward(q, k, v, params)
    do, cot = torch.randn_like(o), [torch.randn_like(t) for t in (q, k, v)]
    if fold:
        outs = lambda: triton_attention.bob_folded(q, k, v, o, lse, do, None, *cot, None, params)
        expected = reference.bob_folded(*f64(q, k, v, o, lse, do, None, *cot, None), params)
        names = reference.BOB_FOLDED_OUTPUTS
    else:
        outs = lambda: triton_attention.bob(q, k, v, o, lse, do, None, *cot, params)
        expected = reference.bob(*f64(q, k, v, o, lse, do, None, *cot), params)
        names = reference.BOB_OUTPUTS
    errors = {}
    for sbar_split, edge_split in (("0", "0"), ("1", "0"), ("0", "1")):
        monkeypatch.setenv("BOB_COMPILE_DEV_SBAR_SPLIT", sbar_split)
        monkeypatch.setenv("BOB_COMPILE_DEV_EDGE_SPLIT", edge_split)
        settings.reload()
        got = dict(zip(names, outs()))
        for name, e in zip(names, expected):
            check(name, got[name], e.to(got[name].dtype), torch.float16)
        errors[sbar_split, edge_split] = {name: rel_err(got[name], e)
                                          for name, e in zip(names, expected)}
    single, sbar, edges = errors["0", "0"], errors["1", "0"], errors["0", "1"]
    assert sbar["gq"] < 0.9 * single["gq"] and sbar["gdo"] == single["gdo"], errors
    assert edges["gq"] < 0.9 * single["gq"] and edges["gdo"] < 0.9 * single["gdo"], errors
    # the column pass's outputs do not change
    assert edges["gk"] == single["gk"] and edges["gv"] == single["gv"], errors


def make_mask(kind, B, Hq, L, S):
    """A (B, Hq, L, S) mask view (broadcast over heads, stride 0) with an empty row and an
    HF-style finite fill."""
    g = torch.Generator().manual_seed(3)
    visible = torch.rand(B, 1, L, S, generator=g) > 0.3
    visible[:, :, 5] = False
    if kind == "bool":
        mask = visible
    else:
        mask = torch.randn(B, 1, L, S, generator=g).masked_fill(~visible, torch.finfo(torch.float32).min)
        mask[:, :, 7, ::2] = -torch.inf
    return mask.expand(B, Hq, L, S)


@in_interpreter
@pytest.mark.parametrize("schedule", ["two_pass", "atomic"])
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("causal", [False, True])
def test_masks_every_output(monkeypatch, schedule, kind, causal):
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_SCHEDULE", schedule)
    monkeypatch.setenv("BOB_COMPILE_DEV_BWD_DQ", schedule)
    settings.reload()
    q, k, v = make_inputs(2, 4, 2, 37, 45, 16, 16, torch.float32)
    run_all_orders(q, k, v, causal, (True, True, True), True, torch.float32,
                   mask=make_mask(kind, 2, 4, 37, 45))


@pytest.mark.slow      # 20 s in the interpreter; the default tier's mask cases are the two beside it
@in_interpreter
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("causal", [False, True])
def test_padding_masks_skip_unseen_key_blocks(kind, causal):
    """Key padding as HF builds it: batch 0 left-padded, batch 1 right-padded, batch 2 sees
    no key at all, batch 3 a range whose ends fall on the interpreter's 16-key blocks; the
    kernels skip the key blocks outside each batch's visible range and mask only those
    holding an end of it (and the diagonal)."""
    B, Hq, L, S = 4, 4, 37, 70
    visible = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    visible[0, ..., 40:] = True
    visible[1, ..., :21] = True
    visible[3, ..., 16:64] = True
    mask = visible if kind == "bool" else \
        torch.zeros(B, 1, 1, S).masked_fill(~visible, torch.finfo(torch.float32).min)
    q, k, v = make_inputs(B, Hq, 2, L, S, 16, 16, torch.float32)
    run_all_orders(q, k, v, causal, (True, True, True), True, torch.float32,
                   mask=mask.expand(B, Hq, L, S))


@pytest.mark.slow      # 20 s in the interpreter; the default tier's mask cases are the two beside it
@in_interpreter
@pytest.mark.parametrize("schedule", ["two_pass", "atomic"])
def test_heads_of_a_group_whose_masks_differ_in_kind(monkeypatch, schedule):
    """Per-head masks under GQA: in one key/value group a head whose mask is a key range
    (applied from indices) beside one whose mask must be read. The row-major kernels take
    each query head by its own kind; the key-block-major ones, which sum over the group,
    read the mask for the whole group (tiles.py, MASK_PATH)."""
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_SCHEDULE", schedule)
    monkeypatch.setenv("BOB_COMPILE_DEV_BWD_DQ", schedule)
    settings.reload()
    B, Hq, Hkv, L, S = 2, 4, 2, 37, 70
    g = torch.Generator().manual_seed(11)
    mask = torch.zeros(B, Hq, L, S, dtype=torch.bool)
    mask[:, 0, :, 5:60] = True                          # group 0: a key range ...
    mask[:, 1] = torch.rand(B, L, S, generator=g) > 0.4   # ... beside a pattern
    mask[:, 2, :, :50] = True                           # group 1: key ranges only
    mask[:, 3, :, 17:] = True
    from bob_compile.kernels.triton_masks import mask_summary
    assert mask_summary(mask)[0, :, 0, 2].tolist() == [1, 0, 1, 1]
    q, k, v = make_inputs(B, Hq, Hkv, L, S, 16, 16, torch.float32)
    run_all_orders(q, k, v, True, (True, True, True), True, torch.float32, mask=mask)


def hf_mask(kind, B, L, S, left, extra_key=False, hole=False):
    """Hugging Face's 4-D mask: key padding and a top-left causal mask in one (B, 1, L, S)
    tensor (bool, or additive with the finfo.min fill); batch b keeps S - 9 b keys, at the
    end if left-padded. extra_key: one pair above the diagonal made visible in batch 1 (no
    longer structured: the kernels must read it); hole: one visible pair hidden in batch 1
    (read, with the blocks above the diagonal skipped)."""
    keys = torch.arange(S)
    lengths = [S - 9 * b for b in range(B)]
    valid = torch.stack([(keys >= S - n) if left else (keys < n) for n in lengths])
    visible = valid[:, None, None, :] & (keys[None, :] <= torch.arange(L)[:, None])
    if extra_key:
        visible[1, 0, 3, 20] = True
    if hole:
        visible[1, 0, 30, 29] = False
    if kind == "bool":
        return visible
    return torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)


@in_interpreter
@pytest.mark.parametrize("kind,left,extra_key,schedule", [
    ("bool", False, False, "two_pass"), ("additive", True, False, "atomic"),
    ("bool", True, True, "atomic"), ("additive", False, True, "two_pass"),
    ("bool", False, "hole", "two_pass")],
    ids=["bool-right-structured", "additive-left-structured-atomic", "bool-left-read-atomic",
         "additive-right-read", "bool-right-read-below-the-diagonal"])
def test_hf_masks_every_output(monkeypatch, kind, left, extra_key, schedule):
    """Padding with the causal mask folded in, as HF passes it (is_causal=False): applied
    from indices, with the key blocks above the diagonal skipped (mask_summary), or read
    where one pair breaks the structure (key padding alone, broadcast over rows, is the
    padding test above); both schedules (the atomic one's row sums see every pair its
    column pass visits)."""
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_SCHEDULE", schedule)
    monkeypatch.setenv("BOB_COMPILE_DEV_BWD_DQ", schedule)
    settings.reload()
    B, Hq, L, S = 3, 4, 45, 45
    hole = extra_key == "hole"
    extra_key = extra_key is True
    mask = hf_mask(kind, B, L, S, left, extra_key, hole).expand(B, Hq, L, S)
    from bob_compile.kernels.triton_masks import (KEYS_IN_RANGE_CAUSAL, READ_THE_MASK_CAUSAL,
                                                  mask_summary)
    structures = mask_summary(mask)[:, 0, 0, 2].tolist()
    assert structures[1] == (READ_THE_MASK_CAUSAL if hole else
                             KEYS_IN_RANGE_CAUSAL if not extra_key else 0)
    q, k, v = make_inputs(B, Hq, 2, L, S, 16, 16, torch.float32)
    run_all_orders(q, k, v, False, (True, True, True), True, torch.float32, mask=mask)


def sliding_window_and_documents(L):
    """Batch 0: a causal sliding window of 9 keys; batch 1: two packed documents [0, L/2)
    and [L/2, L), each seeing all of itself (bidirectional)."""
    rows, keys = torch.arange(L)[:, None], torch.arange(L)[None, :]
    window = (keys <= rows) & (rows - keys < 9)
    documents = (rows < L // 2) == (keys < L // 2)
    return torch.stack((window, documents))[:, None]


@in_interpreter
@pytest.mark.parametrize("schedule", ["two_pass", "atomic"])
def test_read_masks_visit_only_the_blocks_their_rows_see(monkeypatch, schedule):
    """A sliding window and packed documents are read per tile, each row block over the key
    blocks its own rows see and each key block over the query blocks that see it
    (KEY_RANGE's per-row and per-column ranges), not the whole square: the additive mask
    holds NaN far from any visible pair (queries < 16 with keys >= 80 and the converse,
    beyond any tile of <= 32 that holds a visible pair), which a kernel reading it would
    spread into its outputs; every order still equals the reference's with -inf there."""
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_SCHEDULE", schedule)
    monkeypatch.setenv("BOB_COMPILE_DEV_BWD_DQ", schedule)
    settings.reload()
    B, Hq, L = 2, 2, 96
    visible = sliding_window_and_documents(L).expand(B, Hq, L, L)
    clean = torch.zeros(B, Hq, L, L).masked_fill(~visible, float("-inf"))
    clean[:, :, 40, 40] = 0.5       # a bias on one visible pair: read (not KEY_INTERVALS)
    poisoned = clean.clone()
    poisoned[1, :, :16, 80:] = float("nan")
    poisoned[1, :, 80:, :16] = float("nan")
    poisoned[0, :, :16, 80:] = float("nan")
    q, k, v = make_inputs(B, Hq, 2, L, L, 16, 16, torch.float32)
    run_all_orders(q, k, v, False, (True, True, True), True, torch.float32, mask=poisoned,
                   reference_mask=clean)


@in_interpreter
def test_read_masks_of_one_gqa_group_narrow_each_head_on_its_own():
    """Two query heads of one key/value group, one with the sliding window and one with the
    documents: the key-block-major kernels, which walk the group's heads for each key block,
    narrow each head's query loop by that head's own ranges (NaN where only the other
    head's tiles would reach)."""
    B, Hq, L = 1, 2, 96
    visible = sliding_window_and_documents(L).transpose(0, 1)        # (1, 2, L, L)
    clean = torch.zeros(B, Hq, L, L).masked_fill(~visible, float("-inf"))
    clean[:, :, 40, 40] = 0.5       # read (not KEY_INTERVALS)
    poisoned = clean.clone()
    poisoned[0, 0, :16, 80:] = float("nan")          # the window's head: far above and below
    poisoned[0, 0, 80:, :16] = float("nan")
    poisoned[0, 1, :16, 80:] = float("nan")          # the documents' head
    poisoned[0, 1, 80:, :16] = float("nan")
    q, k, v = make_inputs(B, Hq, 1, L, L, 16, 16, torch.float32)
    run_all_orders(q, k, v, False, (True, True, True), True, torch.float32, mask=poisoned,
                   reference_mask=clean)


def interval_masks(L):
    """Masks whose rows and columns are each one interval (KEY_INTERVALS), wide enough that
    the interpreter's 16 x 16 tiles hold blocks seen whole: a causal sliding window of 40
    keys, packed causal documents of 20-40 tokens, prefix-LM with a 37-token prefix."""
    rows, keys = torch.arange(L)[:, None], torch.arange(L)[None, :]
    starts = torch.tensor([0, 23, 43, 83])
    document = (torch.arange(L)[:, None] >= starts).sum(-1)
    window = (keys <= rows) & (rows - keys < 40)
    documents = (document[:, None] == document[None, :]) & (keys <= rows)
    prefix = (keys <= rows) | (keys < 37)
    return torch.stack((window, documents, prefix))[:, None]


@in_interpreter
@pytest.mark.parametrize("schedule", ["two_pass", "atomic"])
def test_masks_of_intervals_are_applied_without_reading_them(monkeypatch, schedule):
    """A sliding window, packed documents and prefix-LM are KEY_INTERVALS: every kernel
    applies them from each row's key interval (each key's query interval in the key-block
    major passes), with the blocks every row sees whole unmasked. NaN in every hidden pair
    of the additive mask (below the -1e4 that hides a pair) would spread into any output of
    a kernel that read it; every order equals the reference's with -inf there."""
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_SCHEDULE", schedule)
    monkeypatch.setenv("BOB_COMPILE_DEV_BWD_DQ", schedule)
    settings.reload()
    from bob_compile.kernels.triton_masks import KEY_INTERVALS, mask_summary
    B, Hq, L = 3, 2, 99
    visible = interval_masks(L).expand(B, Hq, L, L)
    clean = torch.zeros(B, Hq, L, L).masked_fill(~visible, float("-inf"))
    poisoned = clean.masked_fill(~visible, float("nan"))
    assert mask_summary(poisoned)[:, :, 0, 2].unique().tolist() == [KEY_INTERVALS]
    q, k, v = make_inputs(B, Hq, 1, L, L, 16, 16, torch.float32)
    run_all_orders(q, k, v, False, (True, True, True), True, torch.float32, mask=poisoned,
                   reference_mask=clean)


@in_interpreter
def test_masks_of_intervals_as_booleans_with_gqa():
    """The same masks as booleans, three query heads per key/value head with different
    intervals (the key-block-major passes walk the group's heads)."""
    B, Hq, L = 1, 6, 77
    mask = interval_masks(L).transpose(0, 1).repeat(1, 2, 1, 1)     # a group's 3 heads differ
    q, k, v = make_inputs(B, Hq, 2, L, L, 16, 16, torch.float32)
    run_all_orders(q, k, v, False, (True, True, True), True, torch.float32, mask=mask)


@in_interpreter
def test_key_intervals_alone_run_every_kernel():
    """A mask given only as its key intervals (KeyIntervals: what bob_compile.flex_attention
    hands the op for a BlockMask, no L x S tensor at all) runs every kernel as the same
    boolean mask does; the group's three query heads have different intervals."""
    from bob_compile.kernels.interval_masks import KeyIntervals
    from bob_compile.kernels.triton_masks import summarize_with_torch
    B, Hq, L = 2, 3, 77
    visible = interval_masks(L).transpose(0, 1).expand(B, Hq, L, L)
    intervals = KeyIntervals(summarize_with_torch(visible), L, L)
    q, k, v = make_inputs(B, Hq, 1, L, L, 16, 16, torch.float32)
    run_all_orders(q, k, v, False, (True, True, True), True, torch.float32, mask=intervals,
                   reference_mask=visible)


@in_interpreter
@pytest.mark.parametrize("schedule", ["two_pass", "atomic"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block", [16, 32])
def test_block_sparse_masks_every_output(monkeypatch, schedule, causal, block):
    """A mask tile by tile (BlockSparseMask: per (query block, key block) empty, full or a
    stored tile) runs every kernel as the same boolean mask does: blocks the kernels' tiles
    do not align with, L != S and odd, a GQA group's heads with different patterns."""
    from bob_compile.kernels.block_sparse_masks import BlockSparseMask
    from flex_models import tile_by_tile_masks
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_SCHEDULE", schedule)
    monkeypatch.setenv("BOB_COMPILE_DEV_BWD_DQ", schedule)
    settings.reload()
    B, Hq, L, S = 2, 3, 77, 90
    tiles, visible = tile_by_tile_masks(B, Hq, L, S, block)
    assert isinstance(tiles, BlockSparseMask) and torch.equal(tiles.dense(), visible)
    q, k, v = make_inputs(B, Hq, 1, L, S, 16, 16, torch.float32)
    run_all_orders(q, k, v, causal, (True, True, True), True, torch.float32, mask=tiles,
                   reference_mask=visible)


@in_interpreter
def test_block_sparse_masks_of_each_batch_entry_every_output():
    """Tiles per batch entry and head (a mask that reads b: each (b, h) its own table)."""
    from bob_compile.kernels.block_sparse_masks import BlockSparseMask
    from flex_models import tile_by_tile_masks
    B, Hq, L, S = 2, 3, 61, 70
    tiles, visible = tile_by_tile_masks(B, Hq, L, S, 16, per_batch=True)
    assert isinstance(tiles, BlockSparseMask) and tiles.summary.shape[:2] == (B, Hq)
    assert torch.equal(tiles.dense(), visible)
    q, k, v = make_inputs(B, Hq, 1, L, S, 16, 16, torch.float32)
    run_all_orders(q, k, v, False, (True, True, True), True, torch.float32, mask=tiles,
                   reference_mask=visible)


@in_interpreter
@pytest.mark.parametrize("causal", [False, True])
def test_tiles_with_a_relative_bias_every_output(causal):
    """The same tiles carrying a relative bias (a row of L + S - 1 per head: ALiBi, T5's
    buckets), added to each visible score, values at or below -1e4 hiding their pair."""
    from flex_models import tile_by_tile_masks
    B, Hq, L, S = 2, 3, 77, 90
    tiles, additive = tile_by_tile_masks(B, Hq, L, S, 16, relative=True)
    assert tiles.dtype == torch.float32 and torch.equal(tiles.dense(), additive)
    q, k, v = make_inputs(B, Hq, 1, L, S, 16, 16, torch.float32)
    run_all_orders(q, k, v, causal, (True, True, True), True, torch.float32, mask=tiles,
                   reference_mask=additive)


@in_interpreter
@pytest.mark.parametrize("causal", [False, True])
def test_intervals_with_a_relative_bias_every_output(causal):
    """Causal, window and prefix-LM BlockMasks with a relative bias: the mask is applied
    from its intervals (the summary says KEY_INTERVALS: its tiles are never read) and every
    loop adds the bias, the unmasked ones too (tiles.add_relative_bias)."""
    from bob_compile.kernels.interval_masks import KEY_INTERVALS
    from flex_models import tile_by_tile_masks
    B, Hq, L, S = 2, 3, 77, 90
    tiles, additive = tile_by_tile_masks(B, Hq, L, S, 16, relative=True, intervals=True)
    assert tiles.dtype == torch.float32 and torch.equal(tiles.dense(), additive)
    assert (tiles.kernel_summary()[..., 0, 2] == KEY_INTERVALS).all()
    q, k, v = make_inputs(B, Hq, 1, L, S, 16, 16, torch.float32)
    run_all_orders(q, k, v, causal, (True, True, True), True, torch.float32, mask=tiles,
                   reference_mask=additive)


@in_interpreter
def test_read_masks_keep_every_order_exact_with_is_causal():
    """The same masks as booleans under is_causal=True (the documents then causal too)."""
    B, Hq, L = 2, 2, 70
    mask = sliding_window_and_documents(L).expand(B, Hq, L, L)
    q, k, v = make_inputs(B, Hq, 1, L, L, 16, 16, torch.float32)
    run_all_orders(q, k, v, True, (True, True, True), True, torch.float32, mask=mask)


def summary_cases():
    """Masks for the summary kernels: every structure, broadcast heads and rows, L != S,
    additive fills and biases, empty rows and batches."""
    g = torch.Generator().manual_seed(5)
    L, S = 37, 70
    keys, rows = torch.arange(S)[None, :], torch.arange(L)[:, None]
    padding = torch.stack([keys[0] < 70, keys[0] < 33, keys[0] >= 50, keys[0] < 0])
    causal = padding[:, None, None, :] & (keys <= rows)
    hidden = torch.finfo(torch.float32).min
    yield "key padding, rows and heads broadcast", padding[:, None, None, :].expand(4, 3, L, S)
    yield "padding with causal folded in", causal.expand(4, 3, L, S)
    yield "random", (torch.rand(4, 3, L, S, generator=g) > 0.4)
    yield "additive causal", torch.zeros(4, 1, L, S).masked_fill(~causal, hidden).expand(4, 3, L, S)
    biased = torch.zeros(4, 1, L, S).masked_fill(~causal, hidden)
    biased[1, 0, 30, 2] = 0.25
    yield "additive with a bias", biased.expand(4, 3, L, S)
    per_head = torch.ones(2, 3, L, S, dtype=torch.bool)
    per_head[:, 1] = keys <= rows
    per_head[1, 2, 4, 60] = False
    yield "per head", per_head
    holes = causal & (torch.rand(4, 1, L, S, generator=g) > 0.2)
    yield "causal with holes", holes.expand(4, 3, L, S)
    yield "one row", causal[:, :, :1].expand(4, 2, 1, S)
    yield "sliding window and documents", sliding_window_and_documents(L).expand(2, 3, L, L)
    yield "intervals", interval_masks(L).expand(3, 2, L, L)


@in_interpreter
@pytest.mark.parametrize("name,mask", [c for c in summary_cases() if c[0] in (
    "key padding, rows and heads broadcast", "sliding window and documents")],
    ids=["key padding", "sliding window and documents"])
def test_mask_summary_makes_only_what_a_replay_can_make(monkeypatch, name, mask):
    """The summary is part of a masked call's recorded stage (bob_compile/eager/programs.py):
    fresh tensors, views and Triton launches only, no other ATen op (a copy, a cat, a host
    tensor: the C++ node could not replay it, and a CUDA graph could not capture a copy
    from the host)."""
    from bob_compile.eager import programs
    from bob_compile.kernels import triton_masks
    launches = []
    # the launches recorded, not run: the interpreter's own tensor copies are not the stage's
    monkeypatch.setattr(triton_masks, "fixed_plan", lambda key, kwargs: (
        lambda kernel, grid, **arguments: launches.append(kernel.fn.__name__)))
    made = programs._MadeTensors()
    with made:
        triton_masks.mask_summary(mask)
    assert made.refused is None, made.refused
    assert launches == ["_row_stats_kernel", "_row_stats_kernel", "_summary_kernel"]


@in_interpreter
@pytest.mark.parametrize("name,mask", list(summary_cases()), ids=[n for n, _ in summary_cases()])
def test_mask_summary_kernels_match_torch(name, mask):
    from bob_compile.kernels.triton_masks import mask_summary, summarize_with_torch
    ours, expected = mask_summary(mask), summarize_with_torch(mask)
    assert ours.shape == expected.shape and ours.dtype == torch.int32
    assert torch.equal(ours, expected), \
        f"{name}: {ours[:, :, 0].tolist()} != {expected[:, :, 0].tolist()}"


@in_interpreter
def test_masks_fp16_strided():
    q, k, v = make_inputs(1, 2, 1, 33, 47, 32, 16, torch.float16, strided=True)
    mask = make_mask("additive", 1, 2, 33, 47).half()
    run_all_orders(q, k, v, True, (True, False, True), False, torch.float16, mask=mask)


@in_interpreter
def test_all_cotangents_none_gives_zeros():
    q, k, v = make_inputs(1, 2, 2, 17, 19, 16, 16, torch.float32)
    params = AttentionParams(scale=0.25, causal=False)
    o, lse = triton_attention.forward(q, k, v, params)
    outs = triton_attention.bob(q, k, v, o, lse, torch.randn_like(o), None, None, None, None,
                                params)
    for name, t, like in zip(reference.BOB_OUTPUTS, outs, (q, k, v, o, lse, o, lse)):
        assert t.shape == like.shape and t.dtype == like.dtype, name
        assert t.abs().max().item() == 0, name


@in_interpreter
@pytest.mark.parametrize("L,S", [(19, 0), (0, 23)])
@pytest.mark.parametrize("causal", [False, True])
def test_empty_lengths(L, S, causal):
    q, k, v = make_inputs(1, 2, 2, L, S, 16, 16, torch.float32)
    run_all_orders(q, k, v, causal, (True, True, True), True, torch.float32)


# --------------------------------------------------------------------------------------
# Forward mode: the JVPs of the forward and of the backward (triton_forward_mode.py)
# --------------------------------------------------------------------------------------
TANGENTS_OF_BACKWARD = ("tq", "tk", "tv", "to", "tlse", "tdo", "tdlse")


def run_forward_mode(q, k, v, causal, present, dtype, with_dlse=True, dropout_p=0.0,
                     softcap=0.0):
    """Both forward-mode ops against the float64 reference; present: which of the seven
    tangents (TANGENTS_OF_BACKWARD) are given, the first three also for the forward's."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    params = AttentionParams(scale=scale, causal=causal, dropout_p=dropout_p,
                             dropout_seed=torch.tensor(987654321) if dropout_p else None,
                             softcap=softcap)
    o, lse = triton_attention.forward(q, k, v, params)
    do = torch.randn_like(o)
    dlse = torch.randn_like(lse) if with_dlse else None
    likes = (q, k, v, o, lse, do, lse)
    tangents = [torch.randn(like.shape, dtype=like.dtype) if keep else None
                for like, keep in zip(likes, present)]
    tq, tk, tv, to, tlse, tdo, tdlse = tangents
    outs = triton_attention.forward_jvp(q, k, v, o, lse, tq, tk, tv, params)
    expected = reference.forward_jvp(*f64(q, k, v, o, lse, tq, tk, tv), params)
    for name, a, e in zip(("to", "tlse"), outs, expected):
        check(name, a, e.to(a.dtype), dtype)
    outs = triton_attention.backward_jvp(q, k, v, o, lse, do, dlse, *tangents, params)
    expected = reference.backward_jvp(*f64(q, k, v, o, lse, do, dlse, *tangents), params)
    for name, a, e in zip(("tdq", "tdk", "tdv"), outs, expected):
        check(name, a, e.to(a.dtype), dtype)


@in_interpreter
@pytest.mark.parametrize("B,Hq,Hkv,L,S,E,Ev,causal", CASES)
def test_forward_mode_fp32(monkeypatch, B, Hq, Hkv, L, S, E, Ev, causal):
    ran = []
    for name in ("attention_forward_jvp", "attention_backward_jvp"):
        real = getattr(triton_attention, name)
        monkeypatch.setattr(triton_attention, name,
                            lambda *a, _real=real, _name=name: ran.append(_name) or _real(*a))
    q, k, v = make_inputs(B, Hq, Hkv, L, S, E, Ev, torch.float32)
    run_forward_mode(q, k, v, causal, (True,) * 7, torch.float32)
    assert ran == ["attention_forward_jvp", "attention_backward_jvp"]   # not the blockwise path


@in_interpreter
@pytest.mark.parametrize("present", [
    (True, False, False, False, False, False, False),
    (False, True, False, False, False, False, False),
    (False, False, True, False, False, False, False),
    (False, False, False, True, True, False, False),
    (False, False, False, False, False, True, True),
    (True, True, False, False, True, True, False),
], ids=["tq", "tk", "tv", "to+tlse", "tdo+tdlse", "tq+tk+tlse+tdo"])
def test_forward_mode_none_tangents(present):
    q, k, v = make_inputs(1, 2, 1, 21, 34, 16, 16, torch.float32)
    run_forward_mode(q, k, v, True, present, torch.float32, with_dlse=False)


@in_interpreter
@pytest.mark.parametrize("causal", [False, True])
def test_forward_mode_fp16_strided(causal):
    q, k, v = make_inputs(1, 2, 1, 33, 47, 32, 16, torch.float16, strided=True)
    run_forward_mode(q, k, v, causal, (True,) * 7, torch.float16)


@in_interpreter
def test_forward_mode_with_a_mask_takes_the_blockwise_path():
    q, k, v = make_inputs(1, 2, 2, 17, 19, 16, 16, torch.float32)
    params = AttentionParams(scale=0.25, causal=False, mask=make_mask("bool", 1, 2, 17, 19))
    o, lse = triton_attention.forward(q, k, v, params)
    tq = torch.randn_like(q)
    outs = triton_attention.forward_jvp(q, k, v, o, lse, tq, None, None, params)
    expected = reference.forward_jvp(*f64(q, k, v, o, lse, tq), None, None, params)
    for name, a, e in zip(("to", "tlse"), outs, expected):
        check(name, a, e.to(a.dtype), torch.float32)


# --------------------------------------------------------------------------------------
# Non-finite inputs
# --------------------------------------------------------------------------------------
NAN_ROW, NAN_KEY = 20, 9     # a query row of head 1; a key of the one key/value head


def check_nonfinite(name, actual, expected, same_places):
    """Close to the float64 reference wherever both are finite; NaN and infinities at the
    same places when same_places (masked pairs may spread 0 * NaN differently otherwise)."""
    a, e = actual.double(), expected.double()
    if same_places:
        for kind in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(kind(a), kind(e)), f"{name}: {kind.__name__} differs"
    both = torch.isfinite(a) & torch.isfinite(e)
    if both.any() and e[both].norm() > 0:
        err = rel_err(a[both], e[both])
        assert err <= TOLERANCE[torch.float32], f"{name}: relative L2 error {err:.2e}"


def forward_and_backward(q, k, v, causal):
    """(o, lse, grads) of the kernels and of the float64 reference, on the same inputs."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    params = AttentionParams(scale=scale, causal=causal)
    o, lse = triton_attention.forward(q, k, v, params)
    ro, rlse = reference.forward(*f64(q, k, v), params)
    do = torch.randn_like(o)
    grads = triton_attention.backward(q, k, v, o, lse, do, None, params)
    expected = reference.backward(*f64(q, k, v, o, lse, do, None), params)
    return (o, lse, grads), (ro, rlse, expected)


@in_interpreter
@pytest.mark.parametrize("where,causal", [("q", False), ("q", True), ("k", False), ("k", True),
                                          ("v", False)])
def test_nan_reaches_every_row_that_sees_it(where, causal):
    """A NaN gives NaN in o, lse and dq on every row that sees it (it gave zeros and
    lse = -inf); other rows keep their values."""
    q, k, v = make_inputs(1, 2, 1, 37, 29, 16, 16, torch.float32)
    {"q": q[0, 1, NAN_ROW], "k": k[0, 0, NAN_KEY], "v": v[0, 0, NAN_KEY]}[where][3] = float("nan")
    sees = torch.zeros(1, 2, 37, dtype=torch.bool)
    if where == "q":
        sees[0, 1, NAN_ROW] = True
    else:
        sees[:] = torch.arange(37) >= NAN_KEY if causal else True
    (o, lse, grads), (ro, rlse, expected) = forward_and_backward(q, k, v, causal)

    assert torch.equal(torch.isnan(o).any(-1), sees)
    assert torch.equal(torch.isnan(lse), sees if where != "v" else torch.zeros_like(sees))
    check_nonfinite("o", o, ro, same_places=True)
    check_nonfinite("lse", lse, rlse, same_places=True)
    assert torch.isnan(grads[0]).any(-1)[sees].all(), "dq is finite on a row that sees the NaN"
    for name, a, e in zip(("dq", "dk", "dv"), grads, expected):
        check_nonfinite(name, a, e, same_places=not causal)


@in_interpreter
def test_row_whose_scores_are_all_minus_inf_is_zero():
    """SDPA's math path gives such a row zeros (it gave NaN), and no NaN probabilities in
    the backward."""
    q, k, v = make_inputs(1, 2, 1, 37, 29, 16, 16, torch.float32)
    q[0, 1, NAN_ROW] = 0.0
    q[0, 1, NAN_ROW, 0] = -float("inf")
    k[..., 0] = k[..., 0].abs() + 0.1
    (o, lse, grads), (ro, rlse, expected) = forward_and_backward(q, k, v, False)
    assert torch.equal(o[0, 1, NAN_ROW], torch.zeros(16)) and lse[0, 1, NAN_ROW] == -math.inf
    check_nonfinite("o", o, ro, same_places=True)
    check_nonfinite("lse", lse, rlse, same_places=True)
    for name, a, e in zip(("dq", "dk", "dv"), grads, expected):
        check_nonfinite(name, a, e, same_places=True)


@in_interpreter
@pytest.mark.parametrize("causal", [False, True])
def test_folded_row_pass_reading_b_from_a_forward(monkeypatch, causal):
    """Wide heads get B = P k from an attention forward with the keys as values (HAS_B)
    instead of a row-pass accumulator: exact (here forced at every head dim), with and
    without dq, GQA and L != S included."""
    monkeypatch.setattr(triton_attention, "ACCUMULATE_B_MAX_HEAD_DIM", 0)
    q, k, v = make_inputs(1, 4, 2, 19, 19 if causal else 27, 16, 8, torch.float32)
    params = AttentionParams(scale=0.3, causal=causal)
    o, lse = triton_attention.forward(q, k, v, params)
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    cot = [torch.randn_like(t) for t in (q, k, v)]
    dq = triton_attention.backward(q, k, v, o, lse, do, dlse, params)[0]
    expected = reference.bob_folded(*f64(q, k, v, o, lse, do, dlse, *cot, None), params)
    for given in (None, dq):
        outs = triton_attention.bob_folded(q, k, v, o, lse, do, dlse, *cot, given, params)
        for name, a, e in zip(reference.BOB_FOLDED_OUTPUTS, outs, expected):
            check(name, a, e.to(a.dtype), torch.float32)


# ----------------------------------------------------------------------------- dropout
if INTERPRETED:
    import triton.language as tl  # noqa: E402
    from bob_compile.kernels.triton_dropout import dropout_arguments, dropout_tile  # noqa: E402

    @triton.jit
    def _dropout_tiles(SEED, Z, L, S, drop_threshold, keep_scale, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
        """Z of every (batch x head, query, key), one tile per program."""
        bh = tl.program_id(2)
        m0 = tl.program_id(0) * BLOCK_M
        offs_m = m0 + tl.arange(0, BLOCK_M)
        n0 = tl.program_id(1) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        z = dropout_tile(SEED, bh, L, m0, n0, S, drop_threshold, keep_scale, BLOCK_M, BLOCK_N)
        tl.store(Z + bh * L * S + offs_m[:, None] * S + offs_n[None, :], z,
                 mask=(offs_m[:, None] < L) & (offs_n[None, :] < S))

@in_interpreter
def test_dropout_tile_is_the_mask_the_cpu_path_draws():
    """triton_dropout.dropout_tile, at three tile shapes, draws bit for bit the Z that
    dropout.keep_scale (the blockwise path and the oracle) draws: L and S not multiples of
    the tiles or of the 16-blocks one Philox call's group spans, several heads, a seed above
    2**32 (its bits 32-47 join the counter), and several thresholds."""
    from bob_compile.kernels import dropout
    B, H, L, S = 2, 3, 19, 37
    for p in (0.1, 0.5, 0.9):
        params = AttentionParams(scale=1.0, causal=False, dropout_p=p,
                                 dropout_seed=torch.tensor(2 ** 40 + 12345))
        want = dropout.keep_scale(params, (B, H, L, S), slice(0, L), slice(0, S),
                                  torch.float32, "cpu")
        _, seed, threshold, keep_scale = dropout_arguments(params, want)
        for block_m, block_n in ((16, 16), (16, 32), (32, 16)):
            z = torch.full((B, H, L, S), -1.0)
            _dropout_tiles[(triton.cdiv(L, block_m), triton.cdiv(S, block_n), B * H)](
                seed, z, L, S, threshold, keep_scale, BLOCK_M=block_m, BLOCK_N=block_n)
            assert torch.equal(z, want), (p, block_m, block_n)


@in_interpreter
def test_dropout_with_a_mask_fp16_and_the_folded_pass_reading_b(monkeypatch):
    """Dropout beside a mask tensor, in half precision; and B = P k read from a forward
    (wide heads, forced here), which must not drop the keys."""
    q, k, v = make_inputs(2, 4, 2, 37, 45, 16, 16, torch.float16)
    run_all_orders(q, k, v, True, (True, True, True), True, torch.float16,
                   mask=make_mask("bool", 2, 4, 37, 45), dropout_p=0.2)
    monkeypatch.setattr(triton_attention, "ACCUMULATE_B_MAX_HEAD_DIM", 0)
    q, k, v = make_inputs(1, 2, 1, 21, 21, 16, 8, torch.float32)
    params = AttentionParams(scale=0.3, causal=True, dropout_p=0.4, dropout_seed=torch.tensor(5))
    o, lse = triton_attention.forward(q, k, v, params)
    do, cot = torch.randn_like(o), [torch.randn_like(t) for t in (q, k, v)]
    outs = triton_attention.bob_folded(q, k, v, o, lse, do, None, *cot, None, params)
    expected = reference.bob_folded(*f64(q, k, v, o, lse, do, None, *cot, None), params)
    for name, a, e in zip(reference.BOB_FOLDED_OUTPUTS, outs, expected):
        check(name, a, e.to(a.dtype), torch.float32)


@in_interpreter
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_forward_mode(causal):
    q, k, v = make_inputs(1, 2, 1, 29, 41, 16, 16, torch.float32)
    run_forward_mode(q, k, v, causal, (True,) * 7, torch.float32, dropout_p=0.3)


# ----------------------------------------------------------------------------- a learned bias
BIAS_CASES = [  # B, Hq, Hkv, L, S, bias (B', H', L', S'), causal, dropout_p
    pytest.param(2, 2, 1, 29, 41, (1, 2, 29, 41), True, 0.0, id="per-head-causal-gqa"),
    pytest.param(1, 2, 2, 37, 21, (1, 1, 37, 21), False, 0.3, id="shared-dropout"),
    pytest.param(2, 2, 2, 19, 19, (2, 2, 19, 19), True, 0.0, id="full"),
]


@in_interpreter
@pytest.mark.parametrize("B,Hq,Hkv,L,S,bias_shape,causal,dropout_p", BIAS_CASES)
def test_learned_bias_cotangents(B, Hq, Hkv, L, S, bias_shape, causal, dropout_p):
    """backward_bias (dS added into the bias's shape from the backward's column pass) and
    bob_folded_bias (gdM added to F in both passes, Sbar added into the bias's shape from
    the folded column pass) against the float64 reference, whose bias cotangents the CPU
    tests hold to autograd through math."""
    q, k, v = make_inputs(B, Hq, Hkv, L, S, 16, 16, torch.float32)
    bias = torch.randn(*bias_shape)
    if len(bias_shape) == 4 and bias_shape[1] == Hq and bias_shape[0] == 1:
        bias[:, :, 3, :5] = -torch.inf        # hidden pairs: no cotangent there
    params = AttentionParams(scale=0.3, causal=causal, mask=bias.expand(B, Hq, L, S),
                             dropout_p=dropout_p,
                             dropout_seed=torch.tensor(99) if dropout_p else None)
    o, lse = triton_attention.forward(q, k, v, params)
    do = torch.randn_like(o)
    gdq, gdk, gdv = (torch.randn_like(t) for t in (q, k, v))
    gdbias = torch.randn(bias_shape)
    params64 = AttentionParams(scale=0.3, causal=causal, mask=bias.double().expand(B, Hq, L, S),
                               dropout_p=dropout_p, dropout_seed=params.dropout_seed)
    first = triton_attention.backward_bias(q, k, v, o, lse, do, None, params)
    want = reference.backward_bias(*f64(q, k, v, o, lse, do), None, params64)
    for name, a, e in zip(("dq", "dk", "dv", "dbias"), first, want):
        check(name, a, e.to(a.dtype), torch.float32)
    for cotangents in ((gdq, gdk, gdv, gdbias), (None, None, None, gdbias), (gdq, None, gdv, None)):
        second = triton_attention.bob_folded_bias(q, k, v, o, lse, do, None, *cotangents, None,
                                                  params)
        want = reference.bob_folded_bias(*f64(q, k, v, o, lse, do), None, *f64(*cotangents),
                                         None, params64)
        for name, a, e in zip((*reference.BOB_FOLDED_OUTPUTS, "gbias"), second, want):
            check(name, a, e.to(a.dtype), torch.float32)


@in_interpreter
def test_learned_bias_under_deterministic_algorithms():
    """A bias shared by batch entries and heads: under torch.use_deterministic_algorithms its
    cotangents go to a full-size buffer (one add per element) and are summed after; the
    results equal the atomics' (up to the order of the fp32 sums)."""
    q, k, v = make_inputs(2, 2, 2, 21, 19, 16, 16, torch.float32)
    bias = torch.randn(1, 1, 21, 19)
    params = AttentionParams(scale=0.3, causal=True, mask=bias.expand(2, 2, 21, 19))
    o, lse = triton_attention.forward(q, k, v, params)
    do, gdbias = torch.randn_like(o), torch.randn(1, 1, 21, 19)
    cot = [torch.randn_like(t) for t in (q, k, v)]

    def both():
        return (triton_attention.backward_bias(q, k, v, o, lse, do, None, params)[3],
                triton_attention.bob_folded_bias(q, k, v, o, lse, do, None, *cot, gdbias, None,
                                                 params)[5])
    shared = both()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert triton_attention._bias_accumulator(params).shape == (2, 2, 21, 19)
        full = both()
    finally:
        torch.use_deterministic_algorithms(previous)
    for a, e in zip(full, shared):
        assert a.shape == (1, 1, 21, 19)
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


@in_interpreter
@pytest.mark.parametrize("holds", ["zeros", "causal_pattern", "padding_pattern"])
def test_learned_bias_whose_values_look_like_a_structured_mask(holds):
    """A bias that now holds zeros (a fresh learned bias), the causal pattern or a padding
    pattern: the mask's summary runs the unmasked or index paths, which must still add every
    visible pair's dS and Sbar into the bias's cotangents and read gdM there."""
    B, H, L, S = 2, 2, 24, 24
    q, k, v = make_inputs(B, H, H, L, S, 16, 16, torch.float32)
    bias = torch.zeros(1, H, L, S)
    if holds == "causal_pattern":
        bias = bias.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), -torch.inf)
    elif holds == "padding_pattern":
        bias[..., 17:] = -torch.inf
    params = AttentionParams(scale=0.3, causal=False, mask=bias.expand(B, H, L, S))
    params64 = AttentionParams(scale=0.3, causal=False, mask=bias.double().expand(B, H, L, S))
    o, lse = triton_attention.forward(q, k, v, params)
    do, gdbias = torch.randn_like(o), torch.randn(1, H, L, S)
    cot = [torch.randn_like(t) for t in (q, k, v)]
    first = triton_attention.backward_bias(q, k, v, o, lse, do, None, params)
    want = reference.backward_bias(*f64(q, k, v, o, lse, do), None, params64)
    check("dbias", first[3], want[3].float(), torch.float32)
    second = triton_attention.bob_folded_bias(q, k, v, o, lse, do, None, *cot, gdbias, None,
                                              params)
    want = reference.bob_folded_bias(*f64(q, k, v, o, lse, do), None, *f64(*cot, gdbias), None,
                                     params64)
    for name, a, e in zip((*reference.BOB_FOLDED_OUTPUTS, "gbias"), second, want):
        check(name, a, e.float(), torch.float32)


# ----------------------------------------------------------------------------- soft-capped scores
SOFTCAP_CASES = [  # B, Hq, Hkv, L, S, E, Ev, causal, softcap
    pytest.param(1, 2, 1, 37, 29, 16, 16, False, 0.7, id="noncausal-L>S-gqa2-cap0.7"),
    pytest.param(1, 2, 2, 29, 41, 16, 32, True, 30.0, id="causal-L<S-E<Ev-cap30"),
    pytest.param(1, 3, 1, 45, 45, 20, 12, True, 0.7, id="causal-square-gqa3-E20-Ev12-cap0.7"),
    pytest.param(2, 1, 1, 23, 45, 32, 16, False, 30.0, id="noncausal-L<S-E>Ev-cap30"),
]


def capped_inputs(B, Hq, Hkv, L, S, E, Ev, dtype, softcap):
    """make_inputs with q and k spread so that the cap bends the scores: U = q·k / sqrt(E)
    of std max(4, c / 2), against c tanh(U / c) that departs from U from |U| ~ c / 2 on."""
    q, k, v = make_inputs(B, Hq, Hkv, L, S, E, Ev, torch.float32)
    spread = max(2.0, (softcap / 2) ** 0.5)
    return (q * spread).to(dtype), (k * spread).to(dtype), v.to(dtype)


def softcap_params(q, causal, softcap, mask=None):
    return AttentionParams(scale=q.shape[-1] ** -0.5, causal=causal, mask=mask, softcap=softcap)


def check_first_order(q, k, v, params, dtype, exact=None):
    """forward and backward (with dlse) against the float64 reference; exact: the parameters
    the reference takes where its mask is another form of the kernels'. Returns the
    reference's o."""
    exact = exact or params
    o, lse = triton_attention.forward(q, k, v, params)
    ro, rlse = reference.forward(*f64(q, k, v), exact)
    check("o", o, ro.to(o.dtype), dtype)
    finite = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), finite), "lse: -inf rows differ"
    assert rel_err(lse[finite], rlse[finite]) <= TOLERANCE[dtype]
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    grads = triton_attention.backward(q, k, v, o, lse, do, dlse, params)
    expected = reference.backward(*f64(q, k, v, o, lse, do, dlse), exact)
    for name, a, e in zip(("dq", "dk", "dv"), grads, expected):
        check(name, a, e.to(a.dtype), dtype)
    return ro


@in_interpreter
@pytest.mark.parametrize("schedule", ["two_pass", "atomic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("B,Hq,Hkv,L,S,E,Ev,causal,softcap", SOFTCAP_CASES)
def test_softcap_forward_and_backward(monkeypatch, schedule, dtype, B, Hq, Hkv, L, S, E, Ev,
                                      causal, softcap):
    """Soft-capped scores in the forward and both backward schedules (dq from its own pass,
    or added by atomics from the column pass: each multiplies dT by φ' before the GEMMs)."""
    monkeypatch.setenv("BOB_COMPILE_DEV_BWD_DQ", schedule)
    settings.reload()
    q, k, v = capped_inputs(B, Hq, Hkv, L, S, E, Ev, dtype, softcap)
    params = softcap_params(q, causal, softcap)
    ro = check_first_order(q, k, v, params, dtype)
    uncapped = reference.forward(*f64(q, k, v), softcap_params(q, causal, 0.0))[0]
    assert rel_err(uncapped, ro) > 5 * TOLERANCE[torch.float16], "the cap does not bend"


@in_interpreter
@pytest.mark.parametrize("kind", ["bool", "additive", "intervals"])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_under_masks(kind, causal):
    """The cap applies to the scores before any mask: a boolean mask with a row that sees no
    key, an additive one (finite fill, -inf, a bias on visible pairs), and a mask given by
    its key intervals alone (KeyIntervals: applied from indices)."""
    B, Hq, Hkv, L, S = 2, 4, 2, 37, 45
    if kind == "intervals":
        from bob_compile.kernels.interval_masks import KeyIntervals
        from bob_compile.kernels.triton_masks import summarize_with_torch
        B, Hq, Hkv, L, S = 2, 3, 1, 77, 77
        visible = interval_masks(L).transpose(0, 1).expand(B, Hq, L, S)
        mask, exact_mask = KeyIntervals(summarize_with_torch(visible), L, S), visible
    else:
        mask = exact_mask = make_mask(kind, B, Hq, L, S)
    q, k, v = capped_inputs(B, Hq, Hkv, L, S, 16, 16, torch.float32, 0.7)
    check_first_order(q, k, v, softcap_params(q, causal, 0.7, mask), torch.float32,
                      exact=softcap_params(q, causal, 0.7, exact_mask))


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("B,Hq,Hkv,L,S,bias_shape,causal,softcap", [
    pytest.param(2, 2, 1, 29, 41, (1, 2, 29, 41), True, 0.7, id="per-head-causal-gqa-cap0.7"),
    pytest.param(1, 2, 2, 37, 21, (1, 1, 37, 21), False, 30.0, id="shared-cap30"),
])
def test_softcap_learned_bias(dtype, B, Hq, Hkv, L, S, bias_shape, causal, softcap):
    """backward_bias with a cap: the bias's cotangent is dT, the capped scores' (not
    multiplied by φ', as dq and dk are)."""
    q, k, v = capped_inputs(B, Hq, Hkv, L, S, 16, 16, dtype, softcap)
    bias = torch.randn(*bias_shape)
    bias[:, :, 3, :5] = -torch.inf        # hidden pairs: no cotangent there
    params = softcap_params(q, causal, softcap, bias.to(dtype).expand(B, Hq, L, S))
    params64 = softcap_params(q, causal, softcap, bias.to(dtype).double().expand(B, Hq, L, S))
    o, lse = triton_attention.forward(q, k, v, params)
    do = torch.randn_like(o)
    got = triton_attention.backward_bias(q, k, v, o, lse, do, None, params)
    want = reference.backward_bias(*f64(q, k, v, o, lse, do), None, params64)
    for name, a, e in zip(("dq", "dk", "dv", "dbias"), got, want):
        check(name, a, e.to(a.dtype), dtype)


@in_interpreter
def test_softcap_routing(monkeypatch):
    """What the soft-capped calls leave to other paths: forward mode runs the blockwise path
    (triton_forward_mode has no cap), and the folded BoB of a wide head gets no B = P k from
    an attention forward (it needs (φ' ∘ P) k, which the row pass accumulates)."""
    from bob_compile.kernels import blockwise
    q, k, v = capped_inputs(1, 2, 1, 19, 23, 80, 16, torch.float32, 0.7)
    params = softcap_params(q, False, 0.7)
    assert triton_attention._keys_out(q, k, params) is None
    assert triton_attention._keys_out(q, k, softcap_params(q, False, 0.0)) is not None
    ran = []
    for name in ("forward_jvp", "backward_jvp"):
        monkeypatch.setattr(blockwise, name, lambda *args, _name=name: ran.append(_name))
    o, lse = triton_attention.forward(q, k, v, params)
    do, tq = torch.randn_like(o), torch.randn_like(q)
    triton_attention.forward_jvp(q, k, v, o, lse, tq, None, None, params)
    triton_attention.backward_jvp(q, k, v, o, lse, do, None, tq, None, None, None, None, None,
                                  None, params)
    assert ran == ["forward_jvp", "backward_jvp"]


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal,softcap", [(False, 0.7), (True, 30.0)],
                         ids=["noncausal-cap0.7", "causal-cap30"])
def test_softcap_forward_mode(dtype, causal, softcap):
    """forward_jvp and backward_jvp with a cap, on the blockwise path."""
    q, k, v = capped_inputs(1, 2, 1, 29, 41, 16, 16, dtype, softcap)
    run_forward_mode(q, k, v, causal, (True,) * 7, dtype, softcap=softcap)


SOFTCAP_BOB_CASES = [  # causal, softcap
    pytest.param(False, 0.7, id="noncausal-cap0.7"), pytest.param(True, 30.0, id="causal-cap30")]
SOFTCAP_COTANGENTS = pytest.mark.parametrize(
    "present", [(True, True, True), (True, False, False), (False, True, True)],
    ids=["all", "gdq", "gdk+gdv"])


@in_interpreter
@SOFTCAP_COTANGENTS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal,softcap", SOFTCAP_BOB_CASES)
def test_softcap_bob(causal, softcap, dtype, present):
    q, k, v = capped_inputs(1, 2, 1, 37, 29, 16, 16, dtype, softcap)
    params = softcap_params(q, causal, softcap)
    o, lse = triton_attention.forward(q, k, v, params)
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    cot = [torch.randn_like(t) if keep else None for t, keep in zip((q, k, v), present)]
    outs = triton_attention.bob(q, k, v, o, lse, do, dlse, *cot, params)
    expected = reference.bob(*f64(q, k, v, o, lse, do, dlse, *cot), params)
    for name, a, e in zip(reference.BOB_OUTPUTS, outs, expected):
        check(name, a, e.to(a.dtype), dtype)


@in_interpreter
@pytest.mark.parametrize("wide", [False, True], ids=["B-accumulated", "wide-head"])
@SOFTCAP_COTANGENTS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal,softcap", SOFTCAP_BOB_CASES)
def test_softcap_bob_folded(monkeypatch, causal, softcap, dtype, present, wide):
    """The folded form, R recomputed and read from the first backward's dq; wide: heads that
    read B = P k from a forward without a cap (every head dim here, as
    test_folded_row_pass_reading_b_from_a_forward forces it) accumulate (φ' ∘ P) k with one."""
    if wide:
        monkeypatch.setattr(triton_attention, "ACCUMULATE_B_MAX_HEAD_DIM", 0)
    q, k, v = capped_inputs(1, 4, 2, 29, 29 if causal else 37, 16, 16, dtype, softcap)
    params = softcap_params(q, causal, softcap)
    o, lse = triton_attention.forward(q, k, v, params)
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    cot = [torch.randn_like(t) if keep else None for t, keep in zip((q, k, v), present)]
    dq = triton_attention.backward(q, k, v, o, lse, do, dlse, params)[0]
    expected = reference.bob_folded(*f64(q, k, v, o, lse, do, dlse, *cot, None), params)
    for given, tag in ((None, ""), (dq, " (dq given)")):
        outs = triton_attention.bob_folded(q, k, v, o, lse, do, dlse, *cot, given, params)
        for name, a, e in zip(reference.BOB_FOLDED_OUTPUTS, outs, expected):
            check("folded " + name + tag, a, e.to(a.dtype), dtype)


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal,softcap", SOFTCAP_BOB_CASES)
def test_softcap_bob_folded_bias(causal, softcap, dtype):
    """bob_folded_bias with a cap: gdM adds to the capped scores' cotangent, and the bias's
    cotangent is the capped scores' (Tbar, not Ubar)."""
    B, Hq, L, S = 2, 2, 29, 41
    q, k, v = capped_inputs(B, Hq, 1, L, S, 16, 16, dtype, softcap)
    bias = torch.randn(1, Hq, L, S).to(dtype)
    params = softcap_params(q, causal, softcap, bias.expand(B, Hq, L, S))
    params64 = softcap_params(q, causal, softcap, bias.double().expand(B, Hq, L, S))
    o, lse = triton_attention.forward(q, k, v, params)
    do = torch.randn_like(o)
    cotangents = (*(torch.randn_like(t) for t in (q, k, v)), torch.randn(1, Hq, L, S).to(dtype))
    outs = triton_attention.bob_folded_bias(q, k, v, o, lse, do, None, *cotangents, None, params)
    want = reference.bob_folded_bias(*f64(q, k, v, o, lse, do), None, *f64(*cotangents), None,
                                     params64)
    for name, a, e in zip((*reference.BOB_FOLDED_OUTPUTS, "gbias"), outs, want):
        check(name, a, e.to(a.dtype), dtype)


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal,softcap", SOFTCAP_BOB_CASES)
def test_softcap_newton_reciprocal_every_kernel(monkeypatch, causal, softcap, dtype):
    """BOB_COMPILE_DEV_SOFTCAP_RECIPROCAL=newton (tanh's reciprocal on the FMA units): the
    forward, the backward and the folded BoB as exact as with the multifunction unit's."""
    monkeypatch.setenv("BOB_COMPILE_DEV_SOFTCAP_RECIPROCAL", "newton")
    settings.reload()
    q, k, v = capped_inputs(1, 4, 2, 29, 29 if causal else 37, 16, 16, dtype, softcap)
    params = softcap_params(q, causal, softcap)
    check_first_order(q, k, v, params, dtype)
    o, lse = triton_attention.forward(q, k, v, params)
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    cot = [torch.randn_like(t) for t in (q, k, v)]
    outs = triton_attention.bob_folded(q, k, v, o, lse, do, dlse, *cot, None, params)
    expected = reference.bob_folded(*f64(q, k, v, o, lse, do, dlse, *cot, None), params)
    for name, a, e in zip(reference.BOB_FOLDED_OUTPUTS, outs, expected):
        check("folded " + name, a, e.to(a.dtype), dtype)


@in_interpreter
@pytest.mark.parametrize("reciprocal", [1, 2], ids=["mufu", "newton"])
def test_capped_scores_at_every_magnitude(reciprocal):
    """tanh of either reciprocal within 4e-7 of float64's over 60 binades, +-1 at +-inf and
    beyond the clamp, NaN kept (a NaN score must make its row NaN)."""
    magnitudes = torch.logspace(-30, 30, 2001, base=2, dtype=torch.float64)
    u = torch.cat((magnitudes, -magnitudes, torch.tensor([0.0, float("inf"), -float("inf"),
                                                           float("nan"), 1e30, -1e30]))).float()
    t, th = torch.empty_like(u), torch.empty_like(u)
    _capped_scores_kernel[(triton.cdiv(u.numel(), 1024),)](u, t, th, u.numel(), 3.0,
                                                           reciprocal, 1024)
    want = torch.tanh(u.double() / 3.0)
    finite = ~torch.isnan(u)
    assert (th[finite].double() - want[finite]).abs().max() <= 4e-7
    assert torch.isnan(th[~finite]).all() and torch.isnan(t[~finite]).all()
    assert torch.equal(th[u.abs() >= 1e30], torch.sign(u[u.abs() >= 1e30]))
    assert torch.allclose(t, 3.0 * th, rtol=0, atol=0, equal_nan=True)
