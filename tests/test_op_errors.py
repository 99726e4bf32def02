"""Bad input gets the same kind of clear error SDPA gives, in bob_compile's name."""
import pytest
import torch

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
