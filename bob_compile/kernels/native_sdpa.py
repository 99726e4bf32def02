"""PyTorch's fused first-order kernels (cuDNN, FA2), called directly where they compute
exactly this op: half-precision CUDA inputs without a mask, head dims they take.

`backend_for` says which applies to a call (BOB_COMPILE_NATIVE_BACKEND chooses among them);
a configuration a kernel refuses once runs the Triton kernels from then on (`attempt`,
`refused`), and listeners (`on_refused`) forget what they decided from it.
"""
import logging

import torch

from . import layout, settings

log = logging.getLogger("bob_compile.kernels")

# (backend, dtype, head dims, causal) configurations PyTorch's fused kernel refused once
failed = set()


def key(backend, q, v, causal):
    return backend, q.dtype, q.shape[3], v.shape[3], causal


def backend_for(q, k, v, params):
    """'cudnn' or 'flash' when PyTorch's fused kernel computes exactly this op, else None
    (never with a mask tensor: our kernels read it as AttentionParams defines it; never with
    dropout: theirs draws another mask; never with soft-capping: theirs has none)."""
    s = settings.current()
    if not q.is_cuda or params.mask is not None or params.dropout_p or params.softcap:
        return None
    causal = params.causal
    if q.dtype not in (torch.float16, torch.bfloat16):
        return None
    qs = q.shape
    E, Ev = qs[3], v.shape[3]
    # grouped-query attention included: PyTorch's cuDNN kernels take fewer key/value heads
    # (exact; 1.6-1.9x faster than the Triton kernels on the H200: docs/measurements.md)
    if E != Ev or E % 8 or E > 256 or qs[1] % k.shape[1]:
        return None
    if causal and qs[2] != k.shape[2]:
        return None  # fused kernels align a rectangular causal mask bottom-right
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return None
    # cuDNN is what ran (and matched native SDPA's speed) on the H200 for head dims <= 128;
    # above that the Triton kernels run unless BOB_COMPILE_NATIVE_BACKEND=flash asks for FA2.
    backend = s.native_backend
    if backend is None:
        backend = "cudnn" if E <= 128 else "none"
    if backend == "none":
        return None
    if failed and key(backend, q, v, causal) in failed:
        return None
    return backend


# The forwards through torch's generated Python bindings (a direct C++ call; torch.ops.aten
# goes through the boxed dispatcher from Python); the backwards have no such binding, so
# their overloads are looked up once.
_cudnn_forward = getattr(torch, "_scaled_dot_product_cudnn_attention",
                         torch.ops.aten._scaled_dot_product_cudnn_attention)
_flash_forward = getattr(torch, "_scaled_dot_product_flash_attention",
                         torch.ops.aten._scaled_dot_product_flash_attention)
_cudnn_backward = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_backward.default


def forward(backend, q, k, v, scale, causal):
    B, H, L, _ = q.shape
    if backend == "cudnn":
        out = _cudnn_forward(q, k, v, None, True, 0.0, causal, False, scale=scale)
    else:
        out = _flash_forward(q, k, v, 0.0, causal, False, scale=scale)
    o, lse = out[0], out[1]     # o in q's dimension order, as the op's contract wants
    if lse.dtype == torch.float32 and lse.is_contiguous():
        return o, lse.view(B, H, L)         # cuDNN: (B, H, L, 1); flash: (B, H, L)
    return o, lse.reshape(B, H, L).float().contiguous()


def forward_output(backend, q, k, v, scale, causal):
    """o alone: cuDNN then neither computes nor writes the lse (what native SDPA runs
    without grad); FA2's forward always returns one."""
    if backend == "cudnn":
        return _cudnn_forward(q, k, v, None, False, 0.0, causal, False, scale=scale)[0]
    return _flash_forward(q, k, v, 0.0, causal, False, scale=scale)[0]


def deterministic():
    """Whether torch.use_deterministic_algorithms(True) (not warn_only) is in force. PyTorch's
    fused backwards accumulate dq with atomics, and native SDPA then avoids cuDNN
    (sdp_utils' check_cudnn_deterministic); the op runs the Triton backward instead, whose
    default dq pass is deterministic (BOB_COMPILE_DEV_BWD_DQ=two_pass)."""
    return torch.are_deterministic_algorithms_enabled() and \
        not torch.is_deterministic_algorithms_warn_only_enabled()


_empty_seeds = {}


def _empty_seed(device):
    """An empty int64 tensor on device, made once (a fresh one per call cost an allocation
    call on every backward): with dropout 0 the RNG seed and offset are never read."""
    seed = _empty_seeds.get(device)
    if seed is None:
        seed = _empty_seeds[device] = torch.empty(0, device=device, dtype=torch.long)
    return seed


def backward(backend, q, k, v, o, lse, do, scale, causal):
    L, S = q.shape[2], k.shape[2]
    # no dropout: the RNG state is never read; cumulative lengths = None means "not varlen"
    seed = _empty_seed(q.device)
    do = layout.in_order_of(do, o)     # the fused backwards read dO in o's layout
    if backend == "cudnn":
        grads = _cudnn_backward(do, q, k, v, o, lse.unsqueeze(-1), seed, seed, None, None,
                                None, L, S, 0.0, causal, scale=scale)
    else:
        grads = _flash_backward(do, q, k, v, o, lse, None, None, L, S, 0.0, causal, seed, seed,
                                scale=scale)
    return grads[:3]        # in the primals' dimension orders (ops.py copies where not)


def attempt(backend, fn, q, k, v, *rest):
    """fn(backend, q, k, v, *rest), or None where PyTorch's fused kernel refuses this
    configuration: that configuration (dtype, head dims, causal) then runs the Triton kernels
    from now on. Out-of-memory is not a refusal: it propagates, and changes nothing."""
    try:
        return fn(backend, q, k, v, *rest)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError) as e:  # unsupported in this build or for these inputs
        refused(backend, q, v, rest[-1], e)
        return None


_refusal_listeners = []


def on_refused(listener):
    """Call listener() whenever a configuration is marked refused (what was decided from the
    call paths, elsewhere, must be decided again)."""
    _refusal_listeners.append(listener)
    return listener


def refused(backend, q, v, causal, error):
    """PyTorch's fused kernel (backend) refused these inputs with `error`: their
    configuration (dtype, head dims, causal) runs the Triton kernels from now on."""
    failed.add(key(backend, q, v, causal))
    for listener in _refusal_listeners:
        listener()
    log.warning("PyTorch fused attention (%s) failed for %s, head dims %d/%d, causal=%s (%s); "
                "using the Triton kernels for that configuration", backend, q.dtype,
                q.shape[3], v.shape[3], causal, error)
