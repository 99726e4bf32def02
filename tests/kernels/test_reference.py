"""bob_compile/kernels/reference.py's precision baseline (upcast=False) against its float64 math.

In float64 there is nothing to round, so upcast=False must give the closed forms' values;
in half precision it must carry a plain implementation's rounding error, which the GPU
tests (tests/gpu/test_gpu_kernels.py) use as the yardstick of the fused kernels."""
import pytest
import torch

from bob_compile.kernels import reference
from bob_compile.kernels.params import AttentionParams

SHAPES = [  # B, Hq, Hkv, L, S, E, Ev, causal
    (1, 2, 2, 7, 7, 8, 8, True),
    (2, 4, 2, 5, 9, 8, 4, False),
    (1, 2, 1, 9, 6, 4, 8, True),
]


def inputs(B, Hq, Hkv, L, S, E, Ev, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    return (randn(B, Hq, L, E), randn(B, Hkv, S, E), randn(B, Hkv, S, Ev),
            randn(B, Hq, L, Ev), randn(B, Hq, L))


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_dlse", [False, True])
def test_in_float64_the_baseline_is_the_closed_form(shape, with_dlse):
    *dims, causal = shape
    q, k, v, do, dlse = inputs(*dims, torch.float64)
    dlse = dlse if with_dlse else None
    scale = 0.37
    params = AttentionParams(scale=scale, causal=causal)
    o, lse = reference.forward(q, k, v, params)
    assert max_diff(reference.forward(q, k, v, params, upcast=False), (o, lse)) < 1e-12
    exact = reference.backward(q, k, v, o, lse, do, dlse, params)
    plain = reference.backward(q, k, v, o, lse, do, dlse, params, upcast=False)
    assert max_diff(plain, exact) < 1e-12
    cot = (torch.randn_like(q), None, torch.randn_like(v))
    exact = reference.bob(q, k, v, o, lse, do, dlse, *cot, params)
    plain = reference.bob(q, k, v, o, lse, do, dlse, *cot, params, upcast=False)
    assert max_diff(plain, exact) < 1e-11


def rel(a, e):
    return ((a.double() - e).norm() / e.norm()).item()


def test_in_half_precision_the_baseline_rounds_like_its_dtype():
    q, k, v, do, _ = inputs(1, 2, 2, 64, 64, 16, 16, torch.float64)
    scale = 0.25
    params = AttentionParams(scale=scale, causal=True)
    o, lse = reference.forward(q, k, v, params)
    dq = reference.backward(q, k, v, o, lse, do, None, params)[0]
    h = [t.to(torch.float16) for t in (q, k, v, do)]
    for upcast, low, high in ((True, 0, 2e-3), (False, 1e-4, 2e-2)):
        ho, hlse = reference.forward(*h[:3], params, upcast=upcast)
        hdq = reference.backward(*h[:3], ho, hlse, h[3], None, params, upcast=upcast)[0]
        assert ho.dtype == hdq.dtype == torch.float16
        assert low <= rel(ho, o) <= high and low <= rel(hdq, dq) <= high, (upcast, rel(ho, o))


def test_attention_params_refuse_swapped_or_positional_values():
    assert AttentionParams(scale=0.5, causal=True) == AttentionParams(scale=0.5, causal=True)
    with pytest.raises(TypeError):
        AttentionParams(0.5, True)                                   # keyword-only
    with pytest.raises(TypeError, match="causal must be a bool, got 0.5"):
        AttentionParams(scale=True, causal=0.5)                      # swapped
    with pytest.raises(TypeError, match="scale must be a number, got False"):
        AttentionParams(scale=False, causal=False)
