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
half-precision inputs without a mask tensor or soft cap, GQA included, dlse = None), forward
and backward call them, so a first-order step through the op costs what native SDPA costs.
Every other case, and the whole second order, runs the kernels in triton_forward /
triton_backward / triton_bob (a mask tensor included: each reads its tiles where it forms the
scores; a soft cap too); forward mode runs triton_forward_mode's (the blockwise path with a
mask tensor or a soft cap).

The switches that choose among these (PyTorch's fused kernels or ours, the schedules) are
settings.SWITCHES (docs/settings.md).
"""
import logging
import sys

import torch

from . import blockwise, layout, native_sdpa, settings
from .params import AttentionParams, mask_own_shape, sum_to_mask
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
# Call paths: what the contract runs for one call signature, decided once
# --------------------------------------------------------------------------------------
# At short lengths a call's host time is what the GPU waits for, and the general path
# (ops.py, then the contract below) decides on every call what it decided the call before:
# which implementation (select), whether PyTorch's fused kernels compute this op
# (native_sdpa.backend_for, a dozen checks), which schedule, and the flattening of ops.py. All of it
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
            out = native_sdpa.attempt(self.native, native_sdpa.forward, q, k, v, self.params.scale,
                              self.params.causal)
            if out is None:
                return None
            o, lse = out
        return layout.in_order_of(o, q), lse

    def forward_output(self, q, k, v):
        if self.native is None:
            o = attention_forward(q, k, v, self.params)[0]
        else:
            o = native_sdpa.attempt(self.native, native_sdpa.forward_output, q, k, v,
                                    self.params.scale, self.params.causal)
            if o is None:
                return None
        return layout.in_order_of(o, q)

    def backward(self, q, k, v, o, lse, do, dlse):
        if dlse is None and self.native is not None and not native_sdpa.deterministic():
            grads = native_sdpa.attempt(self.native, native_sdpa.backward, q, k, v, o, lse, do,
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
    return CallPath(native_sdpa.backend_for(q, k, v, params), params, settings.current())


@native_sdpa.on_refused
def _forget_call_paths_of_refused():
    _call_paths.clear()


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
    backend = native_sdpa.backend_for(q, k, v, params)
    if backend is not None:
        out = native_sdpa.attempt(backend, native_sdpa.forward, q, k, v, scale, causal)
        if out is not None:
            return out
    return attention_forward(q, k, v, params)


def forward_output(q, k, v, params):
    if k.shape[2] and q.shape[2]:
        backend = native_sdpa.backend_for(q, k, v, params)
        if backend is not None:
            o = native_sdpa.attempt(backend, native_sdpa.forward_output, q, k, v, params.scale,
                                    params.causal)
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
    if dlse is None and not native_sdpa.deterministic():
        backend = native_sdpa.backend_for(q, k, v, params)
        if backend is not None:
            out = native_sdpa.attempt(backend, native_sdpa.backward, q, k, v, o, lse, do, scale,
                                      causal)
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


def bob_folded(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, dq, params, keys_out=None):
    """keys_out: B = P k where the caller computed it already (the C++ node, never with a
    soft cap: _keys_out), else None."""
    S, L = k.shape[2], q.shape[2]
    if S == 0 or L == 0 or (gdq is None and gdk is None and gdv is None):
        like = (q, k, v, do, lse)
        return tuple(torch.zeros(t.shape, device=t.device, dtype=t.dtype) for t in like)
    if keys_out is None:
        keys_out = _keys_out(q, k, params)
    return attention_bob(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, params, fold=True, dq=dq,
                         keys_out=keys_out)


def _bias_accumulator(params):
    """fp32 zeros where the kernels add a learned bias's cotangent: shaped like the mask with
    1 on its broadcast (stride-0) dims, so that every (batch, head) sharing an element adds
    into it by atomics; under torch.use_deterministic_algorithms the mask's full shape, each
    element added once (bit-identical), summed over the broadcast dims after (_bias_result)."""
    mask = params.mask
    shape = mask.shape if native_sdpa.deterministic() else mask_own_shape(mask)
    return torch.zeros(shape, dtype=torch.float32, device=mask.device)


def _bias_result(accumulated, params):
    """The accumulated cotangent in the mask's own shape and dtype."""
    return sum_to_mask(accumulated, params.mask).to(params.mask.dtype)


def backward_bias(q, k, v, o, lse, do, dlse, params):
    """backward, and a learned bias's cotangent dS (the Triton backward; PyTorch's fused
    kernels return no dS)."""
    dmask = _bias_accumulator(params)
    if k.shape[2] == 0 or q.shape[2] == 0:
        return (*backward(q, k, v, o, lse, do, dlse, params), _bias_result(dmask, params))
    grads = attention_backward(q, k, v, o, lse, do, dlse, params,
                               dq_atomics=settings.current().bwd_dq_atomics, dmask=dmask)
    return (*grads, _bias_result(dmask, params))


def bob_folded_bias(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, gdmask, dq, params):
    """bob_folded with a learned bias: gdmask adds to F, the bias's cotangent comes last."""
    gmask = _bias_accumulator(params)
    S, L = k.shape[2], q.shape[2]
    if S == 0 or L == 0 or (gdq is None and gdk is None and gdv is None and gdmask is None):
        like = (q, k, v, do, lse)
        return (*(torch.zeros(t.shape, device=t.device, dtype=t.dtype) for t in like),
                _bias_result(gmask, params))
    outs = attention_bob(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, params, fold=True, dq=dq,
                         keys_out=_keys_out(q, k, params), gdmask=gdmask, gmask=gmask)
    return (*outs, _bias_result(gmask, params))


_UNDECIDED = object()


def _keys_out(q, k, params, native=_UNDECIDED):
    """B = P k (the attention output with the keys as values) for the folded row pass of
    heads wider than ACCUMULATE_B_MAX_HEAD_DIM, else None (the row pass accumulates it).
    native: PyTorch's fused backend for it (a call path's), or decided here where needed."""
    # with a soft cap the row pass needs (φ' ∘ P) k, which no attention forward computes:
    # it accumulates that itself at every head dim
    if q.shape[3] <= ACCUMULATE_B_MAX_HEAD_DIM or params.softcap:
        return None
    params = params.without_dropout()       # B is P k: the keys are not dropped
    if native is _UNDECIDED:
        native = native_sdpa.backend_for(q, k, k, params)
    if native is not None:
        keys_out = native_sdpa.attempt(native, native_sdpa.forward_output, q, k, k, params.scale,
                               params.causal)
        if keys_out is not None:
            return keys_out
    return attention_forward(q, k, k, params)[0]


# Forward mode: the Triton kernels of triton_forward_mode.py, except with a mask tensor, a
# soft cap (they have neither) or an empty length (the blockwise path), and for a
# configuration whose kernel Triton could not build on this device (remembered, logged once;
# the blockwise path from then on).
_forward_mode_failed = set()


def _forward_mode_kernels(kind, q, v, params):
    return (params.mask is None and not params.softcap and q.shape[2] > 0
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
