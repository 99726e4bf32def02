"""Compiled training graphs that stay differentiable at every order.

Stock torch.compile runs a training graph as one autograd node, AOTAutograd's
CompiledFunction: a compiled forward saves residuals, a compiled backward consumes them.
Its backward is opaque, so a `create_graph=True` backward (a Hessian-vector product, MAML)
either raises or, when no saved tensor requires grad, silently drops the second-order
terms. Here:

    forward    ForwardFn: the compiled forward of AOTAutograd's pair (pairs.py), as stock
               compile runs it; it also keeps the primals and the random draws.
    backward   ForwardFn.backward without create_graph: the compiled backward, freeing the
               residuals as it goes: first order costs what stock compile costs.
               With create_graph: SecondOrderFn, whose forward runs the forward half of
               the graph's VJP pair (second_order.py: the VJP taken by autograd's own
               formulas, compiled on first use); it returns the gradients and saves what
               their derivative reads.
    2nd order  SecondOrderFn.backward: the backward half of that pair (compiled), giving
               cotangents of the primals and of the incoming cotangents directly.
    3rd order  the VJP run eagerly and differentiated by autograd (exact at every order).

Batched cotangents (legacy vmap: `is_grads_batched=True`, `vectorize=True`) cannot enter
compiled code; those backwards run the VJP eagerly at every order. A VJP pair that does not
compile does the same, with a log line and a line in the graph's report.
docs/routing.md has the why of each piece.
"""
import contextlib
import functools
import logging

import torch

from .._compat import saved_tensor_hooks_active
from ..kernels import settings as kernel_settings
from .pairs import as_traced
from .second_order import ExactBeyondSecondOrder, GraphVjp, compile_graph_vjp, eager_vjp

log = logging.getLogger("bob_compile.training")

_is_legacy_batched = torch._C._functorch.is_legacy_batchedtensor


def _not_traced(fn):
    """Run `fn` as Python, never traced by Dynamo: the runtime itself, which the autograd
    engine may call from inside a compiled frame (autograd.grad in a compiled meta-loss)."""
    return torch.compiler.disable(fn, recursive=True)


def _under_kernel_choices(fn):
    """Run an autograd.Function method of the runtime under its graph's kernel choices (the
    compile's options): forwards get the graph as first argument, backwards find it on
    ctx, and run on the autograd engine's thread, where no choice of the caller's holds."""
    @functools.wraps(fn)
    def run(ctx, *args):
        graph = getattr(ctx, "graph", None) or args[0]
        return kernel_settings.run_with(graph.kernel_choices, fn, ctx, *args)
    return run


@contextlib.contextmanager
def _named_errors(graph, what):
    """Errors raised in a compiled order name flashbob, the graph and the way around."""
    try:
        yield
    except Exception as e:
        if hasattr(e, "add_note"):
            e.add_note(f"flashbob: raised while running {what} of {graph.name}. "
                       f"torch.compile(..., backend='flashbob', options={{'compiler': 'eager'}}) "
                       f"runs the graph eagerly (exact at every order); please report this.")
        raise


def _batched(tensors):
    return any(isinstance(t, torch.Tensor) and _is_legacy_batched(t) for t in tensors)


class TrainingGraph:
    """The compiled runtime of one Dynamo training graph: call it like the graph.

    pair: the graph's first-order AOTAutograd pair; graph_module: the Dynamo graph after
    the rewrite, of which the second order takes the VJP. The VJP pair compiles on first
    use, for the requires-grad pattern and shapes met then; a graph Dynamo traced with
    dynamic shapes compiles it at once instead, symbolically, for every floating input
    requiring grad (a superset), so that a new shape never compiles again (guards it adds
    must reach Dynamo now)."""

    def __init__(self, pair, graph_module, compiler, config_patches, name, on_compile=None,
                 on_eager=None, kernel_choices=None, on_fakes=None, recompute_residuals=False):
        self.pair, self.graph_module = pair, graph_module
        self.compiler, self.config_patches, self.name = compiler, config_patches, name
        self.on_fakes = on_fakes     # the graph as traced: what a call on fake tensors runs
        # a create_graph backward frees the residuals even where the cotangents require
        # grad (a region of a cut graph: backend.RECOMPUTE_REGION_RESIDUALS)
        self.recompute_residuals = recompute_residuals
        self.on_compile = on_compile or (lambda what, pair: None)
        self.on_eager = on_eager or (lambda what, reason: None)
        self.kernel_choices = kernel_choices   # the compile's options, or None (kernels/settings.py)
        self._vjps = {}              # wanted primal indices -> GraphVjp
        self._vjp_pairs = {}         # (wanted, requires-grad mask, signature) -> pair or None
        self.num_primals = len(pair.primal_nodes())
        self.dynamic = any(is_symbolic(p.meta.get("val")) for p in pair.primal_nodes())
        if self.dynamic:
            examples = self._symbolic_examples()
            wanted = tuple(i for i, x in enumerate(examples[:self.num_primals]) if _requires_grad(x))
            self._vjp_pairs[None] = (wanted, self._compile(wanted, examples))

    @_not_traced
    def __call__(self, *args):
        if self.on_fakes is not None and under_fake_mode():
            # compiled kernels cannot read fake tensors
            return list(self.on_fakes(*args))
        return list(ForwardFn.apply(self, *args))

    # ------------------------------------------------------------------ the second order
    def input_gradients(self, primals, draws, output_grads, output_meta, needed):
        """The gradients of the primals for cotangents of the outputs, in a backward that
        is differentiated later (create_graph) or runs on batched cotangents."""
        wanted = tuple(i for i, n in enumerate(needed) if n)
        tangents = [output_grads[i] if output_grads[i] is not None else
                    torch.zeros(output_meta[i][0], dtype=output_meta[i][1], device=output_meta[i][2])
                    for i in self.pair.tangent_outputs]
        create_graph = torch.is_grad_enabled()
        inputs = [*primals, *draws, *tangents]
        vjp_pair = None
        if create_graph and not _batched(tangents):
            wanted_traced, vjp_pair = self._vjp_pair(wanted, inputs)
        if vjp_pair is None:
            grads = eager_vjp(self._vjp(wanted), primals, draws, tangents, create_graph)
            wanted_traced = wanted
        else:
            grads = SecondOrderFn.apply(self, vjp_pair, wanted_traced, *inputs)
        result = [None] * len(primals)
        for i, g in zip(wanted_traced, grads):
            if needed[i]:
                result[i] = g
        return result

    def _vjp(self, wanted):
        if wanted not in self._vjps:
            self._vjps[wanted] = GraphVjp(self.graph_module, self.num_primals,
                                          self.pair.random_kinds, self.pair.tangent_outputs,
                                          wanted)
        return self._vjps[wanted]

    def _vjp_pair(self, wanted, inputs):
        """(the primals the pair differentiates, the compiled VJP pair or None)."""
        if self.dynamic:
            return self._vjp_pairs[None]
        mask = tuple(_requires_grad(x) for x in inputs)
        key = (wanted, mask, _signature(inputs))
        if key not in self._vjp_pairs:
            examples = [x.detach().requires_grad_(m) if isinstance(x, torch.Tensor) else x
                        for x, m in zip(inputs, mask)]
            self._vjp_pairs[key] = (wanted, self._compile(wanted, examples))
        return self._vjp_pairs[key]

    def _compile(self, wanted, example_inputs):
        name = f"the second order of {self.name}"
        log.info("flashbob: compiling %s", name)
        try:
            pair = compile_graph_vjp(self._vjp(wanted), example_inputs, self.compiler,
                                     self.config_patches, name, self.pair.static_inputs)
        except Exception as e:       # never a crash: the same function, run eagerly
            if isinstance(e, torch._dynamo.exc.RestartAnalysis):
                raise
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.warning("flashbob: %s runs eagerly (exact, unfused outside attention): %s",
                        name, reason)
            self.on_eager("second_order", reason)
            return None
        pair.input_layouts = [_layout(x) for x in example_inputs]
        self.on_compile("second_order", pair)
        return pair

    def eager_second_order(self, wanted, inputs, vectors, create_graph):
        """The VJP of the VJP (second order) eagerly, differentiable again if create_graph:
        the third order, or cotangents batched by legacy vmap."""
        n, d = self.num_primals, len(self.pair.random_kinds)
        with torch.enable_grad(), ExactBeyondSecondOrder():
            inputs = [x.view_as(x) if _requires_grad(x) else x for x in inputs]
            primals, draws, tangents = inputs[:n], inputs[n:n + d], inputs[n + d:]
            grads = eager_vjp(self._vjp(wanted), primals, draws, tangents, create_graph=True)
            pairs = [(g, v) for g, v in zip(grads, vectors) if v is not None and g.requires_grad]
            targets = [i for i, x in enumerate(inputs) if _requires_grad(x)]
            results = torch.autograd.grad([g for g, _ in pairs], [inputs[i] for i in targets],
                                          [v for _, v in pairs], create_graph=create_graph,
                                          allow_unused=True) if pairs else [None] * len(targets)
        out = [None] * len(inputs)
        for i, g in zip(targets, results):
            out[i] = g
        return out

    def _symbolic_examples(self):
        """The VJP's inputs as the forward and backward graphs traced them (fake, symbolic),
        every floating primal and tangent requiring grad."""
        primals = [p.meta.get("val") for p in self.pair.primal_nodes()]
        outputs = self.pair.output_nodes()
        draws = [outputs[i].meta.get("val") for i in self.pair.random_index]
        tangents = [p.meta.get("val") for p in self.pair.backward_graph.graph.find_nodes(op="placeholder")
                    if p.name.startswith("tangents")]

        def example(v, grad):
            if not isinstance(v, torch.Tensor):
                return v
            return v.detach().requires_grad_(grad and v.is_floating_point())
        return ([example(v, True) for v in primals] + [example(v, False) for v in draws]
                + [example(v, True) for v in tangents])


def under_fake_mode():
    """Whether a FakeTensorMode is active: DDPOptimizer runs each compiled piece of a split
    graph under one, for the example inputs of the next piece."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def _requires_grad(x):
    return isinstance(x, torch.Tensor) and x.requires_grad


def is_symbolic(value):
    return isinstance(value, (torch.SymInt, torch.SymFloat)) or (
        isinstance(value, torch.Tensor) and value._has_symbolic_sizes_strides)


def _signature(values):
    return tuple((v.shape, v.stride(), v.dtype, v.device) if isinstance(v, torch.Tensor) else v
                 for v in values)


def _layout(value):
    if not isinstance(value, torch.Tensor):
        return None
    if value._has_symbolic_sizes_strides:
        return torch._prims_common.suggest_memory_format(value)
    return tuple(value.stride())


def _meta(t):
    return (t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else None


# ----------------------------------------------------------------------------- autograd
class ForwardFn(torch.autograd.Function):
    """Level 1: the compiled forward; returns the graph's outputs."""

    @staticmethod
    @_not_traced
    @_under_kernel_choices
    def forward(ctx, graph, *primals):
        pair = graph.pair
        with _named_errors(graph, "the compiled forward"):
            values = pair.forward(primals)
        ctx.draws = [values[i] for i in pair.random_index]
        values = values[:len(values) - pair.num_appended]
        outputs = values[:pair.num_outputs]
        residual_index = [i for i in range(pair.num_outputs, len(values))
                          if i not in pair.saved_primals and i not in pair.saved_outputs]
        ctx.graph = graph
        ctx.non_tensor_primals = [None if isinstance(p, torch.Tensor) else p for p in primals]
        # only the outputs' metadata is read later (zeros for missing cotangents); the
        # residuals, hundreds of them, need none: this runs on every step
        ctx.output_meta = [_meta(v) for v in outputs]
        ctx.num_values = len(values)
        ctx.residual_index = residual_index
        ctx.non_tensor_values = {i: values[i] for i in residual_index
                                 if not isinstance(values[i], torch.Tensor)}
        output_tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
        residuals = [values[i] for i in residual_index if isinstance(values[i], torch.Tensor)]
        returned = _returned(pair, outputs)
        ctx.mark_non_differentiable(*[
            t for i, t in enumerate(returned) if isinstance(t, torch.Tensor) and (
                not t.is_floating_point() or not pair.differentiable_outputs[i])])
        # The residuals are held apart (a Residuals box) unless saved-tensor hooks are
        # active (save_on_cpu, non-reentrant checkpointing: they must see them), so that a
        # create_graph backward, which never reads them, can free them (Residuals).
        ctx.residuals = None if saved_tensor_hooks_active() else Residuals(residuals)
        saved_residuals = residuals if ctx.residuals is None else []
        ctx.save_for_backward(*output_tensors, *saved_residuals,
                              *[p if isinstance(p, torch.Tensor) else None for p in primals])
        ctx.num_kept_tensors = len(output_tensors) + len(saved_residuals)
        ctx.set_materialize_grads(False)
        return returned

    @staticmethod
    @_not_traced
    @_under_kernel_choices
    def backward(ctx, *output_grads):
        graph, pair = ctx.graph, ctx.graph.pair
        if not torch.is_grad_enabled() and not _batched(output_grads):
            # plain first order: what stock compile runs, freeing memory as it does
            inputs = _first_order_inputs(ctx, graph, pair, output_grads)
            with _named_errors(graph, "the compiled backward"):
                if pair.donates and _keeps_graph():
                    # retain_graph=True: the saved values must survive this backward, which the
                    # compiled one (donating their memory) would overwrite; stock compile raises
                    # here, we run the same backward graph eagerly instead
                    with torch.no_grad():
                        return (None, *pair.backward_graph(*inputs))
                return (None, *pair.backward(inputs))
        # create_graph, or batched cotangents: the graph's VJP, which recomputes what it reads.
        # The residuals go, unless this node's first-order backward may still come in the next
        # backward: cotangents that require grad (a nonlinear loss outside the graph, the
        # next graph of a split model) send their own derivative back through it, and it would
        # recompute the forward every step (which a region of a cut graph chooses to do).
        primals = _primals(ctx, ctx.saved_tensors)
        if ctx.residuals is not None and _recomputable(pair) and (
                graph.recompute_residuals
                or not any(g is not None and g.requires_grad for g in output_grads)):
            ctx.residuals.release()
        return (None, *graph.input_gradients(primals, ctx.draws, output_grads, ctx.output_meta,
                                             ctx.needs_input_grad[1:]))


def _recomputable(pair):
    """Whether the compiled forward, run again on the primals, gives the residuals it gave:
    not where it draws random numbers (a new draw), nor under CUDA graph trees (a second
    run of a recorded forward before its backward re-records the tree)."""
    return not pair.random_index and not pair.cuda_graphs


class Residuals:
    """The compiled forward's residuals, held by the node outside save_for_backward.

    A create_graph backward (Hessian-vector products, MAML) runs the graph's VJP pair, which
    recomputes the forward and keeps what the second order reads: the first-order residuals
    are then dead weight, and with save_for_backward they would live as long as the graph
    (create_graph retains it) — through the double backward, the step's peak. `release`
    drops them where the forward can recompute them (`_recomputable`) and the cotangents
    do not require grad; a later first-order backward of the same node (a gradient penalty's
    loss term, retain_graph) runs the compiled forward again first. Like a SavedVariable,
    an in-place change of a residual (one that is a view of a graph input, say) after the
    forward is an error."""

    def __init__(self, tensors):
        self.tensors = tensors
        self.versions = [t._version for t in tensors]
        self.released = False

    def get(self):
        for t, version in zip(self.tensors, self.versions):
            if t._version != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified "
                    f"by an inplace operation: a residual of a flashbob-compiled graph, of "
                    f"shape {tuple(t.shape)}, is at version {t._version}; expected version "
                    f"{version} instead.")
        return self.tensors

    def release(self):
        self.tensors, self.versions, self.released = [], [], True


def _returned(pair, outputs):
    """What a Function returns for a compiled half's outputs. A CUDA graph tree's replay
    returns the same tensor objects on every step (its cached outputs), and autograd hangs
    the step's node on the tensor it is given: the node, with the values it saved (which a
    second order retains), would outlive the step in the tree's cache until the next step
    replaced it, where the recording step had freed them. The tree, finding them alive,
    recorded the next graph again on every step (expected-dead outputs alive). A fresh
    alias of each output takes the node instead and dies with the caller's reference."""
    if not pair.cuda_graphs:
        return tuple(outputs)
    return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in outputs)


def _keeps_graph():
    """Whether the running backward was asked for retain_graph=True."""
    return torch._C._autograd._get_current_graph_task_keep_graph()


def _primals(ctx, saved):
    """The primals, from the node's saved tensors (`saved`, read once by the caller)."""
    primal_tensors = saved[ctx.num_kept_tensors:]
    return [p if t is None else t for p, t in zip(ctx.non_tensor_primals, primal_tensors)]


def _unpack(ctx, pair):
    """(primals, the forward graph's output list) from what the forward saved."""
    saved = ctx.saved_tensors
    kept = saved[:ctx.num_kept_tensors]
    if ctx.residuals is not None:
        kept = (*kept, *ctx.residuals.get())
    primals = _primals(ctx, saved)
    return primals, _values(ctx, pair, kept, primals)


def _first_order_inputs(ctx, graph, pair, output_grads):
    """The compiled backward's input list, as its only holder of the saved values.

    Like AOTAutograd's own runtime, release the node's saved tensors first (unless
    retain_graph=True keeps them): the compiled backward then frees each residual after its
    last use, and, compiled with donated buffers, writes into residuals it is done with.
    Together: a GPT-2-small step (B=8, T=1024) peaks at stock compile's 4.19 GiB, not 4.88.
    Residuals a create_graph backward released are recomputed (Residuals)."""
    if ctx.residuals is not None and ctx.residuals.released:
        primals = _primals(ctx, ctx.saved_tensors)
        with _named_errors(graph, "the compiled forward (recomputing its residuals)"):
            values = pair.forward(list(primals))
        values = list(values[:len(values) - pair.num_appended])
        for i, p in pair.saved_primals.items():
            values[i] = primals[p]
    else:
        primals, values = _unpack(ctx, pair)
    ctx.maybe_clear_saved_tensors()
    if ctx.residuals is not None and not _keeps_graph():
        ctx.residuals.release()
    saved = [values[i] for i in pair.saved_order]
    del primals, values
    return pair.backward_inputs(saved, output_grads, ctx.output_meta)


def _values(ctx, pair, kept_tensors, primals):
    """The forward graph's output list, rebuilt from what the forward returned/saved."""
    kept = iter(kept_tensors)
    values = [None] * ctx.num_values
    for i in range(pair.num_outputs):
        values[i] = next(kept) if ctx.output_meta[i] is not None else None
    for i in ctx.residual_index:
        values[i] = ctx.non_tensor_values[i] if i in ctx.non_tensor_values else next(kept)
    for i, p in pair.saved_primals.items():
        values[i] = primals[p]
    for i, o in pair.saved_outputs.items():
        values[i] = values[o]
    return values


class SecondOrderFn(torch.autograd.Function):
    """Level 2: the graph's VJP, compiled; differentiable once more by its compiled
    backward, and beyond that eagerly."""

    @staticmethod
    @_not_traced
    @_under_kernel_choices
    def forward(ctx, graph, pair, wanted, *inputs):
        ctx.graph, ctx.pair, ctx.wanted = graph, pair, wanted
        traced = [as_traced(x, layout) if isinstance(x, torch.Tensor) else x
                  for x, layout in zip(inputs, pair.input_layouts)]
        # An input saved as-is is handed to the backward as the input itself, as ForwardFn
        # does: under CUDA graphs the forward's output for it is a tensor of the graph's own,
        # at an address of its own per recording, and the backward, which takes it for
        # static, recorded itself again for every new batch. (Taken now: the boxed forward
        # empties the list it is given.)
        saved_inputs = {p: traced[p] for p in pair.saved_primals.values()}
        with _named_errors(graph, "the compiled second order (forward half)"):
            values = pair.forward(traced)
        del traced
        # Only what the double backward reads, never the outputs themselves: an output kept
        # on its own node's ctx is a reference cycle autograd never frees.
        ctx.second_order_saved = [saved_inputs[pair.saved_primals[i]] if i in pair.saved_primals
                                  else values[i] for i in pair.saved_order]
        ctx.output_meta = [_meta(v) for v in values[:pair.num_outputs]]
        ctx.non_tensor_inputs = [None if isinstance(x, torch.Tensor) else x for x in inputs]
        ctx.save_for_backward(*[x if isinstance(x, torch.Tensor) else None for x in inputs])
        ctx.set_materialize_grads(False)
        return _returned(pair, values[:pair.num_outputs])

    @staticmethod
    @_not_traced
    @_under_kernel_choices
    def backward(ctx, *vectors):
        inputs = [x if t is None else t for x, t in zip(ctx.non_tensor_inputs, ctx.saved_tensors)]
        if torch.is_grad_enabled() or _batched(vectors):
            # third order, or batched cotangents: exact, eager, differentiable again
            grads = ctx.graph.eager_second_order(ctx.wanted, inputs, vectors,
                                                 create_graph=torch.is_grad_enabled())
            return (None, None, None, *grads)
        pair, saved = ctx.pair, ctx.second_order_saved
        if not _keeps_graph():
            # the backward half's list then holds the only reference to each saved value, and
            # frees it after its last use (as the first order's does)
            ctx.second_order_saved = None
        inputs = pair.backward_inputs(saved, vectors, ctx.output_meta)
        del saved
        with _named_errors(ctx.graph, "the compiled second order (backward half)"):
            grads = pair.backward(inputs)
        return (None, None, None, *grads)
