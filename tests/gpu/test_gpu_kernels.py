"""The Triton kernels on a CUDA device against the float64 closed form (bob_compile/kernels/reference.py).

Tolerance rule (flash-attention's): for every output, the relative L2 error of our kernels
against float64 may be at most 3x the error that plain PyTorch math reaches in the same
dtype on the same inputs, plus a small floor. The PyTorch baseline for the chain-form
pieces (o, lse, dq/dk/dv, the seven BoB cotangents) is bob_compile/kernels/reference.py with
upcast=False (the contract's formulas with a plain implementation's roundings in the input
dtype; the BoB by autograd through them); for the full second-order step it is autograd's
double backward through SDPBackend.MATH.
"""
import math
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
triton = pytest.importorskip("triton")

from bob_compile.kernels import native_sdpa, reference, settings, triton_attention  # noqa: E402
from bob_compile.kernels.params import AttentionParams  # noqa: E402


FLOOR = 1e-5  # fp32-level noise that no dtype rule should fail on
FACTOR = 3.0


def rel_err(actual, expected):
    a, e = actual.double(), expected.double()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def second_order_step(attn, q, k, v, do, gq, gk, gv):
    """forward, grad(create_graph=True), second grad: the anchors' benchmark step."""
    q, k, v, do = (t.detach().requires_grad_() for t in (q, k, v, do))
    o = attn(q, k, v)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    return torch.autograd.grad((dq, dk, dv), (q, k, v, do), (gq, gk, gv))


def chain_step(q, k, v, do, gq, gk, gv, scale, causal, impl, mask=None):
    """The same step assembled from the kernel contract (chain form)."""
    params = AttentionParams(scale=scale, causal=causal, mask=mask)
    o, lse = impl.forward(q, k, v, params)
    impl.backward(q, k, v, o, lse, do, None, params)
    bq, bk, bv, go, glse, gdo, _ = impl.bob(q, k, v, o, lse, do, None, gq, gk, gv, params)
    dq2, dk2, dv2 = impl.backward(q, k, v, o, lse, go, glse, params)
    return (bq.double() + dq2.double(), bk.double() + dk2.double(),
            bv.double() + dv2.double(), gdo.double())


def folded_step(q, k, v, do, gq, gk, gv, scale, causal, impl, mask=None):
    """The same step in the folded form (what autograd runs by default)."""
    params = AttentionParams(scale=scale, causal=causal, mask=mask)
    o, lse = impl.forward(q, k, v, params)
    dq = impl.backward(q, k, v, o, lse, do, None, params)[0]
    bq, bk, bv, gdo, _ = impl.bob_folded(q, k, v, o, lse, do, None, gq, gk, gv, dq, params)
    return bq.double(), bk.double(), bv.double(), gdo.double()


def f64(*tensors):
    return [None if t is None else t.double() for t in tensors]


# --------------------------------------------------------------------------------------
def check_against(name, ours, lowp, exact, report):
    ours_err = rel_err(ours, exact)
    base_err = rel_err(lowp, exact)
    report.append(f"{name}: ours {ours_err:.2e}, torch-math same dtype {base_err:.2e}")
    assert torch.isfinite(ours).all(), f"{name}: NaN/inf"
    assert ours_err <= FACTOR * base_err + FLOOR, \
        f"{name}: relative L2 {ours_err:.2e} > {FACTOR} x {base_err:.2e} + {FLOOR}"


CASES = [
    # dtype, B, Hq, Hkv, L, S, E, Ev, causal
    pytest.param(torch.bfloat16, 1, 4, 4, 4096, 4096, 64, 64, True, id="bf16-4096-causal-d64"),
    pytest.param(torch.bfloat16, 1, 4, 4, 4096, 4096, 64, 64, False, id="bf16-4096-d64"),
    pytest.param(torch.bfloat16, 2, 4, 2, 1531, 1000, 128, 128, True, id="bf16-gqa-causal-L>S-d128"),
    # GQA with PyTorch's cuDNN first order (fewer key/value heads taken directly)
    pytest.param(torch.bfloat16, 2, 8, 2, 1000, 1000, 64, 64, True, id="bf16-gqa-causal-d64"),
    pytest.param(torch.bfloat16, 1, 2, 2, 1000, 1531, 64, 128, False, id="bf16-odd-L<S-E!=Ev"),
    pytest.param(torch.bfloat16, 1, 2, 1, 601, 601, 256, 256, True, id="bf16-d256-gqa-causal"),
    pytest.param(torch.float16, 1, 3, 3, 777, 777, 64, 64, True, id="fp16-777-causal"),
    pytest.param(torch.float16, 1, 2, 2, 300, 200, 16, 32, False, id="fp16-d16-Ev32"),
    pytest.param(torch.float32, 1, 2, 2, 513, 513, 32, 64, False, id="fp32-513"),
    pytest.param(torch.float32, 1, 4, 2, 257, 700, 128, 128, True, id="fp32-gqa-causal-L<S"),
]


@pytest.mark.parametrize("schedule", ["two_pass", "atomic"])
@pytest.mark.parametrize("dtype,B,Hq,Hkv,L,S,E,Ev,causal", CASES)
def test_every_output_against_float64(monkeypatch, schedule, dtype, B, Hq, Hkv, L, S, E, Ev,
                                      causal):
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_SCHEDULE", schedule)
    monkeypatch.setenv("BOB_COMPILE_DEV_BWD_DQ", schedule)
    settings.reload()
    check_every_output(dtype, B, Hq, Hkv, L, S, E, Ev, causal)


def padding_mask(kind, B, Hq, L, S, dtype):
    """HF-style key padding (B, 1, 1, S) broadcast to (B, Hq, L, S): batch b keeps its first
    lengths[b] keys; additive masks use HF eager's finfo.min fill."""
    lengths = torch.linspace(S // 3, S, B, device="cuda").long()
    visible = torch.arange(S, device="cuda")[None, :] < lengths[:, None]
    visible = visible[:, None, None, :]
    if kind == "bool":
        return visible.expand(B, Hq, L, S)
    fill = torch.zeros(visible.shape, device="cuda", dtype=dtype)
    return fill.masked_fill(~visible, torch.finfo(dtype).min).expand(B, Hq, L, S)


@pytest.mark.parametrize("schedule", ["two_pass", "atomic"])
@pytest.mark.parametrize("dtype,B,Hq,Hkv,L,S,E,Ev,causal,masked", [
    pytest.param(torch.bfloat16, 1, 4, 4, 2048, 2048, 64, 64, True, False, id="bf16-causal-d64"),
    pytest.param(torch.bfloat16, 2, 4, 2, 777, 1000, 128, 128, False, True,
                 id="bf16-gqa-L<S-d128-masked"),
    pytest.param(torch.float16, 1, 3, 3, 777, 777, 64, 64, True, False, id="fp16-777-causal"),
])
def test_dropout_against_float64(monkeypatch, schedule, dtype, B, Hq, Hkv, L, S, E, Ev, causal,
                                 masked):
    """Every kernel regenerates the call's dropout mask (p = 0.1, HF's default): each
    output within the same factor of math's own error in the same dtype as without dropout."""
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_SCHEDULE", schedule)
    monkeypatch.setenv("BOB_COMPILE_DEV_BWD_DQ", schedule)
    settings.reload()
    mask = padding_mask("bool", B, Hq, L, S, dtype) if masked else None
    check_every_output(dtype, B, Hq, Hkv, L, S, E, Ev, causal, mask=mask, dropout_p=0.1)


@pytest.mark.parametrize("schedule", ["two_pass", "atomic"])
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("dtype,B,Hq,Hkv,L,S,E,Ev,causal", [
    pytest.param(torch.bfloat16, 3, 4, 4, 1024, 1024, 64, 64, True, id="bf16-1024-causal-d64"),
    pytest.param(torch.bfloat16, 2, 4, 2, 777, 1000, 128, 128, False, id="bf16-gqa-L<S-d128"),
])
def test_masks_against_float64(monkeypatch, schedule, kind, dtype, B, Hq, Hkv, L, S, E, Ev,
                               causal):
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_SCHEDULE", schedule)
    monkeypatch.setenv("BOB_COMPILE_DEV_BWD_DQ", schedule)
    settings.reload()
    check_every_output(dtype, B, Hq, Hkv, L, S, E, Ev, causal,
                       padding_mask(kind, B, Hq, L, S, dtype))


@pytest.mark.parametrize("schedule", ["two_pass", "atomic"])
@pytest.mark.parametrize("block,causal,relative", [(128, False, False), (64, True, False),
                                                   (128, True, True)])
def test_tile_by_tile_masks_against_float64(monkeypatch, schedule, block, causal, relative):
    """BlockMasks that are not intervals (dilated, sink + window, random block-sparse per
    head) given tile by tile (BlockSparseMask), with a relative bias or not: every kernel
    against float64, odd lengths, GQA, blocks larger and smaller than the kernels' tiles."""
    from flex_models import tile_by_tile_masks
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_SCHEDULE", schedule)
    monkeypatch.setenv("BOB_COMPILE_DEV_BWD_DQ", schedule)
    settings.reload()
    B, Hq, L, S = 2, 6, 1000, 1100
    tiles, _ = tile_by_tile_masks(B, Hq, L, S, block, device="cuda", relative=relative)
    check_every_output(torch.bfloat16, B, Hq, 3, L, S, 64, 64, causal, tiles)


@pytest.mark.parametrize("schedule", ["two_pass", "atomic"])
def test_intervals_with_a_relative_bias_against_float64(monkeypatch, schedule):
    """Causal, window and prefix-LM BlockMasks with a relative bias per head: the mask
    applied from its intervals, the bias added in every loop (tiles.add_relative_bias)."""
    from bob_compile.kernels.interval_masks import KEY_INTERVALS
    from flex_models import tile_by_tile_masks
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_SCHEDULE", schedule)
    monkeypatch.setenv("BOB_COMPILE_DEV_BWD_DQ", schedule)
    settings.reload()
    B, Hq, L, S = 2, 6, 1000, 1100
    tiles, _ = tile_by_tile_masks(B, Hq, L, S, 128, device="cuda", relative=True,
                                  intervals=True)
    assert (tiles.kernel_summary()[..., 0, 2] == KEY_INTERVALS).all()
    check_every_output(torch.bfloat16, B, Hq, 3, L, S, 64, 64, False, tiles)


@pytest.mark.parametrize("schedule", ["two_pass", "atomic"])
def test_hf_causal_folded_masks_against_float64(monkeypatch, schedule):
    """Hugging Face's 4-D mask (key padding and the causal mask in one tensor, is_causal
    False), which the kernels apply from indices (triton_masks.mask_summary); left padding
    (rows that see no key) runs in test_triton_interpret.py."""
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_SCHEDULE", schedule)
    monkeypatch.setenv("BOB_COMPILE_DEV_BWD_DQ", schedule)
    settings.reload()
    B, Hq, L = 3, 4, 1024
    padded = padding_mask("bool", B, 1, 1, L, torch.bfloat16)
    causal = torch.ones(L, L, dtype=torch.bool, device="cuda").tril()
    check_every_output(torch.bfloat16, B, Hq, Hq, L, L, 64, 64, False,
                       (padded & causal).expand(B, Hq, L, L))


@pytest.mark.parametrize("schedule", ["two_pass", "atomic"])
@pytest.mark.parametrize("dtype,B,Hq,Hkv,L,S,E,Ev,causal,masked,softcap", [
    pytest.param(torch.bfloat16, 1, 4, 4, 2048, 2048, 64, 64, True, False, 2.0,
                 id="bf16-causal-d64-cap2"),
    pytest.param(torch.bfloat16, 2, 4, 2, 777, 1000, 128, 128, False, True, 2.0,
                 id="bf16-gqa-L<S-d128-masked-cap2"),
    pytest.param(torch.float16, 1, 3, 3, 777, 777, 64, 64, True, False, 50.0,
                 id="fp16-777-causal-cap50"),
])
def test_softcap_against_float64(monkeypatch, schedule, dtype, B, Hq, Hkv, L, S, E, Ev, causal,
                                 masked, softcap):
    """Soft-capped scores (Gemma 2) in every kernel: each output within the same factor of
    math's own error in the same dtype as without a cap (a cap of 2 bends these scores)."""
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_SCHEDULE", schedule)
    monkeypatch.setenv("BOB_COMPILE_DEV_BWD_DQ", schedule)
    settings.reload()
    mask = padding_mask("bool", B, Hq, L, S, dtype) if masked else None
    check_every_output(dtype, B, Hq, Hkv, L, S, E, Ev, causal, mask=mask, softcap=softcap)


def check_every_output(dtype, B, Hq, Hkv, L, S, E, Ev, causal, mask=None, dropout_p=0.0,
                       softcap=0.0):
    dev = "cuda"
    scale = 1.0 / math.sqrt(E)
    q = torch.randn(B, Hq, L, E, device=dev, dtype=dtype)
    k = torch.randn(B, Hkv, S, E, device=dev, dtype=dtype)
    v = torch.randn(B, Hkv, S, Ev, device=dev, dtype=dtype)
    assert triton_attention.supports(q, k, v)
    report = []

    # first order: forward
    seed = torch.tensor(2 ** 40 + 7, device=dev) if dropout_p else None
    params = AttentionParams(scale=scale, causal=causal, mask=mask, dropout_p=dropout_p,
                             dropout_seed=seed, softcap=softcap)
    o, lse = triton_attention.forward(q, k, v, params)
    ro, rlse = reference.forward(*f64(q, k, v), params)
    mo, mlse = reference.forward(q, k, v, params, upcast=False)   # precision baseline
    assert o.dtype == dtype and o.is_contiguous() and lse.dtype == torch.float32
    check_against("o", o, mo, ro, report)
    check_against("lse", lse, mlse, rlse, report)

    # backward with and without dlse, on our (o, lse)
    do = torch.randn_like(o)
    for dlse in (None, torch.randn_like(lse)):
        tag = "" if dlse is None else "+dlse"
        ours = triton_attention.backward(q, k, v, o, lse, do, dlse, params)
        exact = reference.backward(*f64(q, k, v, o, lse, do, dlse), params)
        lowp = reference.backward(q, k, v, o, lse, do, dlse, params, upcast=False)
        for name, a, m, e in zip(("dq", "dk", "dv"), ours, lowp, exact):
            assert a.dtype == dtype and a.is_contiguous()
            check_against(name + tag, a, m, e, report)

    # backward-over-backward, all seven outputs
    dlse = torch.randn_like(lse)
    cot = (torch.randn_like(q), torch.randn_like(k), torch.randn_like(v))
    ours = triton_attention.bob(q, k, v, o, lse, do, dlse, *cot, params)
    exact = reference.bob(*f64(q, k, v, o, lse, do, dlse, *cot), params)
    lowp = reference.bob(q, k, v, o, lse, do, dlse, *cot, params, upcast=False)
    for name, a, m, e in zip(reference.BOB_OUTPUTS, ours, lowp, exact):
        check_against(name, a, m, e, report)
    exact = reference.bob_folded(*f64(q, k, v, o, lse, do, dlse, *cot, None), params)
    lowp = reference.bob_folded(q, k, v, o, lse, do, dlse, *cot, None, params, upcast=False)
    # R recomputed in the row pass, and read from the first backward's dq (what autograd runs)
    first_dq = triton_attention.backward(q, k, v, o, lse, do, dlse, params)[0]
    for dq, tag in ((None, ""), (first_dq, ".dq")):
        ours = triton_attention.bob_folded(q, k, v, o, lse, do, dlse, *cot, dq, params)
        for name, a, m, e in zip(reference.BOB_FOLDED_OUTPUTS, ours, lowp, exact):
            assert a.dtype == m.dtype and a.is_contiguous()
            check_against("folded." + name + tag, a, m, e, report)

    # the full second-order step (what a user's double backward computes; SDPA's own
    # dropout would draw another mask, and SDPA has no cap)
    if Hq == Hkv and E == Ev and not dropout_p and not softcap:
        ours = chain_step(q, k, v, do, *cot, scale, causal, triton_attention, mask)
        exact = chain_step(*f64(q, k, v, do, *cot), scale, causal, reference, mask)
        sdpa_mask, sdpa_causal = mask, causal
        if mask is not None and causal:     # SDPA takes one of them: the causal mask folded in
            above = ~torch.ones(L, S, dtype=torch.bool, device=dev).tril()
            sdpa_mask = mask & ~above if mask.dtype == torch.bool else \
                mask.masked_fill(above, float("-inf"))
            sdpa_causal = False
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            lowp = second_order_step(
                lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
                    a, b, c, attn_mask=sdpa_mask, is_causal=sdpa_causal, scale=scale),
                q, k, v, do, *cot)
        for name, a, m, e in zip(("step.gq", "step.gk", "step.gv", "step.gdo"), ours, lowp, exact):
            check_against(name, a, m, e, report)
        ours = folded_step(q, k, v, do, *cot, scale, causal, triton_attention, mask)
        for name, a, m, e in zip(("folded_step.gq", "folded_step.gk", "folded_step.gv",
                                  "folded_step.gdo"), ours, lowp, exact):
            check_against(name, a, m, e, report)
    print("\n".join(report))


@pytest.mark.parametrize("dtype,B,Hq,Hkv,L,S,E,Ev,causal", [
    pytest.param(torch.bfloat16, 1, 4, 4, 4096, 4096, 64, 64, True, id="bf16-4096-causal-d64"),
    pytest.param(torch.bfloat16, 1, 4, 4, 2048, 2048, 64, 64, False, id="bf16-2048-d64"),
    pytest.param(torch.bfloat16, 2, 4, 2, 1531, 1000, 128, 128, True, id="bf16-gqa-causal-L>S-d128"),
    # GQA with PyTorch's cuDNN first order (fewer key/value heads taken directly)
    pytest.param(torch.bfloat16, 2, 8, 2, 1000, 1000, 64, 64, True, id="bf16-gqa-causal-d64"),
    pytest.param(torch.float16, 1, 2, 2, 777, 1000, 64, 32, False, id="fp16-odd-E!=Ev"),
    # padded head dims on the 65-128 tiles
    pytest.param(torch.float16, 1, 2, 2, 1000, 777, 96, 80, True, id="fp16-causal-L>S-d96-Ev80"),
    pytest.param(torch.float32, 1, 4, 2, 257, 700, 128, 128, True, id="fp32-gqa-causal-L<S"),
])
def test_forward_mode_against_float64(dtype, B, Hq, Hkv, L, S, E, Ev, causal):
    """attn_fwd_jvp and attn_bwd_jvp (triton_forward_mode.py), every tangent given; the
    baseline is torch.func.jvp through the closed form in the input dtype."""
    dev = "cuda"
    scale = 1.0 / math.sqrt(E)
    q = torch.randn(B, Hq, L, E, device=dev, dtype=dtype)
    k = torch.randn(B, Hkv, S, E, device=dev, dtype=dtype)
    v = torch.randn(B, Hkv, S, Ev, device=dev, dtype=dtype)
    f64 = lambda *ts: [t.double() for t in ts]  # noqa: E731
    params = AttentionParams(scale=scale, causal=causal)
    o, lse = triton_attention.forward(q, k, v, params)
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    tangents = [torch.randn_like(t) for t in (q, k, v, o, lse, do, lse)]
    failed = set(triton_attention._forward_mode_failed)
    report = []

    ours = triton_attention.forward_jvp(q, k, v, o, lse, *tangents[:3], params)
    exact = reference.forward_jvp(*f64(q, k, v, o, lse, *tangents[:3]), params)
    _, lowp = torch.func.jvp(lambda a, b, c: reference.forward(a, b, c, params, upcast=False),
                             (q, k, v), tuple(tangents[:3]))
    for name, a, m, e in zip(("to", "tlse"), ours, lowp, exact):
        check_against(name, a, m, e, report)

    ours = triton_attention.backward_jvp(q, k, v, o, lse, do, dlse, *tangents, params)
    exact = reference.backward_jvp(*f64(q, k, v, o, lse, do, dlse, *tangents), params)
    _, lowp = torch.func.jvp(
        lambda *a: reference.backward(*a, params, upcast=False),
        (q, k, v, o, lse, do, dlse), tuple(tangents))
    for name, a, m, e in zip(("tdq", "tdk", "tdv"), ours, lowp, exact):
        assert a.dtype == dtype
        check_against(name, a, m, e, report)
    assert triton_attention._forward_mode_failed == failed, "fell back to the blockwise path"
    print("\n".join(report))


@pytest.mark.parametrize("form", ["folded", "chain"])
def test_split_edges_lower_the_second_order_error(monkeypatch, form):
    """BOB_COMPILE_DEV_EDGE_SPLIT (default on): the row pass's masked tiles multiply Sbar, dS,
    P and A in two bf16 parts. On a causal call that is the diagonal, where the first rows
    (few keys, large probabilities) carry much of gq's and gdo's rounding error: a float64
    simulation (benchmarks/precision_folded_gq.py) gives 0.89x for gq, 0.84x for gdo."""
    torch.manual_seed(0)
    B, H, N, E = 1, 4, 2048, 64
    q, k, v, do, gq, gk, gv = (torch.randn(B, H, N, E, device="cuda", dtype=torch.bfloat16)
                               for _ in range(7))
    scale = E ** -0.5
    exact_step = chain_step(*f64(q, k, v, do, gq, gk, gv), scale, True, reference)
    step = folded_step if form == "folded" else chain_step
    errors = {}
    for split in ("0", "1"):
        monkeypatch.setenv("BOB_COMPILE_DEV_EDGE_SPLIT", split)
        settings.reload()
        ours = step(q, k, v, do, gq, gk, gv, scale, True, triton_attention)
        errors[split] = [rel_err(a, e) for a, e in zip(ours, exact_step)]
    (gq0, gk0, gv0, gdo0), (gq1, gk1, gv1, gdo1) = errors["0"], errors["1"]
    # the chain form's gq also carries the second backward's dq, which the split leaves alone
    assert gq1 < (0.95 if form == "folded" else 0.98) * gq0 and gdo1 < 0.92 * gdo0, errors
    assert max(gk1, gv1) <= 1.02 * max(gk0, gv0), errors


def test_deterministic_two_pass(monkeypatch):
    """The default schedules give bit-identical results run to run (no atomics)."""
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_SCHEDULE", "two_pass")
    monkeypatch.setenv("BOB_COMPILE_DEV_BWD_DQ", "two_pass")
    monkeypatch.setenv("BOB_COMPILE_NATIVE_BACKEND", "none")
    settings.reload()
    q = torch.randn(1, 4, 1100, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 1100, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2, 1100, 64, device="cuda", dtype=torch.bfloat16)
    params = AttentionParams(scale=0.125, causal=True)
    o, lse = triton_attention.forward(q, k, v, params)
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    cot = (torch.randn_like(q), torch.randn_like(k), torch.randn_like(v))
    first = triton_attention.bob(q, k, v, o, lse, do, dlse, *cot, params)
    first_bwd = triton_attention.backward(q, k, v, o, lse, do, dlse, params)
    first_folded = triton_attention.bob_folded(q, k, v, o, lse, do, dlse, *cot, None, params)
    for _ in range(3):
        again = triton_attention.bob(q, k, v, o, lse, do, dlse, *cot, params)
        again_bwd = triton_attention.backward(q, k, v, o, lse, do, dlse, params)
        again_folded = triton_attention.bob_folded(q, k, v, o, lse, do, dlse, *cot, None,
                                                   params)
        for a, b in zip(first + first_bwd + first_folded, again + again_bwd + again_folded):
            assert torch.equal(a, b)


def test_grouped_query_first_order_runs_pytorchs_cudnn_kernels():
    """GQA's first order goes to cuDNN, which takes fewer key/value heads itself (the
    accuracy of that path is checked by the bf16-gqa-causal-d64 case above)."""
    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(2, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    params = AttentionParams(scale=0.125, causal=True)
    assert native_sdpa.backend_for(q, kv, kv, params) == "cudnn"
    path = triton_attention.call_path(q, kv, kv, 0.125, True)
    assert path is not None and path.native == "cudnn"
    dq, dk, dv = path.backward(q, kv, kv, *path.forward(q, kv, kv), torch.randn_like(q), None)
    assert dk.shape == kv.shape and dv.shape == kv.shape and dq.shape == q.shape
    assert not native_sdpa.failed


@pytest.mark.parametrize("cpp_node", ["wait", "off"])
@pytest.mark.parametrize("causal", [True, False])
def test_deterministic_algorithms_run_our_backward(monkeypatch, reread_settings, causal,
                                                   cpp_node):
    """Under torch.use_deterministic_algorithms(True) a first-order step through the op runs
    our backward, not cuDNN's (whose dq accumulates by atomics; native SDPA then avoids
    cuDNN too): bit-identical run to run, and as exact as the rule above. Through the op's
    C++ node (bob_compile/eager/node.py) and its Python node; the C++ node calls cuDNN's
    backward from C++, which the spy below does not see."""
    import bob_compile
    monkeypatch.setenv("BOB_COMPILE_CPP_NODE", cpp_node)
    settings.reload()
    ran = []
    real = native_sdpa._cudnn_backward
    monkeypatch.setattr(native_sdpa, "_cudnn_backward",
                        lambda *a, **kw: ran.append(1) or real(*a, **kw))
    q, k, v, do = (torch.randn(2, 3, 1000, 64, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))

    def first_order(attn, dtype=torch.bfloat16):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(attn(*leaves), leaves, do.to(dtype))

    def ours(a, b, c):
        return bob_compile.attention(a, b, c, is_causal=causal)
    first_order(ours)
    assert ran == ([] if cpp_node == "wait" else [1])   # cuDNN's backward by default
    ran.clear()
    with deterministic_algorithms():
        first, again = first_order(ours), first_order(ours)
    assert ran == [] and all(torch.equal(a, b) for a, b in zip(first, again))
    exact = first_order(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
        a, b, c, is_causal=causal), torch.float64)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        lowp = first_order(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
            a, b, c, is_causal=causal))
    report = []
    for name, a, m, e in zip(("dq", "dk", "dv"), first, lowp, exact):
        check_against(name, a, m, e, report)
    print("\n".join(report))


class deterministic_algorithms:
    def __enter__(self):
        self.before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.before)


@pytest.mark.parametrize("causal", [False, True])
def test_empty_key_rows_are_zero(causal):
    q = torch.randn(1, 2, 33, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 0, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2, 0, 64, device="cuda", dtype=torch.bfloat16)
    params = AttentionParams(scale=0.125, causal=causal)
    o, lse = triton_attention.forward(q, k, v, params)
    assert (o == 0).all() and torch.isneginf(lse).all()
    do = torch.randn_like(o)
    dq, dk, dv = triton_attention.backward(q, k, v, o, lse, do, torch.randn_like(lse), params)
    assert (dq == 0).all() and dk.numel() == 0 and dv.numel() == 0
    outs = triton_attention.bob(q, k, v, o, lse, do, None, torch.randn_like(q), None, None,
                                params)
    assert all(torch.isfinite(t).all() and (t == 0).all() for t in outs)


def test_first_call_tuning_is_cached(tmp_path, monkeypatch):
    """Tuning writes its decisions to the JSON cache, and a new length in the same bucket
    reuses them without timing again."""
    from bob_compile.kernels import tuning

    monkeypatch.setenv("BOB_COMPILE_TUNE", "1")
    settings.reload()
    monkeypatch.setattr(tuning, "TUNING_CACHE", tuning.TuningCache())
    tuning.TUNING_CACHE.path = str(tmp_path / "configs.json")
    monkeypatch.setenv("BOB_COMPILE_NATIVE_BACKEND", "none")
    settings.reload()
    for n in (3000, 3500):  # one bucket
        q = torch.randn(1, 2, n, 64, device="cuda", dtype=torch.bfloat16)
        triton_attention.forward(q, q, q, AttentionParams(scale=0.125, causal=True))
        assert os.path.exists(tuning.TUNING_CACHE.path)
        entries = dict(tuning.TUNING_CACHE.entries)
        assert len(entries) == 1


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("bias_shape,causal,dropout_p", [
    pytest.param((1, 4, 777, 1000), False, 0.0, id="per-head"),
    pytest.param((1, 1, 1024, 1024), True, 0.1, id="shared-causal-dropout"),
])
def test_learned_bias_against_float64(dtype, bound, bias_shape, causal, dropout_p):
    """A learned bias's cotangents (dS added into the bias's shape by the backward's column
    pass; gdM in F and Sbar by the folded BoB) and every other output, against float64:
    relative L2 within `bound` (bf16: ~10x its usual error, a bias shared by the heads sums
    their atomics)."""
    dev = "cuda"
    B, Hq, Hkv, L, S = 2, 4, 2, bias_shape[2], bias_shape[3]
    q = torch.randn(B, Hq, L, 64, device=dev, dtype=dtype)
    k, v = (torch.randn(B, Hkv, S, 64, device=dev, dtype=dtype) for _ in range(2))
    bias = torch.randn(bias_shape, device=dev, dtype=dtype)
    seed = torch.tensor(12345, device=dev) if dropout_p else None
    params = AttentionParams(scale=0.125, causal=causal, mask=bias.expand(B, Hq, L, S),
                             dropout_p=dropout_p, dropout_seed=seed)
    params64 = AttentionParams(scale=0.125, causal=causal,
                               mask=bias.double().expand(B, Hq, L, S), dropout_p=dropout_p,
                               dropout_seed=seed)
    o, lse = triton_attention.forward(q, k, v, params)
    do = torch.randn_like(o)
    cot = [torch.randn_like(t) for t in (q, k, v)] + [torch.randn(bias_shape, device=dev,
                                                                    dtype=dtype)]
    first = triton_attention.backward_bias(q, k, v, o, lse, do, None, params)
    exact = reference.backward_bias(*f64(q, k, v, o, lse, do), None, params64)
    second = triton_attention.bob_folded_bias(q, k, v, o, lse, do, None, *cot, None, params)
    exact2 = reference.bob_folded_bias(*f64(q, k, v, o, lse, do), None, *f64(*cot), None,
                                       params64)
    names = ("dq", "dk", "dv", "dbias", *reference.BOB_FOLDED_OUTPUTS, "gbias")
    for name, a, e in zip(names, (*first, *second), (*exact, *exact2), strict=True):
        assert a.shape == e.shape, name
        assert rel_err(a, e) < bound, (name, rel_err(a, e))
