"""AOTAutograd pairs: a graph traced into a forward and a backward, both compiled, and
called by us rather than by AOTAutograd's runtime (bob_compile/training/runtime.py).

`compile_pair` runs AOTAutograd with inductor's partition and decompositions and captures
both halves before and after code generation. Only graphs that AOTAutograd runs without
its wrappers for input mutations, outputs that alias inputs or each other, tensor
subclasses, duplicated inputs or RNG state qualify (NotSupported says why otherwise);
aliased outputs are first retried as copies.
"""
import contextlib
import copy
import dataclasses
import logging
import time
from typing import Callable

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .. import _compat
from ..static_inputs import uses_cuda_graphs
from . import pair_cache
from .draws import UnreplayableDraw, find_draws

log = logging.getLogger("bob_compile")


class NotSupported(Exception):
    """This graph needs a part of AOTAutograd's runtime that we do not replicate."""


@dataclasses.dataclass
class CompiledPair:
    """A graph traced by AOTAutograd into a forward and a backward, both compiled.

    forward(list of primals) -> [*outputs, *saved values]; backward(list) -> one gradient
    (or None) per primal, taking [*saved values in `saved_order`, *tangents]."""
    forward: Callable
    backward: Callable
    forward_graph: fx.GraphModule           # aten level, before code generation
    backward_graph: fx.GraphModule
    num_outputs: int
    saved_order: list                       # forward output index of each saved backward input
    saved_primals: dict                     # forward output index -> primal index (saved as-is)
    tangent_outputs: list                   # output index of each tangent, in backward order
    tangent_layouts: list                   # per tangent: the strides (or memory format) traced
    differentiable_outputs: list            # per output: whether AOTAutograd gives it a gradient
    # forward output index of a saved value that is also an output -> that output's index
    saved_outputs: dict = dataclasses.field(default_factory=dict)
    random_index: tuple = ()                # forward output index of each random draw
    random_kinds: tuple = ()                # draws.draw_kind of each, in program order
    num_appended: int = 0                   # outputs appended (last) for draws not saved
    donates: bool = False                   # backward overwrites saved values (run it once)
    static_inputs: frozenset = frozenset()  # primal indices at fixed addresses (parameters)
    effect_tokens: int = 0                  # forward inputs (and outputs) ahead of the primals
    cuda_graphs: bool = False               # compiled under CUDA graph trees (see runtime)
    compile_seconds: float = 0.0            # AOTAutograd's tracing and both halves' compiles

    def primal_nodes(self):
        return self.forward_graph.graph.find_nodes(op="placeholder")[self.effect_tokens:]

    def output_nodes(self):
        """The forward graph's outputs as `forward` returns them (effect tokens dropped)."""
        return list(self.forward_graph.graph.output_node().args[0])[self.effect_tokens:]

    def saved_bytes(self):
        """Bytes of the values the forward keeps for the backward beyond its inputs and
        outputs (a primal or an output saved as-is, or a view of a primal, costs nothing
        more; views of one storage count once), at the traced shapes; None where a size is
        symbolic without a hint."""
        outputs = self.output_nodes()
        inputs = {_storage(node.meta.get("val")) for node in self.primal_nodes()}
        sizes = {}
        for index in self.saved_order:
            if index in self.saved_primals or index in self.saved_outputs:
                continue
            value = outputs[index].meta.get("val")
            if isinstance(value, torch.Tensor) and _storage(value) not in inputs:
                sizes[_storage(value)] = value.untyped_storage().nbytes()
        total = 0
        for size in sizes.values():
            if isinstance(size, torch.SymInt):
                size = size.node.hint
                if size is None:
                    return None
            total += int(size)
        return total

    def backward_inputs(self, saved, cotangents, output_meta):
        """The backward's inputs: the saved values, then a tangent per differentiable output
        (its cotangent, zeros where that is None) with the layout the backward was traced for.
        cotangents and output_meta (shape, dtype, device) are indexed by output."""
        tangents = [torch.zeros(output_meta[i][0], dtype=output_meta[i][1],
                                device=output_meta[i][2]) if cotangents[i] is None else cotangents[i]
                    for i in self.tangent_outputs]
        return list(saved) + [as_traced(t, layout) for t, layout in zip(tangents, self.tangent_layouts)]


def _storage(value):
    """An identity of a (fake) tensor's storage, shared by its views; None for non-tensors."""
    return value.untyped_storage()._cdata if isinstance(value, torch.Tensor) else None


def compile_pair(gm, example_inputs, compiler, config_patches=(), what="graph", nested=True,
                 donate=False, static_inputs=None):
    """Trace `gm` with AOTAutograd (the partition inductor uses) and compile both halves
    with `compiler` ("inductor" or "aot_eager"). `nested`: a graph derived from the one
    Dynamo handed the backend (see _tracing_context). `donate`: the compiled backward may
    write into the memory of saved values it no longer needs (AOTAutograd's donated
    buffers), so it must run at most once per forward (`CompiledPair.donates`).
    `static_inputs`: indices of the inputs at fixed addresses (CUDA graphs record them in
    place instead of copying them in); None: those Dynamo marked in `gm` (see
    `_static_input_marks`). Raises NotSupported."""
    if static_inputs is None:
        static_inputs = _static_input_marks(gm)
    args = (compiler, config_patches, what, nested, donate, frozenset(static_inputs))
    _clone_outputs(gm, _outputs_aliasing_inputs(gm))
    start = time.perf_counter()
    try:
        pair = _compile_pair(gm, example_inputs, *args)
    except _AliasedOutputs as aliased:
        # Outputs that are inputs or views AOTAutograd would rebuild at run time through its
        # view-replay wrappers, which we do not replicate: return copies instead (one copy
        # of that output; inductor usually writes it from the kernel that produces it).
        _clone_outputs(gm, aliased.indices)
        pair = _compile_pair(gm, example_inputs, *args)
    pair.compile_seconds = time.perf_counter() - start
    pair.cuda_graphs = uses_cuda_graphs(config_patches)
    return pair


def _static_input_marks(gm):
    """Indices of the inputs Dynamo marked as static (parameters and buffers; see
    bob_compile/static_inputs.py). AOTAutograd reads these marks only from Dynamo's own
    graph module, whose Dynamo attributes a deep copy loses: it would call every input of
    our copy dynamic, and CUDA graphs would copy every parameter in on each call."""
    return frozenset(i for i, node in enumerate(gm.graph.find_nodes(op="placeholder"))
                     if node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type"))


def _backward_static_inputs(backward_graph, forward_graph, static_inputs, tokens):
    """The backward's inputs at fixed addresses: static primals (parameters) and views of
    them that the forward saved. Not a saved value the forward computed: under CUDA graphs
    it is an output of the forward's recording, which the graph tree recognizes as its own
    and checks by itself; called static as well, any that the tree does not own (a forward
    replayed on another path, run eagerly) would make it record the backward again for
    each new address, without limit. Not a primal that is not static either: ForwardFn
    hands the backward the caller's tensor itself (a batch, MAML's fast weights)."""
    primals = forward_graph.graph.find_nodes(op="placeholder")[tokens:]
    primal_index = {node.name: i for i, node in enumerate(primals)}
    forward_nodes = {node.name: node for node in forward_graph.graph.nodes}

    def is_static(node):
        source = _viewed_base(forward_nodes.get(node.name))
        return source is not None and primal_index.get(source.name) in static_inputs
    return [j for j, node in enumerate(backward_graph.graph.find_nodes(op="placeholder"))
            if not node.name.startswith("tangents") and is_static(node)]


def _viewed_base(node):
    """The node whose memory `node` views, following view ops (those whose schema says the
    result aliases an argument, read-only), or `node` itself; None for None."""
    while node is not None and node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        result = schema.returns[0].alias_info if schema is not None and schema.returns else None
        if result is None or result.is_write:
            break
        base = next((arg for a, arg in zip(schema.arguments, node.args)
                     if a.alias_info is not None and not a.alias_info.is_write), None)
        if not isinstance(base, fx.Node):
            break
        node = base
    return node


class _AliasedOutputs(Exception):
    def __init__(self, indices):
        super().__init__(f"outputs {indices} alias inputs or other outputs")
        self.indices = indices


def _compile_pair(gm, example_inputs, compiler, config_patches, what, nested, donate,
                  static_inputs):
    captured, halves = {}, {}

    def capture(kind, inner, reports_strides):
        def compile_half(graph, inputs, **kwargs):
            is_backward = kwargs.get("is_backward", kind == "backward")
            if kwargs.get("is_inference"):
                raise NotSupported(f"AOTAutograd traced {what} for inference: no input "
                                   f"requires grad")
            key = "backward" if is_backward else "forward"
            if key == "forward":
                context = torch._guards.TracingContext.try_get()
                captured["metadata"] = meta = getattr(context, "fw_metadata", None)
                _check_simple(meta, what)
                captured["random"] = _return_random_values(graph, meta, what, reports_strides)
                tokens = _compat.effect_tokens(meta)[0]
                static = [tokens + i for i in sorted(static_inputs)]
            else:
                static = _backward_static_inputs(graph, captured["forward"], static_inputs,
                                                 _compat.effect_tokens(captured["metadata"])[0])
            if "static_input_idxs" in kwargs:      # inductor's: what CUDA graphs record in place
                kwargs["static_input_idxs"] = static
            # outside the fake mode AOTAutograd compiles under: a tensor constant of the
            # graph (Mistral's sliding window as a 0-d tensor) would otherwise be copied onto
            # the meta device and fail
            with unset_fake_temporarily():
                captured[key] = copy.deepcopy(graph)
            halves[key] = (captured[key], list(inputs), dict(kwargs))
            compiled = inner(graph, inputs, **kwargs)
            captured[key + "_compiled"] = compiled
            return compiled
        return compile_half

    # The backward must compile now (we call it ourselves); it reuses the memory of saved
    # tensors only where asked (see ForwardFn.backward for when that is safe). AOTAutograd's
    # cache stays out: a hit returns a compiled function without calling the compilers that
    # capture the graphs (a split graph's identical pieces under dynamic shapes hit it);
    # pair_cache.py keeps what they captured instead.
    # fallback_random (both compilers: the decompositions depend on it): aten's random ops,
    # not inductor's seeds-and-offsets form, whose draws a replay could not be handed
    # (draws.py)
    digest = _cache_key(gm, example_inputs, compiler, config_patches, nested, donate,
                        static_inputs)
    context, ignore_shape_env = _tracing_context(example_inputs, nested)
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True,
                                       donated_buffer=donate, enable_autograd_cache=False), \
            torch._inductor.config.patch(fallback_random=True), \
            torch.enable_grad(), \
            without_inductor_attention_fusion(), \
            context:
        cached = digest and pair_cache.load(digest, torch._guards.TracingContext.get().fake_mode)
        cached = cached and _compile_cached_halves(cached, captured, config_patches, digest,
                                                   what)
        if not cached:
            _trace(gm, example_inputs, compiler, config_patches, capture, ignore_shape_env)
        elif not nested:
            # what AOTAutograd's entry counts: DDPOptimizer tells from it that a piece of its
            # split graph was traced (and then reads the fw_metadata _compile_cached_halves
            # set), so a hit must look to it as a trace does
            torch._dynamo.utils.counters["aot_autograd"]["total"] += 1
    if "backward" not in captured:
        raise NotSupported(f"AOTAutograd produced no backward for {what}")
    pair = _pair(captured, len(example_inputs), what, static_inputs)
    if digest and not cached:
        torch._dynamo.utils.counters["bob_compile"]["pair_cache_miss"] += 1
        pair_cache.save(digest, halves, captured["metadata"], captured["random"])
    return pair


def _trace(gm, example_inputs, compiler, config_patches, capture, ignore_shape_env):
    """AOTAutograd over `gm`, its halves handed to `capture`'s compilers."""
    if compiler == "inductor":
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner
        compile_fx(copy.deepcopy(gm), example_inputs,
                   inner_compile=capture(None, compile_fx_inner, reports_strides=True),
                   config_patches={**dict(config_patches), "fallback_random": True},
                   **_compat.ignoring_shape_env(compile_fx, ignore_shape_env))
        return
    from functorch.compile import min_cut_rematerialization_partition
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor.decomposition import select_decomp_table

    def nop(graph, inputs, **kwargs):
        return graph
    # inductor's decompositions here too: the same graphs, and only primitive ops, whose
    # derivatives all exist (native_layer_norm_backward has none for `mean`)
    aot_module_simplified(copy.deepcopy(gm), example_inputs,
                          fw_compiler=capture("forward", nop, reports_strides=False),
                          bw_compiler=capture("backward", nop, reports_strides=False),
                          partition_fn=min_cut_rematerialization_partition,
                          decompositions=select_decomp_table(),
                          **_compat.ignoring_shape_env(aot_module_simplified, ignore_shape_env))


def _cache_key(gm, example_inputs, compiler, config_patches, nested, donate, static_inputs):
    """The pair's key in pair_cache, or None where it is not cached (another compiler than
    inductor, CUDA graphs or inductor's C++ wrapper, whose compile takes contexts that
    compile_fx alone sets up, or a graph the key cannot pin down)."""
    counters = torch._dynamo.utils.counters["bob_compile"]
    if compiler != "inductor" or not pair_cache.enabled() or \
            uses_cuda_graphs(config_patches) or torch._inductor.config.cpp_wrapper or \
            dict(config_patches).get("cpp_wrapper"):
        return None
    options = (compiler, sorted((k, repr(v)) for k, v in dict(config_patches).items()),
               nested, donate, sorted(static_inputs))
    try:
        return pair_cache.key(gm, example_inputs, options)
    except pair_cache.Uncacheable as e:
        counters["pair_cache_uncacheable"] += 1
        log.debug("flashbob: a pair is not cached: %s", e)
        return None


def _compile_cached_halves(cached, captured, config_patches, digest, what):
    """Both halves of a cached pair through inductor's compile, as compile_fx hands them;
    False (the entry dropped, nothing captured) where that fails."""
    from torch._inductor.compile_fx import compile_fx_inner
    halves, metadata, random = cached
    torch._guards.TracingContext.get().fw_metadata = metadata
    captured.update(metadata=metadata, random=random)
    try:
        with torch._inductor.config.patch({**dict(config_patches), "fallback_random": True}):
            for half in ("forward", "backward"):
                graph, inputs, kwargs = halves[half]
                with unset_fake_temporarily():
                    captured[half] = copy.deepcopy(graph)
                captured[half + "_compiled"] = compile_fx_inner(graph, inputs, **kwargs)
    except Exception as e:      # noqa: BLE001 (an entry that no longer compiles: trace again)
        log.warning("flashbob: a cached pair of %s failed to compile (%s: %s); tracing it "
                    "again", what, type(e).__name__, e)
        pair_cache.discard(digest)
        captured.clear()
        return False
    torch._dynamo.utils.counters["bob_compile"]["pair_cache_hit"] += 1
    return True


@contextlib.contextmanager
def without_inductor_attention_fusion():
    """Inductor's own attention fusion (fx_passes/fuse_attention.py) off while a training
    graph compiles: it turns a hand-written attention that the passes left untouched into
    PyTorch's fused SDPA ops, which have no double backward, so a second-order step through
    the graph would fail where the softmax as written is differentiable in every order.
    Its patterns all end in one params check, which this makes refuse."""
    try:
        from torch._inductor.fx_passes import fuse_attention
    except ImportError:
        yield
        return
    check = getattr(fuse_attention, "_sfdp_params_check", None)
    if check is None:
        yield
        return
    fuse_attention._sfdp_params_check = lambda match: False
    try:
        yield
    finally:
        fuse_attention._sfdp_params_check = check


def _donated_buffers(meta):
    return bool(getattr(meta, "bw_donated_idxs", None))


def _return_random_values(graph, meta, what, reports_strides):
    """Where the forward graph's outputs hold what its random ops drew (draws.py): a
    second-order step recomputes the forward and must see the same numbers. A draw the
    graph already saves for its backward (dropout's mask, mostly) is found there; any other
    is appended to the outputs, which costs its memory. Returns (the draws' output indices,
    their kinds, how many were appended).

    Appending is refused under inductor (NotSupported: the graph then runs eagerly,
    exact): AOTAutograd restrides the backward's inputs by the forward's output strides by
    position, and an appended output would be taken for a tangent's."""
    try:
        drawn, kinds = find_draws(graph)
    except UnreplayableDraw as e:
        raise NotSupported(str(e)) from None
    if not drawn:
        return (), (), 0
    output = graph.graph.output_node()
    outputs = list(output.args[0])
    first_saved = _compat.effect_tokens(meta)[0] + meta.num_forward
    saved = {n: i for i, n in reversed(list(enumerate(outputs))) if i >= first_saved}
    index, appended = [], []
    for value in drawn:
        if value in saved:
            index.append(saved[value])
            continue
        if reports_strides:
            raise NotSupported(f"{what} draws random numbers ({value.name}) that its "
                               f"backward does not save")
        index.append(len(outputs) + len(appended))
        appended.append(value)
    if appended:
        output.args = (tuple(outputs) + tuple(appended),)
        graph.recompile()
    return tuple(index), tuple(kinds), len(appended)


def _is_view(node):
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write
                                      for r in schema.returns)


def _outputs_aliasing_inputs(gm):
    """Indices of the outputs of an aten-level graph that are an input, a view of one (a
    forward graph returns the weights and their transposes it saves), or repeated: what
    AOTAutograd would report as aliased, found before tracing rather than after."""
    output = gm.graph.output_node().args[0]
    indices, seen = [], set()
    for i, value in enumerate(output):
        base = value
        while isinstance(base, fx.Node) and _is_view(base):
            base = base.args[0]
        is_tensor = isinstance(value, fx.Node) and isinstance(
            value.meta.get("val", value.meta.get("example_value")), torch.Tensor)
        if is_tensor and (value in seen or (isinstance(base, fx.Node) and base.op == "placeholder")):
            indices.append(i)
        seen.add(value)
    return indices


def _clone_outputs(gm, indices):
    if not indices:
        return
    output = gm.graph.output_node()
    values = list(output.args[0])
    aten = any(isinstance(n.target, torch._ops.OpOverload) for n in gm.graph.nodes)
    for i in indices:
        with gm.graph.inserting_before(output):
            clone = gm.graph.call_function(torch.ops.aten.clone.default if aten else torch.clone,
                                           (values[i],))
        clone.meta = {k: v for k, v in values[i].meta.items() if k in ("val", "example_value")}
        values[i] = clone
    output.args = (type(output.args[0])(values),)
    gm.recompile()


def _tracing_context(example_inputs, nested):
    """Dynamo's tracing context for the graph Dynamo handed us; a fresh one (on the same
    fake mode and shape environment) for graphs we derive from it, so that our compiles
    never overwrite what AOTAutograd published for Dynamo's graph. Returns it and whether
    AOTAutograd must ignore its shape environment (below)."""
    from torch._guards import TracingContext, detect_fake_mode, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    current = TracingContext.try_get()
    if current is not None and not nested:
        return contextlib.nullcontext(), False
    fake_mode = detect_fake_mode(example_inputs) or (current.fake_mode if current else None)
    if fake_mode is not None:
        return tracing(TracingContext(fake_mode)), False
    # real inputs (the second order's VJP, compiled at its first call): a fake mode of our
    # own. Its shape environment traces nothing symbolic (AOTAutograd told to ignore it: the
    # shapes stay static); it is there because inductor's FX graph cache bypasses any graph
    # compiled without one, and a new process would compile the VJP pair again
    return tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv()))), True


def _pair(captured, num_inputs, what, static_inputs):
    meta = captured["metadata"]
    forward_graph, backward_graph = captured["forward"], captured["backward"]
    tokens, backward_tokens = _compat.effect_tokens(meta)
    primals = [n for n in forward_graph.graph.nodes if n.op == "placeholder"][tokens:]
    if len(primals) != num_inputs:
        raise NotSupported(f"AOTAutograd deduplicated or added inputs of {what}")
    outputs = list(forward_graph.graph.output_node().args[0])[tokens:]
    num_outputs = meta.num_outputs
    # where each saved value is, among the residuals: not among the draws appended last
    # (dropout's mask is both), and not where the value is also a graph output
    index_of = {}
    random_index, random_kinds, num_appended = captured.get("random", ((), (), 0))
    random_index = tuple(i - tokens for i in random_index)
    for i in range(num_outputs, len(outputs) - num_appended):
        if isinstance(outputs[i], fx.Node):
            index_of.setdefault(outputs[i].name, i)
    saved_order, tangent_names, tangent_layouts = [], [], []
    backward_inputs = backward_graph.graph.find_nodes(op="placeholder")
    for p in backward_inputs[:len(backward_inputs) - backward_tokens]:
        if p.name.startswith("tangents"):
            tangent_names.append(p.name)
            tangent_layouts.append(_layout(p.meta.get("val")))
        elif p.name in index_of:
            saved_order.append(index_of[p.name])
        else:
            raise NotSupported(f"backward input {p.name} of {what} is not a saved forward value")
    tangent_outputs = [i for i, info in enumerate(meta.output_info)
                       if _compat.output_gets_tangent(info)]
    if len(tangent_outputs) != len(tangent_names):
        raise NotSupported(f"{what}: {len(tangent_names)} tangents for "
                           f"{len(tangent_outputs)} differentiable outputs")
    placeholder_index = {n: i for i, n in enumerate(primals)}
    saved_primals = {i: placeholder_index[n] for i, n in enumerate(outputs)
                     if i >= num_outputs and n in placeholder_index}
    # A value both returned and saved (an activation a piece of a split graph hands on, and
    # its own backward reads) is returned once: returned twice, autograd sends its gradient
    # to the saved copy, and a first-order backward would take the residual-VJP path.
    differentiable_outputs = [info.requires_grad for info in meta.output_info]
    first_output = {}
    for i, n in enumerate(outputs[:num_outputs]):
        if isinstance(n, fx.Node) and differentiable_outputs[i]:
            first_output.setdefault(n, i)
    saved_outputs = {i: first_output[n] for i, n in enumerate(outputs)
                     if i >= num_outputs and i not in saved_primals and n in first_output}
    return CompiledPair(
        forward=_with_effect_tokens(_boxed(captured["forward_compiled"]), leading=tokens),
        backward=_with_effect_tokens(_boxed(captured["backward_compiled"]), trailing=backward_tokens),
        forward_graph=forward_graph, backward_graph=backward_graph,
        num_outputs=num_outputs, saved_order=saved_order,
        saved_primals=saved_primals, tangent_outputs=tangent_outputs,
        tangent_layouts=tangent_layouts,
        differentiable_outputs=differentiable_outputs, saved_outputs=saved_outputs,
        random_index=random_index, random_kinds=random_kinds, num_appended=num_appended,
        donates=_donated_buffers(meta), static_inputs=static_inputs, effect_tokens=tokens)


def _layout(fake):
    """What a runtime tangent must look like: the strides AOTAutograd traced it with (they
    follow the output's), or under dynamic shapes its memory format."""
    if not isinstance(fake, torch.Tensor):
        return None
    if fake._has_symbolic_sizes_strides:
        return torch._prims_common.suggest_memory_format(fake)
    return tuple(fake.stride())


def as_traced(tangent, layout):
    """`tangent` with the layout the backward graph was traced for (a copy if needed)."""
    if isinstance(layout, torch.memory_format):
        return tangent.contiguous(memory_format=layout)
    if layout is None or tangent.stride() == layout:
        return tangent
    return torch.empty_strided(tangent.shape, layout, dtype=tangent.dtype,
                               device=tangent.device).copy_(tangent)


def _check_simple(meta, what):
    from torch._functorch._aot_autograd.schemas import OutputType, SubclassCreationMeta
    if meta is None:
        raise NotSupported(f"no AOTAutograd metadata for {what}")
    problems = []
    if meta.num_mutated_inp_runtime_indices:
        problems.append("it mutates inputs")
    # an unsafe_view_alias output views an intermediate that nothing else returns: AOTAutograd
    # itself hands it out as a fresh tensor
    fresh = (OutputType.non_alias, OutputType.unsafe_view_alias)
    aliased = [i for i, o in enumerate(meta.output_info) if o.output_type not in fresh]
    if aliased:
        raise _AliasedOutputs(aliased)
    if any(isinstance(m, SubclassCreationMeta) for m in meta.subclass_inp_meta):
        problems.append("it has tensor subclass inputs")
    if any(getattr(meta, name, None) for name in (
            "is_rng_op_functionalized", "num_graphsafe_rng_states",
            "num_opaque_objects_saved_for_bw")):
        problems.append("it carries RNG state or opaque objects")
    if problems:
        raise NotSupported(f"{what}: " + ", ".join(problems))


def _with_effect_tokens(call, leading=0, trailing=0):
    """`call` (a list -> outputs callable) taking and returning the effect tokens of its
    graph (_compat.effect_tokens), as AOTAutograd's runtime does: None in, dropped out. The
    list is extended in place, so that a boxed callee remains the only holder of its items."""
    if not (leading or trailing):
        return call

    def run(args):
        args = args if type(args) is list else list(args)
        args[:0] = [None] * leading
        args.extend([None] * trailing)
        outputs = call(args)
        return outputs[leading:len(outputs) - trailing]
    return run


def _boxed(compiled):
    """A list -> outputs callable, whatever calling convention the compiler returned.

    A boxed compiled function (inductor's) empties the list it is given and frees each
    input after its last use: a caller that keeps no other reference to an input gets its
    memory back during the call (the first-order backward relies on that)."""
    if getattr(compiled, "_boxed_call", False):
        return lambda args: compiled(args if type(args) is list else list(args))
    return lambda args: compiled(*args)
