"""Bad input gets the same kind of clear error SDPA gives, in bob_compile's name."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bob_compile import attention


def qkv(q=(2, 3, 5, 8), k=(2, 3, 6, 8), v=(2, 3, 6, 4), dtype=torch.float32):
    return torch.randn(q, dtype=dtype), torch.randn(k, dtype=dtype), torch.randn(v, dtype=dtype)


def test_mismatched_dtype():
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="same dtype"):
        attention(q, k.double(), v)


def test_integer_dtype():
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="floating dtype"):
        attention(q.long(), k.long(), v.long())


def test_mismatched_device():
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="same device"):
        attention(q, k.to("meta"), v)


def test_mismatched_head_dim():
    q, k, v = qkv(k=(2, 3, 6, 7))
    with pytest.raises(RuntimeError, match="same embedding"):
        attention(q, k, v)


def test_key_value_length_mismatch():
    q, k, v = qkv(v=(2, 3, 7, 4))
    with pytest.raises(RuntimeError, match="same sequence length"):
        attention(q, k, v)


def test_rank_below_two():
    with pytest.raises(RuntimeError, match="at least 2 dimensional"):
        attention(torch.randn(8), torch.randn(8), torch.randn(8))


def test_gqa_heads_that_do_not_divide():
    q, k, v = qkv(q=(2, 4, 5, 8), k=(2, 3, 6, 8), v=(2, 3, 6, 4))
    with pytest.raises(RuntimeError, match="must divide"):
        attention(q, k, v, enable_gqa=True)


def test_gqa_key_value_heads_differ():
    q, k, v = qkv(q=(2, 4, 5, 8), k=(2, 2, 6, 8), v=(2, 1, 6, 4))
    with pytest.raises(RuntimeError, match="must divide"):
        attention(q, k, v, enable_gqa=True)


def test_head_mismatch_without_gqa_names_the_flag():
    q, k, v = qkv(q=(2, 4, 5, 8), k=(2, 2, 6, 8), v=(2, 2, 6, 4))
    with pytest.raises(RuntimeError, match="enable_gqa=True"):
        attention(q, k, v)


def test_non_bool_is_causal():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        attention(q, k, v, is_causal=torch.tensor(True))


def test_leading_dims_broadcast_like_sdpa():
    """Not an error: SDPA's math path broadcasts batch dims, and so do we."""
    q, k, v = qkv(q=(2, 3, 5, 8), k=(3, 6, 8), v=(3, 6, 4))
    ours = attention(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(ours, ref)


NOT_FLOATS = {"str": "0.5", "list": [0.5], "complex": 0.5j, "1-d tensor": torch.tensor([0.5])}


@pytest.mark.parametrize("scale", list(NOT_FLOATS.values()), ids=list(NOT_FLOATS))
def test_scale_that_is_not_a_float(scale):
    q, k, v = qkv()
    with pytest.raises(TypeError):      # what SDPA raises
        F.scaled_dot_product_attention(q, k, v, scale=scale)
    with pytest.raises(TypeError, match="bob_compile.attention: scale must be a float"):
        attention(q, k, v, scale=scale)


def test_scale_tensor_that_requires_grad_is_refused_not_detached():
    """SDPA refuses it; detaching it silently would drop its gradient."""
    q, k, v = qkv()
    scale = torch.tensor(0.5, requires_grad=True)
    with pytest.raises(TypeError):
        F.scaled_dot_product_attention(q, k, v, scale=scale)
    with pytest.raises(TypeError, match="requires grad.*multiply query by the tensor"):
        attention(q, k, v, scale=scale)


SDPA_SCALES = {"float": 0.5, "int": 2, "bool": True, "numpy float32": np.float32(0.5),
               "numpy float64": np.float64(0.5), "numpy int64": np.int64(2),
               "0-d tensor": torch.tensor(0.5), "0-d int tensor": torch.tensor(2), "None": None}


@pytest.mark.parametrize("scale", list(SDPA_SCALES.values()), ids=list(SDPA_SCALES))
def test_scales_that_sdpa_accepts(scale):
    q, k, v = qkv(dtype=torch.float64)
    torch.testing.assert_close(attention(q, k, v, scale=scale),
                               F.scaled_dot_product_attention(q, k, v, scale=scale))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_symbolic_scale_under_dynamic_shapes(backend, fresh_dynamo):
    """Under dynamic shapes a scale computed from a size is a SymFloat or SymInt."""
    def f(q, k, v, sdpa):
        return sdpa(q, k, v, scale=q.shape[-2] ** -0.5) + sdpa(q, k, v, scale=q.shape[-2])
    compiled = torch.compile(f, backend=backend, dynamic=True, fullgraph=True)
    for length in (5, 7):
        q, k, v = qkv(q=(1, 2, length, 8), k=(1, 2, 6, 8), v=(1, 2, 6, 4), dtype=torch.float64)
        torch.testing.assert_close(compiled(q, k, v, attention),
                                   f(q, k, v, F.scaled_dot_product_attention))


def test_folded_bob_with_a_dq_not_shaped_like_q():
    """attn_bob_folded's optional dq is attn_bwd's for the same inputs: another shape is an
    error that says so (it would otherwise be read with q's rows)."""
    op = torch.ops.bob_compile
    q, k, v = qkv(q=(2, 3, 5, 8), k=(2, 3, 6, 8), v=(2, 3, 6, 8))
    o, lse = op.attn_fwd(q, k, v, None, 0.5, False)
    do = torch.randn_like(o)
    dq = op.attn_bwd(q, k, v, o, lse, do, None, None, 0.5, False)[0]
    with pytest.raises(ValueError, match="dq must be shaped like q"):
        op.attn_bob_folded(q, k, v, o, lse, do, None, q, k, v, dq[:, :1], None, 0.5, False)


@pytest.mark.parametrize("softcap,error", [(-1.0, ValueError), (float("inf"), ValueError),
                                           (torch.tensor(2.0), TypeError), ("2", TypeError)])
def test_softcap_must_be_a_positive_finite_number(softcap, error):
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(error, match="softcap"):
        attention(q, q, q, softcap=softcap)
