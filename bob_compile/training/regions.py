"""A training graph cut at its repeated blocks, so that each distinct block compiles once.

A transformer's Dynamo graph writes the same block out once per layer (GPT-2 small: twelve
times), and compiling every order of it costs inductor time in proportion to its ops: the
first step of GPT-2 small took 74-89 s, almost all of it code generation for twelve copies
of one block. Here the graph is cut where its blocks begin and end (Dynamo's
`nn_module_stack`: sibling modules `<list>.0`, `<list>.1`, ... of one class), every region
becomes a graph of its own, and regions whose graphs are the same (ops, targets, constants,
and their inputs' shapes, strides, dtypes and requires_grad) share one compiled training
graph. The outer graph calls the regions in order; autograd chains their nodes, so every
order of derivative is as exact as the whole graph's.

What a cut costs: nothing fuses across a block's boundary (a few elementwise kernels at each
end), and each region is one autograd node per order (some microseconds of host time per
block and order). A graph is not cut where a region would write into memory another region
owns (in-place ops across a boundary), where a boundary value is not a tensor (symbolic
sizes, tuples), or where no two blocks share a graph.
"""
import dataclasses
import operator
import re
from typing import Optional

import torch
from torch import fx

from ..passes.nodes import storage_key

# A module path ending in a list index: ModuleList / Sequential children (`h.0`, `layers[3]`).
_INDEXED = re.compile(r"^(?P<parent>.*?)(?:\.(?P<dot>\d+)|\[(?P<bracket>\d+)\])$")
# In-place operator spellings (call_function targets)
_WRITING_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul,
                      operator.iand, operator.ior, operator.ixor, operator.ilshift,
                      operator.irshift, operator.setitem}


NO_BLOCKS = "no module list with two or more blocks of one class"


@dataclasses.dataclass
class Region:
    """One piece of the graph: `graph_module` computes `outputs` (nodes of the original
    graph) from `inputs` (placeholders or nodes of earlier regions)."""
    graph_module: fx.GraphModule
    inputs: list
    outputs: list
    block: Optional[str]          # the block's module path, None for the code around blocks


def block_path(node):
    """The module path of the outermost indexed module (a list's child) `node` runs in,
    and that child's class; (None, None) outside any."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, module_type in stack.values():
        if _INDEXED.match(path):
            return path, module_type
    return None, None


def readable(path):
    """`L['self'].h.0` -> `h.0`: the path from the compiled module (which a decorated
    forward, as Hugging Face's, receives as `L['args'][0]`)."""
    return re.sub(r"^L\['[^']*'\](\[\d+\])?\.?", "", path) or path


def find_regions(gm):
    """The graph cut at its repeated blocks: a list of Regions, or (None, why not)."""
    # attributes (wrapped bodies, constants) are not values between regions: each region
    # that reads one reads it itself
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    labels = _labels(nodes)
    runs = []                        # [(label, [nodes])], consecutive nodes of one label
    for node, label in zip(nodes, labels):
        if runs and runs[-1][0] == label:
            runs[-1][1].append(node)
        else:
            runs.append((label, [node]))
    blocks = [label for label, _ in runs if label is not None]
    if len(blocks) != len(set(blocks)):
        return None, "a block's nodes are not contiguous in the graph"
    families = {}
    for path, module_type in blocks:
        parent = _INDEXED.match(path).group("parent")
        families.setdefault((parent, module_type), []).append(path)
    if not any(len(paths) > 1 for paths in families.values()):
        return None, NO_BLOCKS
    if not _state_is_ambient_between(runs):
        return None, ("a block begins or ends inside an autocast or grad-mode context the "
                      "graph enters itself")
    return _split(gm, [(readable(label[0]) if label else None, run) for label, run in runs])


def _labels(nodes):
    """Each node's block, (path, class) or None. A node Dynamo recorded without a module
    stack (a higher-order op such as a checkpointed block's call, a node a pass inserted)
    belongs to the one block whose parameters it reads, else to the node before it."""
    labels, current = [], None
    for node in nodes:
        if "nn_module_stack" in node.meta:
            path, module_type = block_path(node)
            current = (path, module_type) if path is not None else None
        else:
            read = {block_path(arg) for arg in node.all_input_nodes if arg.op == "placeholder"}
            read.discard((None, None))
            if len(read) == 1:
                current = read.pop()
        labels.append(current)
    return labels


def _state_is_ambient_between(runs):
    """Whether autocast and grad mode are the caller's at every cut: a region compiles under
    the ambient state, so a context the graph enters (`with torch.autocast(...)`, `with
    torch.no_grad()` inside the model: Dynamo records their enter and exit as nodes) must
    open and close within one region."""
    from torch.amp.autocast_mode import _enter_autocast, _exit_autocast
    autocast, grad_enabled = 0, torch.is_grad_enabled()
    for _, run in runs[:-1]:
        for node in run:
            if node.target is _enter_autocast:
                autocast += 1
            elif node.target is _exit_autocast:
                autocast -= 1
            elif node.target is torch._C._set_grad_enabled and node.args:
                grad_enabled = node.args[0]
        if autocast or grad_enabled != torch.is_grad_enabled():
            return False
    return True


def _split(gm, runs):
    region_of = {}
    for index, (_, run) in enumerate(runs):
        for node in run:
            region_of[node] = index
    if _writes_across(gm, region_of):
        return None, "an in-place op writes into memory another region owns"
    last_use = {}
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            last_use[arg] = region_of.get(node, len(runs))    # the output: after every region
    regions = []
    for index, (block, run) in enumerate(runs):
        members = set(run)
        inputs = list(dict.fromkeys(arg for node in run for arg in node.all_input_nodes
                                    if arg not in members and arg.op != "get_attr"))
        outputs = [node for node in run if last_use.get(node, index) > index]
        for value in inputs + outputs:
            if not isinstance(value.meta.get("example_value"), torch.Tensor):
                return None, f"{value.name}, a value between regions, is not a tensor"
        regions.append(Region(_region_module(gm, run, inputs, outputs), inputs, outputs, block))
    return regions, None


def _writes(node):
    """The node an in-place op writes into, else None."""
    if node.op == "call_function" and node.target in _WRITING_OPERATORS:
        return node.args[0] if node.args else None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    writes = node.op in ("call_method", "call_function") and isinstance(name, str) and (
        (name.endswith("_") and not name.startswith("_"))
        or (name.startswith("__i") and name.endswith("__"))
        or node.kwargs.get("inplace") is True or node.kwargs.get("out") is not None)
    if not writes:
        return None
    target = node.kwargs.get("out", node.args[0] if node.args else None)
    return target if isinstance(target, fx.Node) else None


def _writes_across(gm, region_of):
    """Whether an op writes into memory that a node outside its own region also holds (a
    graph input, or a value another region made or views): compiled alone, that region
    would see a mutated input, and the region owning the memory a stale or copied value."""
    owners = {}
    for node in gm.graph.nodes:
        key = storage_key(node)
        if key is not None:
            owners.setdefault(key, set()).add(region_of.get(node, -1))
    for node in gm.graph.nodes:
        written = _writes(node)
        if written is None:
            continue
        key = storage_key(written)
        if key is None or owners.get(key, set()) - {region_of.get(node)}:
            return True
    return False


def _region_module(gm, run, inputs, outputs):
    graph = fx.Graph()
    env = {}
    for value in inputs:
        placeholder = graph.placeholder(value.name)
        placeholder.meta = dict(value.meta)
        env[value] = placeholder
    def value(n):
        if n not in env and n.op == "get_attr":
            env[n] = graph.node_copy(n)
        return env[n]
    for node in run:
        env[node] = graph.node_copy(node, value)
    graph.output(tuple(env[node] for node in outputs))
    module = fx.GraphModule(gm, graph)
    module.meta = dict(getattr(gm, "meta", {}))
    return module


def outer_graph(gm, regions, runners):
    """`gm` as calls of `runners` (one per region, each returning its region's outputs as a
    sequence), in order: Dynamo calls it as it would call `gm`."""
    graph = fx.Graph()
    env = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        env[node] = graph.node_copy(node)
    for index, (region, runner) in enumerate(zip(regions, runners)):
        call = graph.call_function(_named(runner, f"region_{index}"),
                                   tuple(env[value] for value in region.inputs))
        call.name = f"region_{index}"
        for position, node in enumerate(region.outputs):
            env[node] = graph.call_function(operator.getitem, (call, position))
    graph.output(fx.map_arg(gm.graph.output_node().args[0], lambda n: env[n]))
    return fx.GraphModule(gm, graph)


def _named(runner, name):
    """`runner` as a plain function FX's code generation can name (not a bound method)."""
    def run(*args):
        return runner(*args)
    run.__name__ = run.__qualname__ = name
    return run


# ------------------------------------------------------------------------ sharing
def signature(region, example_inputs):
    """A key equal for two regions exactly when one compiled graph serves both: the same
    ops on the same targets and constants (tensor constants by identity, body graphs of
    higher-order ops by their own ops), reading inputs of the same shapes, strides, dtypes,
    devices, requires_grad and static marks. None where a constant cannot be compared (the
    region then compiles alone)."""
    try:
        parts = [_graph_signature(region.graph_module)]
        for value, node in zip(example_inputs, region.graph_module.graph.find_nodes(op="placeholder")):
            static = bool(node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type"))
            parts.append(_input_signature(value) + (static,))
        key = tuple(parts)
        hash(key)
    except _Incomparable:
        return None
    return key


def _graph_signature(gm):
    index, parts = {}, []
    for position, node in enumerate(gm.graph.nodes):
        index[node] = position
        if node.op == "placeholder":
            continue
        target = node.target
        if node.op == "get_attr":
            value = _attribute(gm, target)
            # a checkpointed or otherwise wrapped body: each block has its own module
            target = (("graph", _graph_signature(value)) if isinstance(value, fx.GraphModule)
                      else ("attribute", id(value)))
        parts.append((node.op, target, _constant(node.args, index),
                      _constant(node.kwargs, index)))
    return tuple(parts)


class _Incomparable(Exception):
    pass


def _attribute(module, target):
    for name in target.split("."):
        module = getattr(module, name)
    return module


def _constant(value, index):
    if isinstance(value, fx.Node):
        return ("node", index[value])
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_constant(v, index) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _constant(v, index)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", _constant(value.start, index), _constant(value.stop, index),
                _constant(value.step, index))
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    if isinstance(value, float) and value != value:       # nan: equal to itself here
        return ("nan",)
    try:
        hash(value)
    except TypeError:
        raise _Incomparable(type(value).__name__) from None
    return (type(value), value)


def _input_signature(value):
    if not isinstance(value, torch.Tensor):
        return ("value", _constant(value, {}))
    return ("tensor", tuple(value.shape), tuple(value.stride()), value.storage_offset(),
            value.dtype, value.device, value.requires_grad)
