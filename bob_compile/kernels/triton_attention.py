"""The Triton implementation of the kernel contract (see `bob_compile/kernels/__init__.py`).

    forward(q, k, v, params) -> (o, lse)
    forward_output(q, k, v, params) -> o
    backward(q, k, v, o, lse, do, dlse, params) -> (dq, dk, dv)
    bob(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, params)
        -> (gq, gk, gv, go, glse, gdo, gdlse)
    bob_folded(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, dq, params) -> (gq, gk, gv, gdo, gdlse)
    forward_jvp(q, k, v, o, lse, tq, tk, tv, params) -> (to, tlse)
    backward_jvp(q, k, v, o, lse, do, dlse, tq, tk, tv, to, tlse, tdo, tdlse, params)
        -> (tdq, tdk, tdv)

Where PyTorch's own fused kernels compute exactly the same thing faster (first order on
half-precision inputs without a mask tensor, GQA included, dlse = None), forward and backward
call them, so a first-order step through the op costs what native SDPA costs. Every other
case, and the whole second order, runs the kernels in triton_forward / triton_backward /
triton_bob (a mask tensor included: each reads its tiles where it forms the scores);
forward mode runs triton_forward_mode's (the blockwise path with a mask tensor).

The switches that choose among these (PyTorch's fused kernels or ours, the schedules) are
settings.SWITCHES (docs/settings.md).
"""
import logging
import sys

import torch

from . import blockwise, layout, settings
from .params import AttentionParams
from .triton_backward import attention_backward
from .tuning import BUILD_ERRORS, error_summary
from .triton_bob import attention_bob
from .triton_forward import attention_forward
from .triton_forward_mode import attention_backward_jvp, attention_forward_jvp

log = logging.getLogger("bob_compile.kernels")

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Widest head dim at which the folded BoB was measured to beat the chain form's BoB + second
# backward on the H200 (docs/measurements.md, "The folded form": 1.15-1.27x faster steps at
# 64 and 128); wider heads (256: not measured) keep the chain form.
FOLDED_MAX_HEAD_DIM = 128
# Widest head dim at which the folded row pass accumulates B = P k itself; wider heads get B
# from one more attention forward (keys as values: PyTorch's fused kernel where it applies),
# since a (BLOCK_M x 128) fp32 accumulator more spills thousands of bytes per thread.
ACCUMULATE_B_MAX_HEAD_DIM = 64
# Widest head dim per dtype whose tiles were run on the H200 (tests/gpu/test_gpu_kernels.py):
# 256 for half types; float32 rows take twice the shared memory, so 128.
MAX_HEAD_DIM = {torch.float16: 256, torch.bfloat16: 256, torch.float32: 128}


def folded_bob_pays(q, v):
    """Whether the folded BoB is the faster form for these head dims (kernels.fold_bob)."""
    return max(q.shape[-1], v.shape[-1]) <= FOLDED_MAX_HEAD_DIM


def supports(q, k, v):
    """True for 4-D CUDA tensors of one half/float dtype, head dims up to MAX_HEAD_DIM,
    and Hkv dividing Hq."""
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    dtype = q.dtype
    if dtype not in SUPPORTED_DTYPES or k.dtype != dtype or v.dtype != dtype:
        return False
    qs, ks, vs = q.shape, k.shape, v.shape
    widest = MAX_HEAD_DIM[dtype]
    if not (0 < qs[3] <= widest and 0 < vs[3] <= widest):
        return False
    if ks[3] != qs[3] or ks[:3] != vs[:3] or ks[0] != qs[0]:
        return False
    return ks[1] > 0 and qs[1] % ks[1] == 0


# --------------------------------------------------------------------------------------
# PyTorch's fused first-order kernels, where they apply
# --------------------------------------------------------------------------------------
# (backend, dtype, head dims, causal) configurations PyTorch's fused kernel refused once
_native_failed = set()


def _native_key(backend, q, v, causal):
    return backend, q.dtype, q.shape[3], v.shape[3], causal


def _native_backend(q, k, v, params):
    """'cudnn' or 'flash' when PyTorch's fused kernel computes exactly this op, else None
    (never with a mask tensor: our kernels read it as AttentionParams defines it)."""
    s = settings.current()
    if not q.is_cuda or params.mask is not None:
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
    if _native_failed and _native_key(backend, q, v, causal) in _native_failed:
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


def _native_forward(backend, q, k, v, scale, causal):
    B, H, L, _ = q.shape
    if backend == "cudnn":
        out = _cudnn_forward(q, k, v, None, True, 0.0, causal, False, scale=scale)
    else:
        out = _flash_forward(q, k, v, 0.0, causal, False, scale=scale)
    o, lse = out[0], out[1]     # o in q's dimension order, as the op's contract wants
    if lse.dtype == torch.float32 and lse.is_contiguous():
        return o, lse.view(B, H, L)         # cuDNN: (B, H, L, 1); flash: (B, H, L)
    return o, lse.reshape(B, H, L).float().contiguous()


def _native_forward_output(backend, q, k, v, scale, causal):
    """o alone: cuDNN then neither computes nor writes the lse (what native SDPA runs
    without grad); FA2's forward always returns one."""
    if backend == "cudnn":
        return _cudnn_forward(q, k, v, None, False, 0.0, causal, False, scale=scale)[0]
    return _flash_forward(q, k, v, 0.0, causal, False, scale=scale)[0]


def _deterministic():
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


def _native_backward(backend, q, k, v, o, lse, do, scale, causal):
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


def _try_native(backend, fn, q, k, v, *rest):
    """fn(backend, q, k, v, *rest), or None where PyTorch's fused kernel refuses this
    configuration: that configuration (dtype, head dims, causal) then runs the Triton kernels
    from now on. Out-of-memory is not a refusal: it propagates, and changes nothing."""
    try:
        return fn(backend, q, k, v, *rest)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError) as e:  # unsupported in this build or for these inputs
        native_refused(backend, q, v, rest[-1], e)
        return None


_refusal_listeners = []


def on_native_refused(listener):
    """Call listener() whenever a configuration is marked refused (what was decided from the
    call paths, elsewhere, must be decided again)."""
    _refusal_listeners.append(listener)
    return listener


def native_refused(backend, q, v, causal, error):
    """PyTorch's fused kernel (backend) refused these inputs with `error`: their
    configuration (dtype, head dims, causal) runs the Triton kernels from now on."""
    _native_failed.add(_native_key(backend, q, v, causal))
    _call_paths.clear()
    for listener in _refusal_listeners:
        listener()
    log.warning("PyTorch fused attention (%s) failed for %s, head dims %d/%d, causal=%s (%s); "
                "using the Triton kernels for that configuration", backend, q.dtype,
                q.shape[3], v.shape[3], causal, error)


# --------------------------------------------------------------------------------------
# Call paths: what the contract runs for one call signature, decided once
# --------------------------------------------------------------------------------------
# At short lengths a call's host time is what the GPU waits for, and the general path
# (ops.py, then the contract below) decides on every call what it decided the call before:
# which implementation (select), whether PyTorch's fused kernels compute this op
# (_native_backend, a dozen checks), which schedule, and the flattening of ops.py. All of it
# follows from `_signature`, so a CallPath per signature keeps the answers. A refusal by
# PyTorch's kernels, or a reload of the settings, forgets every call path.
class CallPath:
    """What forward, forward_output, backward and bob below run for one signature of 4-D
    inputs without a mask: PyTorch's fused kernels where they compute the op (`native`,
    first order), the Triton kernels otherwise. Outputs are laid out as the op returns them
    (each like the input it is shaped like: layout.py). A method returns None where it
    cannot answer (PyTorch's kernel refused, or no cotangent was given): the caller then
    takes the general path."""
    __slots__ = ("native", "params", "dq_atomics", "row_atomics")

    def __init__(self, native, params, current):
        self.native, self.params = native, params
        self.dq_atomics, self.row_atomics = current.bwd_dq_atomics, current.bob_row_atomics

    def forward(self, q, k, v):
        if self.native is None:
            o, lse = attention_forward(q, k, v, self.params)
        else:
            out = _try_native(self.native, _native_forward, q, k, v, self.params.scale,
                              self.params.causal)
            if out is None:
                return None
            o, lse = out
        return layout.in_order_of(o, q), lse

    def forward_output(self, q, k, v):
        if self.native is None:
            o = attention_forward(q, k, v, self.params)[0]
        else:
            o = _try_native(self.native, _native_forward_output, q, k, v, self.params.scale,
                            self.params.causal)
            if o is None:
                return None
        return layout.in_order_of(o, q)

    def backward(self, q, k, v, o, lse, do, dlse):
        if dlse is None and self.native is not None and not _deterministic():
            grads = _try_native(self.native, _native_backward, q, k, v, o, lse, do,
                                self.params.scale, self.params.causal)
            if grads is None:
                return None
        else:
            grads = attention_backward(q, k, v, o, lse, do, dlse, self.params,
                                       dq_atomics=self.dq_atomics)
        dq, dk, dv = grads
        return layout.in_order_of(dq, q), layout.in_order_of(dk, k), layout.in_order_of(dv, v)

    def bob(self, q, k, v, o, lse, do, dlse, gdq, gdk, gdv):
        if gdq is None and gdk is None and gdv is None:
            return None
        gq, gk, gv, go, glse, gdo, gdlse = attention_bob(
            q, k, v, o, lse, do, dlse, gdq, gdk, gdv, self.params, row_atomics=self.row_atomics)
        in_order_of = layout.in_order_of
        return (in_order_of(gq, q), in_order_of(gk, k), in_order_of(gv, v), in_order_of(go, o),
                glse, in_order_of(gdo, do), gdlse)

    def bob_folded(self, q, k, v, o, lse, do, dlse, gdq, gdk, gdv, dq):
        if gdq is None and gdk is None and gdv is None:
            return None
        keys_out = _keys_out(q, k, self.params, self.native)
        gq, gk, gv, gdo, gdlse = attention_bob(q, k, v, o, lse, do, dlse, gdq, gdk, gdv,
                                               self.params, fold=True, dq=dq, keys_out=keys_out)
        in_order_of = layout.in_order_of
        return (in_order_of(gq, q), in_order_of(gk, k), in_order_of(gv, v),
                in_order_of(gdo, do), gdlse)


_call_paths = {}        # signature -> CallPath, or None: not this module, or nothing to run
_CALL_PATHS_LIMIT = 1024


def _signature(q, k, v, scale, causal):
    s = settings.current()
    return (q.shape, k.shape, v.shape, q.stride(-1), k.stride(-1), v.stride(-1), q.dtype,
            k.dtype, v.dtype, q.device, scale, causal, s.kernels, s.native_backend,
            s.bwd_dq_atomics, s.bob_row_atomics)


def call_path(q, k, v, scale, causal):
    """The CallPath of these 4-D inputs (no mask), or None where `kernels.select` does not pick
    this module or a length is 0 (the general path handles those)."""
    key = _signature(q, k, v, scale, causal)
    try:
        return _call_paths[key]
    except KeyError:
        pass
    except TypeError:       # symbolic sizes are not hashable: decide without keeping it
        return _decide_call_path(q, k, v, scale, causal)
    if len(_call_paths) >= _CALL_PATHS_LIMIT:
        _call_paths.clear()
    found = _call_paths[key] = _decide_call_path(q, k, v, scale, causal)
    return found


def _decide_call_path(q, k, v, scale, causal):
    from . import select
    if select(q, k, v) is not sys.modules[__name__] or not (q.shape[2] and k.shape[2]):
        return None
    params = AttentionParams(scale=scale, causal=causal)
    return CallPath(_native_backend(q, k, v, params), params, settings.current())


@settings.on_reload
def _forget_call_paths(_settings):
    _call_paths.clear()


# --------------------------------------------------------------------------------------
# The contract
# --------------------------------------------------------------------------------------
def forward(q, k, v, params):
    scale, causal = params.scale, params.causal
    B, Hq, L, _ = q.shape
    S, Ev = k.shape[2], v.shape[3]
    if S == 0 or L == 0:
        o = torch.zeros((B, Hq, L, Ev), device=q.device, dtype=q.dtype)
        return o, torch.full((B, Hq, L), float("-inf"), device=q.device, dtype=torch.float32)
    backend = _native_backend(q, k, v, params)
    if backend is not None:
        out = _try_native(backend, _native_forward, q, k, v, scale, causal)
        if out is not None:
            return out
    return attention_forward(q, k, v, params)


def forward_output(q, k, v, params):
    if k.shape[2] and q.shape[2]:
        backend = _native_backend(q, k, v, params)
        if backend is not None:
            o = _try_native(backend, _native_forward_output, q, k, v, params.scale, params.causal)
            if o is not None:
                return o
    return forward(q, k, v, params)[0]


def backward(q, k, v, o, lse, do, dlse, params):
    scale, causal = params.scale, params.causal
    S, L = k.shape[2], q.shape[2]
    if S == 0 or L == 0:
        return torch.zeros_like(q, memory_format=torch.contiguous_format), \
            torch.zeros_like(k, memory_format=torch.contiguous_format), \
            torch.zeros_like(v, memory_format=torch.contiguous_format)
    if dlse is None and not _deterministic():
        backend = _native_backend(q, k, v, params)
        if backend is not None:
            out = _try_native(backend, _native_backward, q, k, v, o, lse, do, scale, causal)
            if out is not None:
                return out
    return attention_backward(q, k, v, o, lse, do, dlse, params,
                              dq_atomics=settings.current().bwd_dq_atomics)


def bob(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, params):
    S, L = k.shape[2], q.shape[2]
    if S == 0 or L == 0 or (gdq is None and gdk is None and gdv is None):
        # every output is a sum over visible (query, key) pairs times a cotangent: all zero
        like = (q, k, v, o, lse, do, lse)
        return tuple(torch.zeros(t.shape, device=t.device, dtype=t.dtype) for t in like)
    return attention_bob(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, params,
                         row_atomics=settings.current().bob_row_atomics)


def bob_folded(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, dq, params):
    S, L = k.shape[2], q.shape[2]
    if S == 0 or L == 0 or (gdq is None and gdk is None and gdv is None):
        like = (q, k, v, do, lse)
        return tuple(torch.zeros(t.shape, device=t.device, dtype=t.dtype) for t in like)
    keys_out = _keys_out(q, k, params)
    return attention_bob(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, params, fold=True, dq=dq,
                         keys_out=keys_out)


_UNDECIDED = object()


def _keys_out(q, k, params, native=_UNDECIDED):
    """B = P k (the attention output with the keys as values) for the folded row pass of
    heads wider than ACCUMULATE_B_MAX_HEAD_DIM, else None (the row pass accumulates it).
    native: PyTorch's fused backend for it (a call path's), or decided here where needed."""
    if q.shape[3] <= ACCUMULATE_B_MAX_HEAD_DIM:
        return None
    if native is _UNDECIDED:
        native = _native_backend(q, k, k, params)
    if native is not None:
        keys_out = _try_native(native, _native_forward_output, q, k, k, params.scale,
                               params.causal)
        if keys_out is not None:
            return keys_out
    return attention_forward(q, k, k, params)[0]


# Forward mode: the Triton kernels of triton_forward_mode.py, except with a mask tensor or an
# empty length (the blockwise path), and for a configuration whose kernel Triton could not
# build on this device (remembered, logged once; the blockwise path from then on).
_forward_mode_failed = set()


def _forward_mode_kernels(kind, q, v, params):
    return (params.mask is None and q.shape[2] > 0
            and (kind, q.dtype, q.shape[3], v.shape[3]) not in _forward_mode_failed)


def _forward_mode_refused(kind, q, v, error):
    _forward_mode_failed.add((kind, q.dtype, q.shape[3], v.shape[3]))
    log.warning("Triton %s kernel failed to build for %s, head dims %d/%d (%s); using "
                "the blockwise PyTorch path for that configuration", kind, q.dtype,
                q.shape[3], v.shape[3], error_summary(error))


def forward_jvp(q, k, v, o, lse, tq, tk, tv, params):
    if k.shape[2] and _forward_mode_kernels("forward_jvp", q, v, params):
        try:
            return attention_forward_jvp(q, k, v, o, lse, tq, tk, tv, params)
        except BUILD_ERRORS as e:
            _forward_mode_refused("forward_jvp", q, v, e)
    return blockwise.forward_jvp(q, k, v, o, lse, tq, tk, tv, params)


def backward_jvp(q, k, v, o, lse, do, dlse, tq, tk, tv, to, tlse, tdo, tdlse, params):
    if k.shape[2] and _forward_mode_kernels("backward_jvp", q, v, params):
        try:
            return attention_backward_jvp(q, k, v, o, lse, do, dlse, tq, tk, tv, to, tlse, tdo,
                                          tdlse, params)
        except BUILD_ERRORS as e:
            _forward_mode_refused("backward_jvp", q, v, e)
    return blockwise.backward_jvp(q, k, v, o, lse, do, dlse, tq, tk, tv, to, tlse, tdo, tdlse,
                                  params)
