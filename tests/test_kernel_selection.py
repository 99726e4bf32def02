"""Which implementation runs: blockwise on CPU, a forced choice through BOB_COMPILE_KERNELS,
and a clear error for an unknown one."""
import pytest
import torch

from bob_compile import attention
from bob_compile import kernels
from bob_compile.kernels import blockwise, reference, settings


_reference_forward = reference.forward


def qkv():
    return (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(3))


def test_cpu_tensors_take_the_blockwise_path(monkeypatch):
    monkeypatch.delenv("BOB_COMPILE_KERNELS", raising=False)
    settings.reload()
    assert kernels.select(*qkv()) is blockwise


def test_forced_reference_is_used_by_the_op(monkeypatch):
    calls = []
    monkeypatch.setenv("BOB_COMPILE_KERNELS", "reference")
    settings.reload()
    monkeypatch.setattr(reference, "forward", lambda *a: calls.append(1) or _reference_forward(*a))
    q, k, v = qkv()
    attention(q, k, v, is_causal=True)
    assert calls == [1]


def test_unknown_forced_choice_lists_the_valid_ones(monkeypatch):
    monkeypatch.setenv("BOB_COMPILE_KERNELS", "fast")
    settings.reload()
    with pytest.raises(ValueError, match=r"blockwise.*reference.*triton"):
        kernels.select(*qkv())
