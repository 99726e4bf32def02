"""bob_compile/kernels/layout.py: the memory order of the ops' outputs (PyTorch's SDPA rule)."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bob_compile.kernels import layout


@st.composite
def permuted_views(draw):
    """A 4-D tensor stored in a random dimension order, sometimes a slice of a wider one
    (q, k, v as views of one projection)."""
    shape = draw(st.lists(st.integers(1, 4), min_size=4, max_size=4))
    order = draw(st.permutations(range(4)))
    widen = draw(st.integers(1, 3))
    stored = [shape[d] for d in order]
    stored[-1] *= widen
    base = torch.randn(*stored)[..., :shape[order[-1]]]
    back = sorted(range(4), key=order.__getitem__)
    return base.permute(back)


@settings(max_examples=60, deadline=None)
@given(permuted_views(), st.integers(1, 5))
def test_in_order_of_is_dense_in_likes_order_and_keeps_values(like, last):
    t = torch.randn(*like.shape[:-1], last)
    out = layout.in_order_of(t, like)
    assert torch.equal(out, t)
    assert out.untyped_storage().nbytes() == out.numel() * out.element_size()
    empty = layout.empty_like_order(t.shape, like)
    assert all(n == 1 or a == b for n, a, b in zip(t.shape, out.stride(), empty.stride()))
    big = [d for d in range(4) if like.shape[d] > 1 and out.shape[d] > 1]
    for a in big:            # every pair of real dimensions in like's relative order
        for b in big:
            if like.stride(a) > like.stride(b):
                assert out.stride(a) > out.stride(b)
    assert layout.in_order_of(out, like) is out          # already laid out: no copy


def test_o_of_a_transposed_query_is_transposed_back_for_free():
    """q a transposed (B, L, H, E) view (as attention modules make it): o and dq are laid
    out (B, L, H, E) too, so y.transpose(1, 2).reshape(B, L, H*E) is a view."""
    q = torch.randn(2, 7, 3, 4).transpose(1, 2)
    assert layout.empty_like_order((2, 3, 7, 5), q).transpose(1, 2).is_contiguous()
    assert layout.in_order_of(torch.randn(2, 3, 7, 4), q).transpose(1, 2).is_contiguous()
