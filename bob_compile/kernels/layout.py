"""Memory layout of the attention ops' outputs.

Every output is dense, with its dimensions in the memory order of the input it is shaped
like: o and the query's cotangents like q, the key's like k, and so on; row vectors (lse
and its cotangents) are contiguous. That is the rule of PyTorch's own fused SDPA kernels
(`alloc_with_matching_layout` in ATen): a stable argsort of the input's strides, 0-strided
(broadcast) dimensions outermost. Why it matters: attention's q, k, v are usually permuted
views of one projection, (B, L, H, E) in memory, and the code after attention transposes o
back to (B, L, H·E). With o in q's order, that transpose is free and the incoming gradient
already has o's layout; with contiguous outputs every call paid a copy of o, dq, dk and dv
and inductor one more to undo it (measured on an H200, GPT-2 small, B=8, T=1024: 72 more
kernels per training step than stock compile, 2.2 ms of GPU time; docs/routing.md).

The fake (meta) implementations and the real ones use the same functions below, so the
strides a compiled graph was traced with are the strides it gets.
"""
import torch


def fill_order(strides):
    """Dimensions from innermost to outermost for a tensor with these strides."""
    return sorted(range(len(strides)), key=lambda d: (strides[d] == 0, strides[d]))


def dense_strides(shape, like_strides):
    """Strides of a dense tensor of `shape` laid out in the dimension order of like_strides."""
    strides = [0] * len(shape)
    step = 1
    for d in fill_order(like_strides):
        strides[d] = step
        step = step * shape[d]
    return tuple(strides)


def empty_like_order(shape, like, dtype=None):
    """An empty tensor of `shape` on like's device, in like's dimension order."""
    return torch.empty_strided(shape, dense_strides(shape, like.stride()),
                               dtype=dtype or like.dtype, device=like.device)


def _same_layout(shape, strides, wanted):
    # a size-1 dimension's stride is never used to address memory (and inductor's
    # assert_size_stride ignores it too)
    return all(n == 1 or s == w for n, s, w in zip(shape, strides, wanted))


# (shape, strides, like's strides) -> whether those strides already are the wanted layout.
# in_order_of runs on every output of every op call; the answer only depends on this key.
_already_laid_out = {}
_CACHE_LIMIT = 4096


def _is_laid_out(shape, strides, like_strides):
    key = (shape, strides, like_strides)
    try:
        return _already_laid_out[key]
    except KeyError:
        pass
    except TypeError:       # symbolic sizes are not hashable: no caching
        return _same_layout(shape, strides, dense_strides(shape, like_strides))
    if len(_already_laid_out) >= _CACHE_LIMIT:
        _already_laid_out.clear()
    answer = _already_laid_out[key] = _same_layout(shape, strides, dense_strides(shape, like_strides))
    return answer


def in_order_of(t, like):
    """t itself when it has the layout `empty_like_order(t.shape, like)` gives, else a copy
    with that layout."""
    like_strides = like.stride()
    if _is_laid_out(t.shape, t.stride(), like_strides):
        return t
    # out of place (permute, copy, permute back), so that it also runs under torch.func
    # transforms and autograd, where the closed-form twins call it
    outer_to_inner = fill_order(like_strides)[::-1]
    back = sorted(range(len(outer_to_inner)), key=outer_to_inner.__getitem__)
    return t.permute(outer_to_inner).contiguous().permute(back)
