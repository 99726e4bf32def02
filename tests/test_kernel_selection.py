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


# ---------------------------------------------------------------------------- PyTorch's fused kernels
def test_a_refused_native_configuration_falls_back_for_that_configuration_only(monkeypatch):
    """A configuration cuDNN/flash refuses runs Triton from then on; other configurations
    keep the native kernel; out-of-memory propagates and switches nothing off."""
    triton_attention = pytest.importorskip("bob_compile.kernels.triton_attention")
    monkeypatch.setattr(triton_attention, "_native_failed", set())
    q64, v64 = torch.empty(1, 1, 4, 64), torch.empty(1, 1, 4, 64)
    q128 = torch.empty(1, 1, 4, 128)

    def refuses(backend, q, k, v, scale, causal):
        raise RuntimeError("cuDNN Frontend error: No valid execution plans built.")

    def out_of_memory(backend, q, k, v, scale, causal):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        triton_attention._try_native("cudnn", out_of_memory, q64, q64, v64, 0.1, True)
    assert triton_attention._native_failed == set()
    assert triton_attention._try_native("cudnn", refuses, q64, q64, v64, 0.1, True) is None
    failed = triton_attention._native_failed
    assert triton_attention._native_key("cudnn", q64, v64, True) in failed
    assert triton_attention._native_key("cudnn", q64, v64, False) not in failed
    assert triton_attention._native_key("cudnn", q128, q128, True) not in failed
