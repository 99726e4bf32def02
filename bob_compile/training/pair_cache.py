"""A warm start without tracing again: AOTAutograd's two halves of a pair, kept on disk.

A new process compiling the same model traces every pair again (AOTAutograd's joint trace,
its graph passes and the min-cut partition: ~19 s of a GPT-2-small Sophia-H step's 25 s
warm start on an H200, inductor's FX graph cache serving the rest). AOTAutograd's own cache
cannot stand in: a hit returns its runtime wrapper without calling the compilers through
which pairs.py captures the halves, their metadata and its random draws.

So this keeps, per pair, what pairs.py captured just before inductor compiled each half:
the aten graph (with its values' fake tensors, by torch's GraphPickler), the inputs and
keyword arguments inductor's compile took, AOTAutograd's metadata and the draws found. A
hit hands them to the same inductor entry point, whose FX graph cache then hits as well.

The key is everything the halves are a function of: the graph handed to compile_pair (its
nodes by position, each with its op, target, arguments and value's shape, strides and
dtype, recursively through the modules it calls, and the bytes of any tensor it holds),
the example inputs' metadata, the pair's options, AOTAutograd's and inductor's
configuration, the versions of torch, triton and Python, and the source of this package.
Node names are not in it: graphs that differ only there share an entry. Whatever cannot be
put in the key (symbolic shapes, a callable or module of the user's inside the graph, an
object known by its address, a fake tensor constant) is not cached. The cache follows
inductor's: off where inductor's FX graph cache is off.
"""
import functools
import hashlib
import logging
import os
import pathlib
import pickle
import sys
import types

import torch
from torch import fx

log = logging.getLogger("bob_compile")

FORMAT = 1                  # bump when what an entry holds changes


class Uncacheable(Exception):
    """The pair's key cannot capture everything its halves depend on."""


def enabled():
    config = torch._inductor.config
    return bool(config.fx_graph_cache) and not config.force_disable_caches


def directory():
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return pathlib.Path(cache_dir()) / "bob_compile_pairs"


# ------------------------------------------------------------------------------- the key
def key(gm, example_inputs, options):
    """A hex digest of everything the pair traced from `gm` depends on; raises Uncacheable."""
    digest = hashlib.sha256()

    def add(*parts):
        for part in parts:
            digest.update(repr(part).encode())
            digest.update(b"\0")
    add(FORMAT, torch.__version__, torch.version.git_version, _triton_version(),
        sys.version_info[:3], _package_source_digest(), options)
    add(_config_text(torch._functorch.config), _config_text(torch._inductor.config))
    add(_ambient_state())
    for value in example_inputs:
        add(_value_text(value))
    _add_module(add, gm, seen=set())
    return digest.hexdigest()


def _add_module(add, module, seen):
    if id(module) in seen:
        return
    seen.add(id(module))
    from .second_order import GraphVjp
    add(type(module).__qualname__)
    if isinstance(module, GraphVjp):
        add(module.num_primals, module.draw_kinds, module.tangent_outputs, module.wanted)
    elif isinstance(module, fx.GraphModule):
        # the nodes by position, not by name: graphs that differ only in their names (a
        # model's blocks, split apart by DDP or by graph breaks) share one entry
        position = {node: i for i, node in enumerate(module.graph.nodes)}
        for node in module.graph.nodes:
            if node.op == "call_function":
                _check_target(node.target)
            elif node.op == "get_attr":
                _add_attribute(add, module, node.target, seen)
            arguments = repr(fx.node.map_arg((node.args, node.kwargs),
                                             lambda n: ("node", position[n])))
            if " at 0x" in arguments:       # an object known by its address only
                raise Uncacheable(f"an argument of {node.op} {node.target}: {arguments}")
            add(node.op, None if node.op == "placeholder" else _target_text(node.target),
                arguments, _value_text(node.meta.get("val", node.meta.get("example_value"))))
    elif type(module) is not torch.nn.Module:
        raise Uncacheable(f"a module of type {type(module).__name__} (its code is not in "
                          f"the graph)")
    for name, child in module.named_children():
        add(name)
        _add_module(add, child, seen)
    for name, tensor in [*module.named_parameters(recurse=False),
                         *module.named_buffers(recurse=False)]:
        add(name)
        _add_tensor(add, tensor)


def _add_attribute(add, module, target, seen):
    value = module
    for atom in target.split("."):
        value = getattr(value, atom)
    add(target)
    if isinstance(value, torch.Tensor):
        _add_tensor(add, value)
    elif isinstance(value, torch.nn.Module):
        _add_module(add, value, seen)
    elif isinstance(value, (int, float, bool, str, type(None))):
        add(value)
    else:
        raise Uncacheable(f"a graph attribute of type {type(value).__name__}")


def _add_tensor(add, tensor):
    if isinstance(tensor, torch._subclasses.FakeTensor) or type(tensor) not in (
            torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):
        raise Uncacheable(f"a graph constant of type {type(tensor).__name__}")
    add(_value_text(tensor))
    digest = hashlib.sha256(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8)
                            .numpy().tobytes()).hexdigest() if tensor.numel() else ""
    add(digest)


_OPS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)


def _module_of(target):
    owner = getattr(target, "__objclass__", None)      # a method of torch.Tensor
    return getattr(owner if owner is not None else target, "__module__", None) or ""


def _target_text(target):
    if isinstance(target, str):
        return target
    if isinstance(target, _OPS):
        return str(target)
    return f"{_module_of(target)}.{getattr(target, '__qualname__', repr(target))}"


_SAFE_MODULES = ("torch", "operator", "builtins", "math", "_operator", "bob_compile")


def _check_target(target):
    """A call_function target whose behaviour its name in the code pins down: an op, or a
    function of torch, Python or this package (a user's function could change under the
    same name)."""
    if isinstance(target, _OPS):
        return
    module = _module_of(target)
    if isinstance(target, (types.BuiltinFunctionType, types.FunctionType, types.MethodType,
                           types.MethodDescriptorType, types.WrapperDescriptorType,
                           type)) and module.split(".")[0] in _SAFE_MODULES:
        return
    raise Uncacheable(f"the graph calls {getattr(target, '__qualname__', target)!r} of "
                      f"module {module!r}")


def _ambient_state():
    """What AOTAutograd traces under besides its configuration: autocast as the caller
    entered it (outside the graph, not in its code), the default dtype, determinism."""
    autocast = [(device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                for device in ("cpu", "cuda")]
    return (autocast, torch.is_autocast_cache_enabled(), torch.get_default_dtype(),
            torch.are_deterministic_algorithms_enabled())


def _value_text(value):
    if isinstance(value, torch.Tensor):
        if value._has_symbolic_sizes_strides:
            raise Uncacheable("symbolic shapes")
        return ("tensor", tuple(value.shape), value.stride(), value.storage_offset(),
                value.dtype, value.device.type, value.layout, value.requires_grad,
                isinstance(value, torch.nn.Parameter))
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise Uncacheable("symbolic shapes")
    if isinstance(value, (list, tuple)):
        return type(value).__name__, tuple(_value_text(v) for v in value)
    if value is None or isinstance(value, (int, float, bool, str, torch.dtype, torch.device,
                                           torch.memory_format, torch.layout)):
        return value
    raise Uncacheable(f"a value of type {type(value).__qualname__}")


def _config_text(config_module):
    try:
        settings = config_module.save_config_portable()
    except Exception as e:           # a setting that cannot be read: no key
        raise Uncacheable(f"the configuration of {config_module.__name__}: {e}") from None
    return sorted((name, repr(value)) for name, value in settings.items())


def _triton_version():
    try:
        import triton
        return triton.__version__
    except ImportError:
        return None


@functools.lru_cache(maxsize=1)
def _package_source_digest():
    root = pathlib.Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------- the entries
def _pickle_options():
    from torch.fx._graph_pickler import Options
    return Options(ops_filter=None)     # our attention ops are found again by name


def save(digest, halves, metadata, random):
    """Write an entry: halves maps "forward"/"backward" to (graph, inputs, kwargs) as
    inductor's compile took them. Failures only log: the cache is an optimization."""
    from torch.fx._graph_pickler import GraphPickler
    try:
        entry = dict(format=FORMAT, random=random, halves={})
        entry["metadata"] = GraphPickler.dumps(metadata, _pickle_options())
        for half, (graph, inputs, kwargs) in halves.items():
            entry["halves"][half] = dict(
                graph=GraphPickler.dumps(graph, _pickle_options()),
                inputs=GraphPickler.dumps(list(inputs), _pickle_options()),
                kwargs=_portable_kwargs(kwargs))
        path = directory() / f"{digest}.pkl"
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_bytes(pickle.dumps(entry))
        os.replace(scratch, path)         # readers never see half an entry
    except Exception as e:
        log.info("flashbob: a pair was not written to the cache: %s: %s", type(e).__name__, e)


def load(digest, fake_mode):
    """(halves, metadata, random) of a saved entry, its fake tensors in `fake_mode`; None
    where there is none (or it cannot be read)."""
    from torch.fx._graph_pickler import GraphPickler
    path = directory() / f"{digest}.pkl"
    if not path.exists():
        return None
    try:
        entry = pickle.loads(path.read_bytes())
        if entry.get("format") != FORMAT:
            return None
        kwargs = _restored_kwargs([data["kwargs"] for data in entry["halves"].values()])
        halves = {half: (GraphPickler.loads(data["graph"], fake_mode),
                         GraphPickler.loads(data["inputs"], fake_mode), half_kwargs)
                  for (half, data), half_kwargs in zip(entry["halves"].items(), kwargs)}
        metadata = GraphPickler.loads(entry["metadata"], fake_mode)
    except Exception as e:
        log.info("flashbob: a cached pair could not be read (%s: %s); tracing it again",
                 type(e).__name__, e)
        return None
    return halves, metadata, entry["random"]


def discard(digest):
    (directory() / f"{digest}.pkl").unlink(missing_ok=True)


def _portable_kwargs(kwargs):
    """inductor's compile arguments without process-bound objects: its boxed flag as its
    value, its device index as a marker (one is shared again on load), no graph id (a new
    one is drawn)."""
    from torch._inductor.cudagraph_utils import BoxedDeviceIndex
    from torch._inductor.utils import BoxedBool
    portable = {}
    for name, value in kwargs.items():
        if name == "graph_id":
            continue
        if isinstance(value, BoxedBool):
            value = ("BoxedBool", value.value)
        elif isinstance(value, BoxedDeviceIndex):
            value = ("BoxedDeviceIndex", None)
        pickle.dumps(value)                # raises for anything else process-bound
        portable[name] = value
    return portable


def _restored_kwargs(halves_kwargs):
    """The halves' compile arguments back from _portable_kwargs: the forward and backward
    share one device index and one graph id, as compile_fx gives them."""
    from torch._inductor.compile_fx import _graph_counter
    from torch._inductor.cudagraph_utils import BoxedDeviceIndex
    from torch._inductor.utils import BoxedBool
    shared, graph_id = BoxedDeviceIndex(None), next(_graph_counter)
    restored = []
    for kwargs in halves_kwargs:
        half = {"graph_id": graph_id}
        for name, value in kwargs.items():
            marker = value[0] if isinstance(value, tuple) and len(value) == 2 else None
            if marker == "BoxedDeviceIndex":
                value = shared
            elif marker == "BoxedBool":
                value = BoxedBool(value[1])
            half[name] = value
        restored.append(half)
    return restored
