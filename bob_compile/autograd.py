"""Autograd for the attention ops, at every order and under every torch.func transform.

`custom_op.register_autograd` builds an old-style autograd.Function, which torch.func
refuses (and forward-mode AD through it silently yields zero tangents: docs/torch-behaviour.md).
So each op is called from a new-style autograd.Function (`setup_context`, an explicit
`jvp`, `generate_vmap_rule`), and the Functions chain:

    AttnFn (attn_fwd)  --backward-->  AttnBwdFn (attn_bwd)  --backward-->  AttnBobFoldedFn
                                                                         (attn_bob_folded)
                                                                      or AttnBobFn (attn_bob)

Factorization of the second order (docs/second-order.md). o and lse are inputs of
attn_bwd, so its plain VJP (attn_bob, the CHAIN form) returns cotangents for o and lse
too, and autograd sends those back through AttnFn.backward: one more attn_bwd with an
incoming lse cotangent. The FOLDED form (attn_bob_folded) uses that o and lse
are AttnFn's outputs for the same q, k, v: it returns their cotangents already sent
through the forward, inside those of q, k, v, so no second backward runs. It takes two
row scalars first (a row pass, then a column pass: 38·d FLOPs per pair against the chain's
34·d + 14·d for the extra attn_bwd), sums every term of gq, gk, gv in fp32 before one
rounding, and leaves the backward of a Hessian-vector product's cotangent through o (from
the rest of the model) to PyTorch's fused kernels. BOB_COMPILE_DEV_BOB_FORM=chain (or the
backend option bob_form) selects the chain form, =folded the folded form; by default
(auto) the Triton kernels fold up to head dim 128, where it was measured faster
(kernels.fold_bob, docs/measurements.md).

Forward mode uses two more ops, attn_fwd_jvp and attn_bwd_jvp (one pass each; explicit
formulas, since nested forward AD fails inside compiled jvp). Third order (the VJP or the
JVP of attn_bob, attn_bob_folded or a jvp op: grad of an HVP, grad of a jvp, jvp of a jvp,
jacfwd(jacfwd), a jvp of an HVP) runs through the closed-form math of
bob_compile/kernels/reference.py: correct and traceable, but unfused and O(L·S) in memory.

Torch's legacy vmap (`torch._vmap_internals._vmap`, behind `is_grads_batched=True` and
`vectorize=True` in torch.autograd.functional) wraps tensors in BatchedTensors. Builtin ops
under it record autograd on the unbatched tensors inside, but an autograd.Function's apply
records its node on the wrapper, which vmap throws away with the wrapper: a fused step
applied there with grad mode on would silently lose its derivatives. Such steps run the
closed-form twin instead (builtin ops, exact at every order); without grad mode (no
create_graph) the fused ops run, as their results are never differentiated.

The file runs from the plumbing every Function shares (the host fast path, jvp rules, call
paths) through first, second and third order. The C++ nodes that run plain eager calls
with less host time are bob_compile/eager/, which calls into this module, never the
reverse.
"""
import inspect
import logging
import threading

import torch
from torch._functorch.utils import unwrap_dead_wrappers
from torch._C._functorch import TransformType, _unwrap_for_grad, _wrap_for_grad
from torch._functorch.autograd_function import custom_function_call
from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

from . import _compat, kernels, ops
from .kernels import reference
from .kernels import settings as kernel_settings

op = torch.ops.bob_compile
log = logging.getLogger("bob_compile.autograd")


# ----------------------------------------------------------------------------- host fast path
# Host cost per call matters: at batch 1 and short sequences the GPU waits for the CPU, and
# the double-backward graphs of the eager route call these Functions thousands of times per
# step. Two costs are avoidable in plain eager code without changing what runs:
#
# 1. The dispatcher round trip of a torch.library.custom_op (an Autograd kernel in Python,
#    a redispatch, the CompositeExplicitAutograd wrapper with its dynamo-disable and
#    aliasing checks): ~40 us on a server CPU, more than native SDPA's whole forward.
#    Where nothing could observe the op (no torch function or dispatch mode, so no tracing,
#    fake tensors, functionalization or FlopCounter; no functorch transform; no jit trace;
#    every tensor a plain dense Tensor/Parameter, not a tensor subclass, functorch wrapper
#    or legacy-vmap BatchedTensor), the Functions call the op's implementation, ops.call_*
#    with kernels.select, directly: the same function the op's own implementation calls.
#    Everywhere else they call the op, so graphs, AOTAutograd, torch.func and vmap still
#    see torch.ops.bob_compile.*. Under the profiler the direct call is recorded under the
#    op's name.
# 2. autograd.Function.apply binds its arguments with inspect.signature on every call
#    (~25 us) when the Function defines setup_context. Our forwards have no defaults and are
#    always called positionally, so `_Fused.apply` skips that, under torch.func too (there it
#    hands the call to functorch's custom_function_call, as Function.apply does; torch 2.14
#    binds in C, where a preset signature is all we can do); and when no output can need
#    a graph (grad mode off or no input requiring grad, no forward-mode AD level, plain
#    eager) it runs the forward directly, as Function.apply would, minus the node.
# 3. A backward that records no graph (no create_graph) of a plain eager call runs the
#    kernels of the call's CallPath (bob_compile/kernels/triton_attention.py: what the implementation
#    runs for that signature, decided at forward time) directly, not through the next
#    Function's apply and the op layers: ordinary training's backward is then PyTorch's
#    cuDNN backward behind one Python node, and a second-order step's final backward runs
#    the BoB and the second backward the same way. Anything that could observe the op (a
#    mode, the profiler, torch.func, a tensor subclass) takes the general path.
_functorch_active = torch._C._are_functorch_transforms_active
_torch_function_mode_on = torch._C._is_torch_function_mode_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_tracing_state = torch._C._get_tracing_state
_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_is_legacy_batched = torch._C._functorch.is_legacy_batchedtensor   # in torch since 2.0
_profiling = torch._C._autograd._profiler_enabled
_any_requires_grad = torch._C._any_requires_grad
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_forward_ad = torch.autograd.forward_ad


def plain_eager(tensors):
    """Whether these op inputs may go to the implementation without the dispatcher
    (see above): nothing that intercepts ops is active and every tensor is plain."""
    if _functorch_active() or _dispatch_modes() or _torch_function_mode_on() \
            or _tracing_state() is not None:
        return False
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN_TYPES or _is_functorch_wrapped(t)
                              or _is_legacy_batched(t)):
            return False
    return True


def _tensor_arguments(args):
    """The tensor (or None) arguments of a Function's call: all but the trailing scale,
    causal, dropout_p and softcap (the seed, before softcap, is a tensor)."""
    return args[:-5] + args[-2:-1]


# Whether the running `_Fused.apply` found its call plain eager (per thread: the autograd
# engine runs backwards on its own threads), so that the forward it runs need not check again.
_apply_state = threading.local()


def _direct(call, name, args):
    """The op's implementation `call(kernels.select, *args)`, without the dispatcher;
    under the profiler recorded under the op's name. A mask's summary may be kept for the
    call's backwards here (AttentionParams.keep_mask_summary): plain eager code owns its
    memory, unlike a compiled graph's CUDA-graph pool."""
    if _profiling():
        with torch.profiler.record_function(name):
            return call(kernels.select, *args, keep_mask_summary=True)
    return call(kernels.select, *args, keep_mask_summary=True)


def _run(op_overload, call, name, args):
    """op_overload(*args), or its implementation directly (_direct) where nothing could
    observe the op (args: the op's arguments, mask, scale and causal last)."""
    if not getattr(_apply_state, "plain", False):
        return op_overload(*args)
    return _direct(call, name, args)


def no_graph_needed(args):
    """Whether no output computed from `args` can need an autograd graph: no forward-AD
    level, and grad mode off or no input requiring grad."""
    return _forward_ad._current_level < 0 and (
        not torch.is_grad_enabled() or not _any_requires_grad(*args))


class _Fused(torch.autograd.Function):
    """An autograd.Function whose apply skips the per-call signature binding, and the
    autograd node where no output can need one (see the section comment above). Every
    other call goes through torch.autograd.Function.apply unchanged."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if _compat.FUNCTION_APPLY_BINDS_IN_C:
            # the C apply binds on every call; a preset signature spares parsing forward's
            forward = cls.__dict__["forward"].__func__
            forward.__signature__ = inspect.signature(forward)

    @classmethod
    def apply(cls, *args, **kwargs):
        if kwargs:
            return super().apply(*args, **kwargs)
        if _functorch_active():
            jvp_rule_level = _jvp_rule_interpreter()
            if jvp_rule_level is not None:
                return _apply_below_jvp_level(jvp_rule_level, cls, args)
            return custom_function_call(cls, *args)     # as Function.apply does, unbound
        plain = plain_eager(_tensor_arguments(args))
        if not plain:
            args = unwrap_dead_wrappers(args)
        outer, _apply_state.plain = getattr(_apply_state, "plain", False), plain
        try:
            if plain and no_graph_needed(args):
                return cls.forward(*args)
            # what Function.apply does from here on, without binding the signature again
            return super(torch.autograd.Function, cls).apply(*args)
        finally:
            _apply_state.plain = outer


# ----------------------------------------------------------------------------- jvp rules
# Under torch.func.jvp, a Function's jvp rule runs at the jvp transform's level with forward
# gradients off (autograd evaluates forward-mode formulas so), so no tangent of what the rule
# computes is tracked at that level. Our rules call the forward-mode ops' Functions; going
# through functorch's custom_function_call at that level would unwrap the arguments, build a
# single-level Function and rewrap the outputs for nothing (~0.4 ms of host time per call
# on the H200's host; forward over reverse makes two: docs/host-overhead.md). So there the
# level is peeled here, as that single-level Function's forward does (unwrap, lower, apply
# with gradients on, wrap), and any level below (a grad transform: third order) is still
# handled by the Function as usual.
def _jvp_rule_interpreter():
    """The current jvp transform's interpreter where a jvp rule runs at its level, else None."""
    if torch._C._is_fwd_grad_enabled():
        return None
    interpreter = retrieve_current_functorch_interpreter()
    return interpreter if interpreter.key() == TransformType.Jvp else None


def _apply_below_jvp_level(interpreter, cls, args):
    level = interpreter.level()
    unwrapped = tuple(_unwrap_for_grad(a, level) if isinstance(a, torch.Tensor) else a
                      for a in args)
    with torch.enable_grad(), _forward_ad._set_fwd_grad_enabled(True), interpreter.lower():
        outputs = cls.apply(*unwrapped)
    return tuple(None if t is None else _wrap_for_grad(t, level) for t in outputs)


def _plain_call_path(q, k, v, mask, scale, causal, dropout_p, softcap):
    """In the forward of a plain eager `_Fused.apply`: the implementation's CallPath for this
    call (ops.call_path), also kept for the setup_context that runs next on this thread (its
    backward may then run its kernels directly); None in any other call, or where
    the profiler should see the op's name."""
    if not getattr(_apply_state, "plain", False):
        return None
    path = _apply_state.call_path = ops.call_path(kernels.select, q, k, v, mask, scale, causal,
                                                  dropout_p, softcap)
    return None if _profiling() else path


def _call_path_of_plain_call():
    """At setup_context: the call path the forward of this plain eager call found, else None."""
    return _apply_state.call_path if getattr(_apply_state, "plain", False) else None


def _call_path_refused():
    """The call path's kernel refused (PyTorch's fused kernel, for this configuration): the
    general path runs, and the backward must not try it again."""
    _apply_state.call_path = None


def _call_path_applies(ctx, cotangents):
    """Whether a backward may call ctx.call_path's kernels directly, as the next Function's
    forward would, minus its layers: nothing will differentiate the result (grad mode off,
    i.e. no create_graph), the call was plain eager (ctx.call_path is set), and so is this
    backward: plain cotangents, no mode, not under the profiler (which should see the op's
    name) and the kernel choices of the forward are the ones in force (ctx.kernel_choices
    None: none were made, so the call path, decided under the same settings, applies)."""
    return (ctx.call_path is not None and ctx.kernel_choices is None
            and not torch.is_grad_enabled() and not _profiling() and plain_eager(cotangents))


def _forward_mode_possible():
    """Whether this node's jvp may run: only under a forward-AD level or a torch.func
    transform active while the node is made (then setup_context saves for it)."""
    return _forward_ad._current_level >= 0 or _functorch_active()


def _zeros_if_none(t, like):
    return torch.zeros_like(like) if t is None else t


# ----------------------------------------------------------------------------- legacy vmap
_legacy_vmap_fallback_logged = False


def _needs_twin_under_legacy_vmap(*tensors):
    """Whether a fused step on these tensors must run its closed-form twin instead: grad mode
    is on, so its result may be differentiated again, and some tensor is batched by legacy
    vmap, which would drop the step's autograd node (see the module docstring)."""
    global _legacy_vmap_fallback_logged
    if not torch.is_grad_enabled():
        return False
    if not any(t is not None and _is_legacy_batched(t) for t in tensors):
        return False
    if not _legacy_vmap_fallback_logged:
        _legacy_vmap_fallback_logged = True
        log.warning(
            "bob_compile.attention: differentiable derivatives under torch's legacy vmap "
            "(is_grads_batched=True, or vectorize=True in torch.autograd.functional) run the "
            "exact but unfused math (O(L·S) memory per batched cotangent); torch.func "
            "(vmap, jacrev, hessian) keeps the fused kernels.")
    return True


# ----------------------------------------------------------------------------- first order
def plain_call(tensors):
    """Whether a call on these op inputs is plain eager: no torch.func transform, and
    nothing else that could observe it (plain_eager)."""
    return not _functorch_active() and plain_eager(tensors)


def forward_output(q, k, v, mask, scale, causal, dropout_p=0.0, seed=None, softcap=0.0):
    """o of a plain call that nothing can differentiate (no grad needed, no forward-mode
    AD): the implementation's forward_output, without an lse (PyTorch's fused forward then
    skips computing it, as native SDPA does without grad)."""
    return _direct(ops.call_forward_output, "bob_compile::attn_fwd",
                   (q, k, v, mask, scale, causal, dropout_p, seed, softcap))


def attention_with_lse(q, k, v, mask, scale, causal, dropout_p=0.0, seed=None, softcap=0.0):
    """(o, lse) of the attention op, differentiable to any order (AttnFn, or its twin where
    legacy vmap would drop AttnFn's node)."""
    if _needs_twin_under_legacy_vmap(q, k, v):
        return _forward_twin(q, k, v, mask, scale, causal, dropout_p, seed, softcap)
    return AttnFn.apply(q, k, v, mask, scale, causal, dropout_p, seed, softcap)


def learned_bias_output(q, k, v, bias, scale, causal, dropout_p=0.0, seed=None, softcap=0.0):
    """o of a call whose additive mask requires grad (a learned bias), differentiable to any
    order in every input, the bias included: BiasAttnFn (the fused first and second order
    of the bias) for 4-D inputs; for others, and under legacy vmap, the closed-form twin,
    whose builtin ops autograd and torch.func differentiate (unfused, O(L·S) memory), said
    once in the log."""
    if q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and bias.dim() <= 4 \
            and not _needs_twin_under_legacy_vmap(q, k, v, bias):
        if any(stride == 0 and n > 1 for stride, n in zip(bias.stride(), bias.shape)):
            bias = bias.contiguous()    # its broadcast dims must be the ones the op adds
        return BiasAttnFn.apply(q, k, v, bias, scale, causal, dropout_p, seed, softcap)[0]
    global _learned_bias_logged
    if not _learned_bias_logged:
        _learned_bias_logged = True
        log.warning("bob_compile.attention: attn_mask requires grad (a learned bias) with "
                    "inputs other than 4-D (or under legacy vmap): such calls run the "
                    "closed-form math, unfused (O(L*S) memory), exact at every order")
    return _forward_twin(q, k, v, bias, scale, causal, dropout_p, seed, softcap)[0]


_learned_bias_logged = False


def differentiable_first_backward(q, k, v, o, lse, do, dlse, mask, scale, causal,
                                  dropout_p=0.0, seed=None, softcap=0.0, kernel_choices=None):
    """(dq, dk, dv) of the forward's (o, lse) by the general path, differentiable again
    (_first_backward, or its closed-form twin where legacy vmap would drop AttnBwdFn's node),
    under the kernel choices of the forward: what the first order's nodes (AttnFn, and the
    C++ node, bob_compile/eager/node.py) run wherever they cannot call their kernels
    directly."""
    backward = _backward_twin if _needs_twin_under_legacy_vmap(do, dlse) else _first_backward
    return kernel_settings.run_with(kernel_choices, backward, q, k, v, o, lse,
                                    _zeros_if_none(do, o), dlse, mask, scale, causal,
                                    dropout_p, seed, softcap)


class AttnFn(_Fused):
    """attn_fwd; outputs (o, lse). lse is exposed so that its cotangent (non-zero in the
    second order of the chain form) reaches attn_bwd."""
    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, mask, scale, causal, dropout_p, seed, softcap):
        path = _plain_call_path(q, k, v, mask, scale, causal, dropout_p, softcap)
        if path is not None:
            out = path.forward(q, k, v)
            if out is not None:
                return out
            _call_path_refused()
        return _run(op.attn_fwd, ops.call_forward, "bob_compile::attn_fwd",
                    (q, k, v, mask, scale, causal, dropout_p, seed, softcap))

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask, scale, causal, dropout_p, seed, softcap = inputs
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse, mask, seed)
        ctx.kernel_choices = kernel_settings.overridden()
        if _forward_mode_possible():
            ctx.save_for_forward(q, k, v, o, lse, mask, seed)
        ctx.scale, ctx.causal, ctx.dropout_p, ctx.softcap = scale, causal, dropout_p, softcap
        ctx.set_materialize_grads(False)            # dlse stays None in ordinary training
        ctx.call_path = _call_path_of_plain_call()

    @staticmethod
    def backward(ctx, do, dlse):
        if do is None and dlse is None:
            return (None,) * 9
        q, k, v, o, lse, mask, seed = ctx.saved_tensors
        if _call_path_applies(ctx, (do, dlse)):
            grads = ctx.call_path.backward(q, k, v, o, lse, _zeros_if_none(do, o), dlse)
            if grads is not None:
                return (*grads, None, None, None, None, None, None)
        dq, dk, dv = differentiable_first_backward(
            q, k, v, o, lse, do, dlse, mask, ctx.scale, ctx.causal, ctx.dropout_p, seed,
            ctx.softcap, kernel_choices=ctx.kernel_choices)
        return dq, dk, dv, None, None, None, None, None, None

    @staticmethod
    def jvp(ctx, tq, tk, tv, _tmask, _scale, _causal, _dropout_p, _tseed, _softcap):
        q, k, v, o, lse, mask, seed = ctx.saved_tensors
        jvp = _forward_jvp_twin if _needs_twin_under_legacy_vmap(tq, tk, tv) else AttnFwdJvpFn.apply
        return jvp(q, k, v, o, lse, tq, tk, tv, mask, ctx.scale, ctx.causal, ctx.dropout_p, seed,
                   ctx.softcap)


# ----------------------------------------------------------------------------- second order
def _keep_dq(ctx, dq):
    """Keep the first backward's dq for the folded BoB (which reads R = dS k from it, one
    GEMM per tile less): detached, so that keeping it neither makes a reference cycle nor
    forbids the caller to modify dq in place (a modified dq is then not used, see
    _kept_dq). Not under torch.func or legacy vmap, whose wrappers of dq belong to their
    level (and legacy vmap has no detach): there the kernels recompute R."""
    if _functorch_active() or _is_functorch_wrapped(dq) or _is_legacy_batched(dq):
        ctx.dq = None
        return
    ctx.dq, ctx.dq_version = dq.detach(), dq._version


def _kept_dq(ctx):
    """The kept dq, or None (not kept, or modified in place since: the BoB then recomputes
    R itself, exact either way)."""
    dq = ctx.dq
    return dq if dq is not None and dq._version == ctx.dq_version else None


class AttnBwdFn(_Fused):
    """attn_bwd, the first backward; its backward is the fused BoB.

    Applied only by AttnFn.backward (and, in compiled training graphs, where AttnFn's
    backward was traced): its o and lse are always AttnFn's outputs for the same q, k, v.
    That is what lets the folded BoB return the cotangents of o and lse
    already sent through the forward, as parts of those of q, k, v (and None for o and
    lse), so that no second backward runs."""
    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, o, lse, do, dlse, mask, scale, causal, dropout_p, seed, softcap):
        path = _plain_call_path(q, k, v, mask, scale, causal, dropout_p, softcap)
        if path is not None:
            grads = path.backward(q, k, v, o, lse, do, dlse)
            if grads is not None:
                return grads
            _call_path_refused()
        return _run(op.attn_bwd, ops.call_backward, "bob_compile::attn_bwd",
                    (q, k, v, o, lse, do, dlse, mask, scale, causal, dropout_p, seed, softcap))

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, o, lse, do, dlse, mask, scale, causal, dropout_p, seed, softcap = inputs
        ctx.has_dlse = dlse is not None
        ctx.kernel_choices = kernel_settings.overridden()
        ctx.call_path = _call_path_of_plain_call()
        # Where o and lse came in detached (_first_backward), the attached pair is saved too,
        # for a third order: saved like the rest, so that a backward without retain_graph
        # releases it (kept as an attribute, it would keep the forward's node and everything
        # that node saved alive as long as this one)
        attached = getattr(_apply_state, "folded_forward_outputs", None)
        _apply_state.folded_forward_outputs = None
        ctx.came_detached = attached is not None
        ctx.save_for_backward(q, k, v, o, lse, do, dlse, mask, seed, *(attached or ()))
        if _forward_mode_possible():
            ctx.save_for_forward(q, k, v, o, lse, do, dlse, mask, seed)
        ctx.scale, ctx.causal, ctx.dropout_p, ctx.softcap = scale, causal, dropout_p, softcap
        ctx.set_materialize_grads(False)            # None cotangents skip their GEMMs
        _keep_dq(ctx, output[0])

    @staticmethod
    def backward(ctx, gdq, gdk, gdv):
        if gdq is None and gdk is None and gdv is None:
            return (None,) * 13
        q, k, v, o, lse, do, dlse, mask, seed, *attached = ctx.saved_tensors
        if ctx.came_detached:       # o and lse came in detached: the BoB folds
            fold = True
            if torch.is_grad_enabled():     # a third order differentiates the BoB, o and lse too
                o, lse = attached
        else:   # under the kernel choices in force at forward time (this runs later, on the
            # autograd engine's thread)
            fold = kernel_settings.run_with(ctx.kernel_choices, kernels.fold_bob, q, k, v)
        path = ctx.call_path if _call_path_applies(ctx, (gdq, gdk, gdv)) else None
        outs = run_bob(fold, path, ctx.kernel_choices, q, k, v, o, lse, do, dlse, gdq, gdk, gdv,
                       _kept_dq(ctx) if fold else None, mask, ctx.scale, ctx.causal,
                       ctx.dropout_p, seed, ctx.softcap)
        if fold:        # nothing for o and lse: their cotangents are in gq, gk, gv
            (gq, gk, gv, gdo, gdlse), go, glse = outs, None, None
        else:
            gq, gk, gv, go, glse, gdo, gdlse = outs
        return (gq, gk, gv, go, glse, gdo, (gdlse if ctx.has_dlse else None),
                None, None, None, None, None, None)

    @staticmethod
    def jvp(ctx, tq, tk, tv, to, tlse, tdo, tdlse, _tmask, _scale, _causal, _dropout_p, _tseed,
            _softcap):
        q, k, v, o, lse, do, dlse, mask, seed = ctx.saved_tensors
        if dlse is None:
            tdlse = None
        tangents = (tq, tk, tv, to, tlse, tdo, tdlse)
        jvp = _backward_jvp_twin if _needs_twin_under_legacy_vmap(*tangents) else AttnBwdJvpFn.apply
        return jvp(q, k, v, o, lse, do, dlse, *tangents, mask, ctx.scale, ctx.causal,
                   ctx.dropout_p, seed, ctx.softcap)


def run_bob(fold, path, kernel_choices, q, k, v, o, lse, do, dlse, gdq, gdk, gdv, dq, mask,
            scale, causal, dropout_p=0.0, seed=None, softcap=0.0):
    """The BoB of a first backward (AttnBwdFn's, or the C++ node's second node's), folded
    (reading dq, if given) or in the chain form: `path`'s kernels directly where a call path
    applies (path not None), else through its Function (its closed-form twin where legacy
    vmap would drop the node), under the forward's kernel choices."""
    method, twin, function = (("bob_folded", _bob_folded_twin, AttnBobFoldedFn) if fold
                              else ("bob", _bob_twin, AttnBobFn))
    cotangents = (gdq, gdk, gdv, dq) if fold else (gdq, gdk, gdv)
    outs = None
    if path is not None:
        outs = getattr(path, method)(q, k, v, o, lse, do, dlse, *cotangents)
    if outs is None:
        bob = twin if _needs_twin_under_legacy_vmap(gdq, gdk, gdv) else function.apply
        outs = kernel_settings.run_with(kernel_choices, bob, q, k, v, o, lse, do, dlse,
                                        *cotangents, mask, scale, causal, dropout_p, seed,
                                        softcap)
    return outs


def _first_backward(q, k, v, o, lse, do, dlse, mask, scale, causal, dropout_p, seed, softcap):
    """AttnBwdFn.apply from AttnFn.backward. Where its graph is recorded (create_graph) in
    plain autograd (no torch.func transform, no forward-mode AD, plain tensors) and its BoB
    will take the folded form, o and lse enter it detached: the folded BoB returns no
    cotangents for them, so the second backward's graph may end at AttnBwdFn, and the
    autograd engine does not visit AttnFn's node again only to hand it two None cotangents
    (about a tenth of a second-order step's host time at short lengths: docs/measurements.md,
    "Host overhead"). AttnBwdFn saves the attached o and lse too (its setup_context takes
    them from _apply_state) for the BoB of a third order, whose math twin sends cotangents to
    o and lse as well."""
    if torch.is_grad_enabled() and not _functorch_active() and _forward_ad._current_level < 0 \
            and plain_eager((q, k, v, o, lse, do, dlse, mask, seed)) \
            and kernels.fold_bob(q, k, v):
        _apply_state.folded_forward_outputs = (o, lse)
        try:
            return AttnBwdFn.apply(q, k, v, o.detach(), lse.detach(), do, dlse, mask, scale,
                                   causal, dropout_p, seed, softcap)
        finally:
            _apply_state.folded_forward_outputs = None
    return AttnBwdFn.apply(q, k, v, o, lse, do, dlse, mask, scale, causal, dropout_p, seed,
                           softcap)


# ----------------------------------------------------------------------------- third order
# The derivative ops' own derivatives, through the closed-form math (bob_compile/kernels/
# reference.py).
def _always_reference(q, k, v):
    return reference


def _canonical_twin(call):
    """The closed-form twin of an op with the op's own (any-leading-dims) calling convention."""
    def twin(*args):
        return call(_always_reference, *args)
    return twin


_forward_twin = _canonical_twin(ops.call_forward)
_backward_twin = _canonical_twin(ops.call_backward)
_bob_twin = _canonical_twin(ops.call_bob)
_bob_folded_twin = _canonical_twin(ops.call_bob_folded)
_forward_jvp_twin = _canonical_twin(ops.call_forward_jvp)
_backward_jvp_twin = _canonical_twin(ops.call_backward_jvp)


def _twin_inputs(ctx, like):
    """(the saved tensor inputs of a fused op, each None made zeros shaped like its input
    like[i]; the mask and the dropout seed, saved last)."""
    *saved, mask, seed = ctx.saved_tensors
    return tuple(torch.zeros_like(saved[like[i]]) if t is None else t
                 for i, t in enumerate(saved)), mask, seed


def _third_order(twin, ctx, grads, like):
    """Cotangents of a fused op's inputs, by differentiating its closed-form twin; the mask
    and the seed (saved last, constants) get None, as do scale, causal, dropout_p and softcap.

    A None (optional) input becomes zeros shaped like input like[i]; its gradient is
    dropped again."""
    primals, mask, seed = _twin_inputs(ctx, like)
    outputs, pull = torch.func.vjp(
        lambda *a: twin(*a, mask, ctx.scale, ctx.causal, ctx.dropout_p, seed, ctx.softcap),
        *primals)
    grads = [torch.zeros_like(o) if g is None else g for g, o in zip(grads, outputs)]
    cotangents = pull(tuple(grads))
    return (*(g if present else None for g, present in zip(cotangents, ctx.present)),
            None, None, None, None, None, None)


def _third_order_jvp(twin, ctx, tangents, like):
    """Tangents of a fused op's outputs (forward mode over a derivative op: jvp of a jvp,
    jacfwd(jacfwd), forward over reverse over reverse), by pushing the tangents of its
    inputs through its closed-form twin; the mask, scale, causal, dropout_p, seed and softcap
    have none. A None input or tangent is zeros, as in _third_order."""
    primals, mask, seed = _twin_inputs(ctx, like)
    pushed = tuple(torch.zeros_like(p) if t is None else t
                   for t, p in zip(tangents[:len(primals)], primals))
    _, out = torch.func.jvp(
        lambda *a: twin(*a, mask, ctx.scale, ctx.causal, ctx.dropout_p, seed, ctx.softcap),
        primals, pushed)
    return out


def _save_all(ctx, inputs):
    *tensors, mask, scale, causal, dropout_p, seed, softcap = inputs
    ctx.present = [t is not None for t in tensors]
    ctx.save_for_backward(*tensors, mask, seed)
    if _forward_mode_possible():
        ctx.save_for_forward(*tensors, mask, seed)
    ctx.scale, ctx.causal, ctx.dropout_p, ctx.softcap = scale, causal, dropout_p, softcap
    ctx.set_materialize_grads(False)


def _like_positions(op_overload, **like):
    """{position of an optional input: position of the required input shaped like it},
    from the op's own argument names (optional input name=required input name)."""
    names = [argument.name for argument in op_overload._schema.arguments]
    return {names.index(optional): names.index(required) for optional, required in like.items()}


def _derivative_op_function(name, op_overload, call, twin, like, doc):
    """The autograd.Function of a derivative op (attn_bob, attn_bob_folded, attn_fwd_jvp,
    attn_bwd_jvp): its forward runs the op; differentiating it again, in either mode, is
    third order, through the op's closed-form twin. The forward's parameters are the op's
    own arguments, by name (from its schema)."""
    parameters = [inspect.Parameter(argument.name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                  for argument in op_overload.default._schema.arguments]
    op_name = op_overload.default._schema.name.split("::")[1]
    record_name = f"bob_compile::{op_name}"

    def forward(*args):     # the op looked up per call, as in the other Functions (tests count)
        return _run(getattr(op, op_name), call, record_name, args)
    forward.__signature__ = inspect.Signature(parameters)
    forward.__qualname__ = f"{name}.forward"
    return type(name, (_Fused,), {
        "__doc__": doc, "__module__": __name__, "generate_vmap_rule": True,
        "forward": staticmethod(forward),
        "setup_context": staticmethod(lambda ctx, inputs, output: _save_all(ctx, inputs)),
        "backward": staticmethod(lambda ctx, *grads: _third_order(twin, ctx, grads, like)),
        "jvp": staticmethod(lambda ctx, *tangents: _third_order_jvp(twin, ctx, tangents, like)),
    })


AttnBobFn = _derivative_op_function(
    "AttnBobFn", op.attn_bob, ops.call_bob, _bob_twin,
    _like_positions(op.attn_bob.default, dlse="lse", gdq="q", gdk="k", gdv="v"),
    "attn_bob, the second-order kernel (chain form).")
AttnBobFoldedFn = _derivative_op_function(
    "AttnBobFoldedFn", op.attn_bob_folded, ops.call_bob_folded, _bob_folded_twin,
    _like_positions(op.attn_bob_folded.default, dlse="lse", gdq="q", gdk="k", gdv="v",
                    dq="q"),
    "attn_bob_folded, the second-order kernel of the folded form (its twin,\n"
    "reference.bob_folded, is differentiable in o and lse as well).")
AttnFwdJvpFn = _derivative_op_function(
    "AttnFwdJvpFn", op.attn_fwd_jvp, ops.call_forward_jvp, _forward_jvp_twin,
    _like_positions(op.attn_fwd_jvp.default, tq="q", tk="k", tv="v"),
    "attn_fwd_jvp, the forward's tangents.")
AttnBwdJvpFn = _derivative_op_function(
    "AttnBwdJvpFn", op.attn_bwd_jvp, ops.call_backward_jvp, _backward_jvp_twin,
    _like_positions(op.attn_bwd_jvp.default, dlse="lse", tq="q", tk="k", tv="v", to="o",
                    tlse="lse", tdo="do", tdlse="lse"),
    "attn_bwd_jvp, the first backward's tangents.")


# ----------------------------------------------------------------------------- a learned bias
# An additive mask that requires grad is an input of every derivative: the first backward
# returns its cotangent dS (attn_bwd_bias), the second order takes that cotangent's
# cotangent and returns the mask's (attn_bob_folded_bias, the folded form: o and lse reach
# the backward detached in effect, their cotangents folded into those of q, k, v and the
# bias). Forward mode and third order run the closed-form twins.
def _bias_twin_jvp(twin, primals, tangents, constants):
    pushed = tuple(torch.zeros_like(p) if t is None else t for t, p in zip(tangents, primals))
    return torch.func.jvp(lambda *a: twin(*a, *constants), primals, pushed)[1]


class BiasAttnFn(torch.autograd.Function):
    """attn_fwd with a learned bias as its mask; outputs (o, lse). Its backward returns the
    bias's cotangent too (BiasAttnBwdFn)."""
    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, bias, scale, causal, dropout_p, seed, softcap):
        return op.attn_fwd(q, k, v, bias, scale, causal, dropout_p, seed, softcap)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, bias, scale, causal, dropout_p, seed, softcap = inputs
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse, bias, seed)
        if _forward_mode_possible():
            ctx.save_for_forward(q, k, v, bias, seed)
        ctx.constants = (scale, causal, dropout_p)
        ctx.softcap = softcap
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, do, dlse):
        if do is None and dlse is None:
            return (None,) * 9
        q, k, v, o, lse, bias, seed = ctx.saved_tensors
        grads = BiasAttnBwdFn.apply(q, k, v, o, lse, _zeros_if_none(do, o), dlse, bias,
                                    *ctx.constants, seed, ctx.softcap)
        return (*grads, None, None, None, None, None)

    @staticmethod
    def jvp(ctx, tq, tk, tv, tbias, _scale, _causal, _dropout_p, _tseed, _softcap):
        q, k, v, bias, seed = ctx.saved_tensors
        return _bias_twin_jvp(_forward_twin, (q, k, v, bias), (tq, tk, tv, tbias),
                              (*ctx.constants, seed, ctx.softcap))


class BiasAttnBwdFn(torch.autograd.Function):
    """attn_bwd_bias: (dq, dk, dv, dbias). Its backward is attn_bob_folded_bias, which
    returns nothing for o and lse (their cotangents are folded into the others: o and lse
    are always BiasAttnFn's outputs for the same inputs); a backward that may itself be
    differentiated (third order) runs the closed form on o and lse recomputed from the
    inputs instead."""
    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, o, lse, do, dlse, bias, scale, causal, dropout_p, seed, softcap):
        return op.attn_bwd_bias(q, k, v, o, lse, do, dlse, bias, scale, causal, dropout_p, seed,
                                softcap)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, o, lse, do, dlse, bias, scale, causal, dropout_p, seed, softcap = inputs
        ctx.has_dlse = dlse is not None
        ctx.save_for_backward(q, k, v, o, lse, do, dlse, bias, seed)
        if _forward_mode_possible():
            ctx.save_for_forward(q, k, v, o, lse, do, dlse, bias, seed)
        ctx.constants = (scale, causal, dropout_p)
        ctx.softcap = softcap
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, gdq, gdk, gdv, gdbias):
        if gdq is None and gdk is None and gdv is None and gdbias is None:
            return (None,) * 13
        q, k, v, o, lse, do, dlse, bias, seed = ctx.saved_tensors
        constants = (*ctx.constants, seed, ctx.softcap)
        if torch.is_grad_enabled():
            o, lse = _forward_twin(q, k, v, bias, *constants)
            outs = _bob_folded_bias_twin(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, gdbias, bias,
                                         *constants)
        else:
            outs = op.attn_bob_folded_bias(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, gdbias,
                                           bias, *constants)
        gq, gk, gv, gdo, gdlse, gbias = outs
        return (gq, gk, gv, None, None, gdo, gdlse if ctx.has_dlse else None, gbias,
                None, None, None, None, None)

    @staticmethod
    def jvp(ctx, tq, tk, tv, to, tlse, tdo, tdlse, tbias, _scale, _causal, _dropout_p,
            _tseed, _softcap):
        q, k, v, o, lse, do, dlse, bias, seed = ctx.saved_tensors
        dlse = _zeros_if_none(dlse, lse)
        return _bias_twin_jvp(_backward_bias_twin, (q, k, v, o, lse, do, dlse, bias),
                              (tq, tk, tv, to, tlse, tdo, tdlse, tbias),
                              (*ctx.constants, seed, ctx.softcap))


_backward_bias_twin = _canonical_twin(ops.call_backward_bias)
_bob_folded_bias_twin = _canonical_twin(ops.call_bob_folded_bias)
