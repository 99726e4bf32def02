"""The flashbob torch.compile backend.

    torch.compile(model, backend="flashbob")                       # via the entry point
    torch.compile(model, backend=bob_compile.backend.flashbob)     # without installed metadata

For each graph Dynamo captures:
1. rewrite: every supported attention site becomes bob_compile.attention, whose
   derivatives of every order are exact fused kernels (bob_compile/passes/);
2. route, so that every order of derivative stays correct (docs/routing.md):
   - "training": grad mode is on and an input requires grad, so the outputs may be
     differentiated with create_graph=True and then again (Hessian-vector products, MAML).
     Stock AOTAutograd refuses that double backward, or for MAML silently returns
     first-order gradients. training/ keeps AOTAutograd's partition and `compiler`'s
     code for the first order and compiles the graph's VJP, taken by autograd's own
     formulas, as a differentiable function for the second;
   - "eager": a training graph training/ cannot run (input mutations, say), or
     one that also differentiates itself: the rewritten graph runs eagerly, exact at
     every order;
   - "aot": the graph differentiates itself (torch.func.grad/jvp/vmap inside the compiled
     function) and nothing outside can differentiate it: AOTAutograd traces the op's
     derivatives into the graph and `compiler` (inductor) compiles all of it;
   - "inference": no gradient can flow: `compiler` compiles the rewritten graph, its
     attention as PyTorch's fused SDPA where that is the same function
     (bob_compile/passes/inference.py) unless kernel options ask for ours.
3. report and dump (dump.py), the compiled graphs of every order included.
A failure of the compiler on a training graph warns and runs the rewritten graph eagerly
(exact at every order); a failure of the passes warns and runs the untouched graph, its
SDPA and FlexAttention calls as math where gradients are on (PyTorch's fused kernels have
no second order, FlexAttention's silently none). Never a crash, never a wrong result
(options["fallback"]=False raises instead).
"""
import collections
import copy
import functools
import logging
import warnings

import torch
from torch import fx

from . import _compat, checkpointing, dump, static_inputs, training
from . import options as options_module
from .kernels import settings as kernel_settings
from .passes import GraphReport, rewrite_attention
from .passes.causal_mask import failing_guards
from .passes.flex_attention import materialize_block_masks
from .passes.inference import use_native_sdpa
from .passes.autograd_functions import differentiable_backwards
from .passes.sdpa_math import sdpa_calls_as_math
from .passes.report import compiled_text, compiled_text_name, count, counters  # noqa: F401  (counters: re-exported for users)
from .passes.report import restore as restore_counts, snapshot as snapshot_counts

log = logging.getLogger(__name__)
# checkpointed layers traced even where their forward sets Python state (checkpointing.py)
checkpointing.trace_checkpointed_side_effects()

# Reports of the last graphs compiled in this process, newest last.
recent_reports = collections.deque(maxlen=100)

# Node targets from these modules mean that the graph runs torch.func transforms itself.
_TRANSFORM_MODULES = ("torch._functorch", "torch._C._functorch")


def _first_line(text, limit=300):
    """An error's first line, cut to `limit` characters: inductor's errors carry whole IR
    dumps, which the report and the log keep."""
    line = text.split("\n", 1)[0]
    return line if len(line) <= limit and line == text else line[:limit] + " ..."


def flashbob(gm, example_inputs, *, mode=None, options=None):
    """The `torch_dynamo_backends` entry point: compile one Dynamo graph.

    mode: torch.compile's mode, passed on to inductor where inductor compiles.
    options: see bob_compile/options.py (unknown keys are an error)."""
    opts = options_module.parse(options, mode)
    report = GraphReport(compile_id=_compat.current_compile_id())
    before = dump.graph_text(gm)
    untouched = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    aot_calls = _aot_autograd_calls()
    counts_before = snapshot_counts()
    if opts.dump_dir:
        try:
            dump.make_folder(report, opts.dump_dir)
        except OSError as e:
            warnings.warn(f"flashbob could not create its dump folder in {opts.dump_dir!r}: {e}",
                          stacklevel=2)
    try:
        rewrite_attention(gm, example_inputs, report)
        if static_inputs.uses_cuda_graphs(opts.inductor_config):
            static_inputs.unmark_parameter_stand_ins(gm, example_inputs)
            materialize_block_masks(gm, report, "CUDA graphs")
        after = dump.graph_text(gm)
        report.route, report.route_reason = choose_route(gm, example_inputs, opts)
        if report.route == "aot":
            # its ops run inside the graph's own torch.func transforms, where resolving a
            # packed BlockMask (a vmap over the mask_mod) fails: materialized in the graph
            materialize_block_masks(gm, report, "the graph runs torch.func transforms")
        if report.route in ("training", "eager"):       # may be differentiated twice
            differentiable_backwards(gm, report)
        compiled = _compile(report, gm, example_inputs, opts)
        if report.guards:
            compiled = _with_guards(compiled, untouched.forward, report.guards)
    except torch._dynamo.exc.RestartAnalysis:
        # Dynamo's own control flow, not a failure: e.g. AOTAutograd's pass that turns
        # Python float scalars into tensors asks Dynamo to trace again with one specialized
        # (Gemma's embedding normalizer); Dynamo then calls this backend with the new graph.
        restore_counts(counts_before)
        raise
    except Exception as e:
        if not opts.fallback:
            raise
        report.error = f"{type(e).__name__}: {e}"
        report.route, report.route_reason = "untouched", "the backend failed on this graph"
        log.info("flashbob could not compile graph %s", report.compile_id, exc_info=True)
        warnings.warn(f"flashbob could not compile graph {report.compile_id} "
                      f"({_first_line(report.error)}); "
                      f"running it untouched, as backend='eager' would, its attention as "
                      f"math where gradients are on. Pass options={{'fallback': False}} to "
                      f"raise instead, and please report it.", stacklevel=2)
        compiled, after = _untouched_but_exact(untouched, report), before
    if report.route in ("untouched", "eager"):      # no AOTAutograd at run time
        _forget_aot_autograd_calls(aot_calls)
    count("graphs")
    count(f"route_{report.route}" if report.route != "untouched" else "fallback")
    recent_reports.append(report)
    try:
        dump.emit(report, before, after)
    except OSError as e:
        warnings.warn(f"flashbob could not write its dump to {opts.dump_dir!r}: {e}", stacklevel=2)
    return compiled


def _untouched_but_exact(untouched, report):
    """The graph as Dynamo gave it, for a fallback: where gradients are on (it may be
    differentiated twice), its SDPA and FlexAttention calls as PyTorch's math, whose
    derivatives of every order exist (PyTorch's fused SDPA kernels refuse a double
    backward; FlexAttention's backward is not differentiated again, silently)."""
    if not torch.is_grad_enabled():
        return untouched.forward
    try:
        as_math = fx.GraphModule(untouched, copy.deepcopy(untouched.graph))
        if sdpa_calls_as_math(as_math, report):
            report.route_reason += "; its attention runs as math (every order exact)"
            return as_math.forward
    except Exception:       # the untouched graph, then, as backend='eager' runs it
        log.info("flashbob could not turn graph %s's attention into math", report.compile_id,
                 exc_info=True)
    return untouched.forward


def _aot_autograd_calls():
    return torch._dynamo.utils.counters["aot_autograd"]["total"]


def _forget_aot_autograd_calls(since):
    """Undo the count of AOTAutograd runs a compile made and then dropped (a fallback to
    the graph run as written). DDPOptimizer reads that count to decide whether the piece it
    compiled went through AOTAutograd, and then requires the metadata AOTAutograd
    publishes, which a graph run as written never has."""
    torch._dynamo.utils.counters["aot_autograd"]["total"] = since


def register():
    """Make backend="flashbob" resolvable where the package's entry point is not installed
    (e.g. a source checkout on sys.path). Does nothing if the name already resolves:
    registering it twice makes the first compile fail with "duplicate name: flashbob"."""
    if "flashbob" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(flashbob, name="flashbob")


# ---------------------------------------------------------------------------- routing
def choose_route(gm, example_inputs, opts):
    """(route, why): "eager", "aot" or "inference"; see the module docstring."""
    if opts.compiler == "eager":
        return "eager", "options['compiler'] is 'eager'"
    requiring_grad = [i for i, x in enumerate(example_inputs)
                      if isinstance(x, torch.Tensor) and x.requires_grad]
    transforms = [n for n in gm.graph.nodes if n.op == "call_function" and (
        n.target is torch.autograd.grad
        or (getattr(n.target, "__module__", None) or "").startswith(_TRANSFORM_MODULES))]
    # Name the transform in the report by its nesting call (_grad_increment_nesting, ...).
    transform = next((n for n in transforms if "increment_nesting" in n.name), None) or \
        next(iter(transforms), None)
    differentiable = torch.is_grad_enabled() and requiring_grad
    compiler = f"AOTAutograd + {opts.compiler}"
    if transform is not None:
        if differentiable:
            return "eager", (f"the graph differentiates itself ({transform.name}) and "
                             f"{len(requiring_grad)} input(s) require grad: it may also be "
                             f"differentiated from outside")
        return "aot", f"{compiler}: the graph differentiates itself ({transform.name})"
    if differentiable:
        return "training", (f"{compiler}, every order compiled: grad mode is on and "
                            f"{len(requiring_grad)} input(s) require grad, so the outputs "
                            f"may be differentiated twice")
    if not torch.is_grad_enabled():
        return "inference", f"{compiler}: grad mode is off (torch.no_grad / inference_mode)"
    return "inference", f"{compiler}: grad mode is on, but no input requires grad"


def _compile(report, gm, example_inputs, opts):
    route = report.route
    if route == "training":
        # the second order differentiates the graph with every SDPA call as math; the first
        # order keeps PyTorch's fused kernels where they draw no random numbers
        sdpa_calls_as_math(gm, report, only_dropout=True)
        try:
            regions = _repeated_blocks(report, gm, example_inputs, opts)
            if regions:
                return _compile_regions(report, gm, regions, opts)
            return _compile_training(report, gm, example_inputs, opts,
                                     f"graph {report.compile_id}", nested=False)
        except training.NotSupported as e:
            report.route, report.route_reason = "eager", (
                f"{e}; running the rewritten graph eagerly keeps every order exact")
            route = "eager"
        except Exception as e:
            if not opts.fallback or isinstance(e, torch._dynamo.exc.RestartAnalysis):
                raise
            report.route, report.route_reason = "eager", _compiler_failed(report, e, opts)
            route = "eager"
    if route == "eager":
        return _run_eagerly(gm, opts, report)
    if route == "inference" and opts.kernel_choices is None \
            and kernel_settings.current().kernels is None:
        native = use_native_sdpa(gm)
        if native:
            count("inference_native_sdpa", native)
            report.route_reason += (f"; its {native} attention site(s) run PyTorch's fused kernels (SDPA, FlexAttention), "
                                    f"as nothing differentiates this graph")
    if opts.compiler == "aot_eager":
        compiled = _compat.compile_with_aot_eager(gm, example_inputs)
    else:
        compiled = _compat.compile_with_inductor(gm, example_inputs, dict(opts.inductor_config))
    return _with_kernel_choices(compiled, opts.kernel_choices)


def _run_eagerly(gm, opts, report=None):
    """The rewritten graph run as it is, its SDPA and FlexAttention calls as math: exact at
    every order. report: where to note those calls on their sites."""
    sdpa_calls_as_math(gm, report)
    return _with_kernel_choices(gm.forward, opts.kernel_choices)


def _compile_training(report, gm, example_inputs, opts, name, nested, region=None):
    """One training graph (`gm` after the passes) compiled for every order: the first
    order's pair now, the second order's on first use (training/runtime.py).
    region: (index, label) of a region of the graph Dynamo gave (its sites' notes are then
    the caller's; its residuals are recomputed: RECOMPUTE_REGION_RESIDUALS)."""
    differentiated_twice = copy.deepcopy(gm)
    sdpa_calls_as_math(differentiated_twice, report if region is None else None)
    pair = training.compile_pair(copy.deepcopy(gm), example_inputs, opts.compiler,
                                 opts.inductor_config, name, nested=nested, donate=True)
    on_compile = _on_compile(report, region)
    on_compile("first_order", pair)
    return training.TrainingGraph(pair, differentiated_twice, opts.compiler,
                                  opts.inductor_config, name, on_compile=on_compile,
                                  on_eager=_on_eager(report, region),
                                  kernel_choices=opts.kernel_choices, on_fakes=gm.forward,
                                  recompute_residuals=(region is not None
                                                       and RECOMPUTE_REGION_RESIDUALS))


def _compiler_failed(report, error, opts):
    """Warn that the compiler failed on a training graph (inductor cannot lower PyTorch's
    FlexAttention in float64 on the CPU, say), which then runs its rewritten graph eagerly:
    the untouched graph would run such sites with PyTorch's kernels, whose second order is
    missing (FlexAttention's silently: its backward is not differentiated again). Returns
    the report's reason."""
    reason = f"{type(error).__name__}: {_first_line(str(error))}"
    log.info("flashbob could not compile graph %s", report.compile_id, exc_info=True)
    warnings.warn(f"flashbob could not compile graph {report.compile_id} with "
                  f"{opts.compiler} ({reason}); running its rewritten graph eagerly "
                  f"(exact at every order). Pass options={{'fallback': False}} to "
                  f"raise instead.", stacklevel=4)
    count("compiler_failed")
    return (f"{opts.compiler} failed ({reason}); running the rewritten graph eagerly "
            f"keeps every order exact")


# --------------------------------------------------------------------- repeated blocks
def _repeated_blocks(report, gm, example_inputs, opts):
    """The training graph cut at its repeated blocks (training/regions.py), or None where
    it compiles whole: options['regions'] is "graph", the graph has symbolic shapes or runs
    under CUDA graphs (whose trees record one graph per compiled function), or it has no
    two blocks alike. Each region comes with its example inputs and its signature."""
    if opts.regions != "blocks":
        return None
    if static_inputs.uses_cuda_graphs(opts.inductor_config):
        report.regions = "whole graph: CUDA graphs record it as one"
        return None
    traced = [node.meta.get("example_value") for node in gm.graph.find_nodes(op="placeholder")]
    if any(training.is_symbolic(x) for x in [*example_inputs, *traced]):
        report.regions = "whole graph: its shapes are symbolic"
        return None
    regions, why_not = training.regions.find_regions(gm)
    if regions is None:
        report.regions = None if why_not == training.regions.NO_BLOCKS else f"whole graph: {why_not}"
        return None
    planned = []
    for region in regions:
        # Dynamo's fake values, graph inputs included: AOTAutograd, tracing a region in a
        # context of its own, would give a real input symbolic sizes
        examples = [v.meta["example_value"] for v in region.inputs]
        planned.append((region, examples, training.regions.signature(region, examples)))
    signatures = [s for _, _, s in planned if s is not None]
    if len(set(signatures)) == len(signatures):
        report.regions = "whole graph: no two blocks have the same graph"
        return None
    return planned


def _compile_regions(report, gm, planned, opts):
    """Each distinct region compiled once as a training graph, the others alike sharing it;
    a region the compiler cannot take runs its rewritten graph eagerly (exact)."""
    sdpa_calls_as_math(copy.deepcopy(gm), report)      # the sites' notes, for every block
    alike = {}                                          # signature -> region indices
    for index, (_, _, signature) in enumerate(planned):
        alike.setdefault(index if signature is None else signature, []).append(index)
    runners = [None] * len(planned)
    for indices in alike.values():
        region, examples, _ = planned[indices[0]]
        label = f"region {indices[0]}" + (f" ({region.block})" if region.block else "") + (
            f" and {len(indices) - 1} alike" if len(indices) > 1 else "")
        runner = _compile_region(report, region, examples, opts,
                                 f"graph {report.compile_id} {label}", (indices[0], label))
        for index in indices:
            runners[index] = runner
    shared = len(planned) - len(alike)
    report.regions = (f"{len(planned)} regions cut at the repeated blocks, {len(alike)} "
                      f"compiled ({shared} run another's code)")
    count("regions", len(planned))
    count("regions_shared", shared)
    return training.regions.outer_graph(gm, [r for r, _, _ in planned], runners).forward


# A region's first-order residuals, freed by its create_graph backward and recomputed when
# the double backward sends a cotangent back through the region's forward (it does for
# every region but the last: the cut puts that transport outside the compiled double
# backward). Keeping them instead costs what a first-order step keeps (GPT-2 small, 8
# layers on the CPU: a 17 % lower peak than the whole graph's when freed, ~5 % above it when
# kept) for one forward less per step.
RECOMPUTE_REGION_RESIDUALS = True


def _compile_region(report, region, examples, opts, name, index_and_label):
    try:
        return _compile_training(report, region.graph_module, examples, opts, name,
                                 nested=True, region=index_and_label).__call__
    except Exception as e:
        refused = isinstance(e, training.NotSupported)    # a route, not a failure
        if not refused and (not opts.fallback or isinstance(e, torch._dynamo.exc.RestartAnalysis)):
            raise
        reason = str(e) if refused else _compiler_failed(report, e, opts)
        _on_eager(report, index_and_label)("region", reason)
        return _run_eagerly(copy.deepcopy(region.graph_module), opts)


def _with_kernel_choices(compiled, choices):
    """`compiled`, run under the compile's kernel choices (options `kernels`, ...; the
    autograd nodes it makes keep them for their backward: bob_compile/autograd.py)."""
    if choices is None:
        return compiled
    return functools.partial(kernel_settings.run_with, choices, compiled)


def _on_compile(report, region=None):
    """What to do when a pair of a training graph compiles (the first order now, the
    second-order pieces on first use): count it, report it, log and dump its graphs.
    region: (index, label) of a region of a graph cut at its blocks: the line names its label
    ("region 1 (h.0) and 11 alike"), the dump's files its index."""
    def on_compile(what, pair):
        count(f"compiled_{what}")
        line = compiled_text(what, pair)
        prefix = ""
        if region is not None:
            index, label = region
            line, prefix = f"{label}, {line}", f"region{index}."
        report.compiled.append(line)
        try:
            dump.emit_compiled(report, prefix + what, pair)
        except OSError as e:
            warnings.warn(f"flashbob could not write its dump to {report.dump_folder!r}: {e}",
                          stacklevel=2)
    return on_compile


def _on_eager(report, region=None):
    """What to do when a compiled order of a training graph cannot be compiled and runs
    eagerly instead (exact): count it and say why in the report."""
    def on_eager(what, reason):
        count(f"eager_{what}")
        name = compiled_text_name(what)
        if region is not None:
            name = f"{region[1]}, {name}"
        report.compiled.append(f"{name}: runs eagerly ({reason})")
    return on_eager


def _with_guards(compiled, untouched, guards):
    """`compiled`, but running `untouched` while a causal mask read from a graph input
    (CausalTensorGuard) no longer holds. Dynamo calls compiled graphs as fn(*args)."""
    warned = []

    def masks_changed(args):
        failing = failing_guards(guards, args)
        if failing and not warned:
            warned.append(True)
            warnings.warn(f"flashbob: {', '.join(g.name for g in failing)} no longer holds the "
                          f"causal mask it held at compile time; running the untouched graph "
                          f"(exact, but without flashbob's attention) while that lasts",
                          stacklevel=3)
        return bool(failing)

    def run(*args):
        if training.under_fake_mode():
            return untouched(*args)      # a mask's values cannot be read, nor need be
        return untouched(*args) if masks_changed(args) else compiled(*args)
    return run
