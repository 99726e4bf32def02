"""PyTorch's context parallelism with flashbob: exact derivatives of every order by
switching the backend.

Inside `torch.distributed.tensor.experimental.context_parallel(mesh, buffers=...)` PyTorch
shards the buffers along the sequence (head-tail order where the length allows: its load
balancing for causal attention) and replaces F.scaled_dot_product_attention with a wrapper
that makes q, k, v DTensors and runs ring attention on SDPA's fused kernels, whose backward
cannot be differentiated again. Under torch.compile that wrapper runs between graphs
(Dynamo cannot trace DTensor.from_local), so no backend ever sees the attention.

`install()` (run when bob_compile is imported) wraps PyTorch's wrapper once more as
PyTorch installs it. While Dynamo traces a frame for flashbob (decided at trace time), the
call goes to `bob_compile.context_parallel.attention` on the mesh's process group, in the
order PyTorch sharded the buffers: fused and exact at every order, between the compiled
graphs. Everywhere else (eager code, other backends) PyTorch's wrapper runs unchanged.
Where PyTorch's private layout is not the one this module knows, nothing is wrapped and a
debug line says so.
"""
import logging

import torch
import torch.nn.functional as F
from torch._dynamo.symbolic_convert import InstructionTranslator

from . import context_parallel
from .backend import flashbob

log = logging.getLogger(__name__)

_SDPA = torch._C._nn.scaled_dot_product_attention     # F.scaled_dot_product_attention itself


def _context_parallel_module():
    """PyTorch's context-parallel implementation module, or None where it is not the one
    this module was written against (torch 2.11 - 2.14)."""
    if not torch.distributed.is_available():
        return None
    # an optional integration: whatever its import raises must not stop bob_compile's
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    except Exception:
        try:
            from torch.distributed.tensor.experimental import _attention as cp
        except Exception as e:
            log.debug("bob_compile: torch's context parallelism did not import (%s)", e)
            return None
    if not all(hasattr(cp, name) for name in
               ("_distribute_function", "_replaced_functions", "_cp_options")):
        return None
    return cp


def install():
    """Wrap PyTorch's context-parallel SDPA wherever it installs it (idempotent), and the
    one already installed if a context was entered before this import."""
    cp = _context_parallel_module()
    if cp is None:
        log.debug("bob_compile: torch's context parallelism not found; not wrapped")
        return
    if getattr(cp._distribute_function, "bob_compile_wrapper", False):
        return
    distribute = cp._distribute_function

    def distribute_function(fn, fn_module, device_mesh, input_fn, output_fn):
        distribute(fn, fn_module, device_mesh, input_fn, output_fn)
        if fn is _SDPA:
            _wrap_installed(cp, fn_module, device_mesh, input_fn)

    distribute_function.bob_compile_wrapper = True
    cp._distribute_function = distribute_function
    _wrap_already_installed(cp, F)


def _wrap_already_installed(cp, fn_module):
    """A context entered before bob_compile was imported: PyTorch's wrapper is in place,
    its mesh and input function in its closure."""
    installed = getattr(fn_module, _SDPA.__name__)
    if installed is _SDPA or installed not in cp._replaced_functions \
            or getattr(installed, "__closure__", None) is None:
        return
    cells = dict(zip(installed.__code__.co_freevars,
                     (c.cell_contents for c in installed.__closure__)))
    if "device_mesh" in cells:
        _wrap_installed(cp, fn_module, cells["device_mesh"], cells.get("input_fn"))


def _wrap_installed(cp, fn_module, mesh, input_fn):
    theirs = getattr(fn_module, _SDPA.__name__)
    if theirs is _SDPA or theirs not in cp._replaced_functions \
            or getattr(theirs, "bob_compile_wrapper", False):
        return
    # the dimension PyTorch shards q, k, v along (2 for SDPA's (B, H, L, E))
    seq_dim = getattr(getattr(input_fn, "__self__", None), "seq_dim", None)

    def scaled_dot_product_attention(*args, **kwargs):
        if seq_dim == 2 and torch.compiler.is_compiling() and _tracing_for_flashbob():
            return _fused(cp, mesh, *args, **kwargs)
        return theirs(*args, **kwargs)

    scaled_dot_product_attention.bob_compile_wrapper = True
    # PyTorch restores F's function from this registry when the context exits
    cp._replaced_functions[scaled_dot_product_attention] = cp._replaced_functions.pop(theirs)
    setattr(fn_module, _SDPA.__name__, scaled_dot_product_attention)


@torch._dynamo.assume_constant_result
def _tracing_for_flashbob():
    """Whether the frame Dynamo is tracing now will be compiled by flashbob (read once, at
    trace time: the answer is part of the traced code)."""
    tx = InstructionTranslator.current_tx()
    compiler = getattr(getattr(tx, "output", None), "compiler_fn", None)
    seen = set()
    while compiler is not None and id(compiler) not in seen:
        if compiler is flashbob:
            return True
        seen.add(id(compiler))
        # torch's wrappers around a backend: debug wrapper, compile options, DDP's splitter,
        # functools.partial, bound methods
        compiler = next((getattr(compiler, a) for a in
                         ("compiler_fn", "backend_compile_fn", "func", "__wrapped__", "__self__")
                         if getattr(compiler, a, None) is not None), None)
    return False


@torch.compiler.disable     # collectives: between the compiled graphs
def _fused(cp, mesh, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
           scale=None, enable_gqa=False):
    if attn_mask is not None:
        raise NotImplementedError(
            "bob_compile: an attn_mask under PyTorch's context_parallel is not supported (nor "
            "by PyTorch's ring attention); pass is_causal, or call "
            "bob_compile.context_parallel.attention with a mask of the whole sequence")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise RuntimeError(f"scaled_dot_product_attention: query has {query.shape[1]} heads "
                           f"and key {key.shape[1]}; pass enable_gqa=True for grouped heads")
    order = "head-tail" if cp._cp_options.enable_load_balance else "contiguous"
    return context_parallel.attention(query, key, value, dropout_p=dropout_p,
                                      is_causal=is_causal, scale=scale,
                                      group=mesh.get_group(), order=order)
