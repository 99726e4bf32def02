"""The attention op's first order as a C++ autograd node, where PyTorch's fused kernels
compute it (csrc/native_node.cpp; why: docs/host-overhead.md).

A plain eager call whose call path is PyTorch's cuDNN or FA2 kernels runs through the node
where it needs a graph (grad mode on, an input requiring grad): its forward and its
first-order backward are C++, the backward run without the GIL; where it needs none, the
module's forward_output runs (the same kernel call, from C++). Its create_graph backward (a second
order), and every backward it cannot run itself, call `general_backward` below, which is
what the Python node (AttnFn in autograd.py) runs there: exact at every order either way.

The node is compiled on first use with torch.utils.cpp_extension (a C++ compiler and ninja,
which PyTorch's own extensions need too) into BOB_COMPILE_CACHE_DIR, keyed by its source,
the torch version and the Python version, so a machine builds it once. BOB_COMPILE_CPP_NODE
(kernels/settings.py) says how: `background` (default; the Python node runs until the build
is ready, ~30 s), `wait` (the first call waits: benchmarks), `off`. A failed build is logged
once, and the Python node runs.
"""
import hashlib
import logging
import os
import sys
import threading
import time

import torch

from . import kernels, ops
from .kernels import settings as kernel_settings
from .kernels import triton_attention

log = logging.getLogger("bob_compile.native_node")

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "native_node.cpp")
KERNEL_NAMES = ("cudnn", "flash", "cpu_flash")    # the node's kernel numbers (CUDNN, ...)

_extension = None           # the built module, once ready
_build_started = False
_lock = threading.Lock()
_ready = threading.Event()

_forward_ad = torch.autograd.forward_ad
_call_path = ops.call_path      # what runs for a call's signature (a test swaps it)
_profiling = torch._C._autograd._profiler_enabled


def _build_directory():
    with open(_SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(source + f"{torch.__version__} {sys.version}".encode()).hexdigest()[:16]
    return os.path.join(kernel_settings.current().cache_dir, "native_node", key), key


def _build():
    global _extension
    start = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load
        directory, key = _build_directory()
        os.makedirs(directory, exist_ok=True)
        module = load(f"bob_compile_native_node_{key}", [_SOURCE], extra_cflags=["-O2"],
                      build_directory=directory, verbose=False)
        from .autograd import native_node_backward
        module.set_general_backward(native_node_backward)
        _extension = module
        log.info("bob_compile: C++ autograd node ready in %.1f s (%s)",
                 time.perf_counter() - start, directory)
    except Exception as e:      # no compiler, no ninja, no headers, a failed compile
        log.warning("bob_compile: could not build the C++ autograd node of the first order "
                    "(%s: %s); the Python node runs instead (exact, more host time per call; "
                    "BOB_COMPILE_CPP_NODE=off skips the build)", type(e).__name__, e)
    finally:
        _ready.set()


def extension(wait=None):
    """The built node's module, or None while it is not ready (or cannot be built). The
    first call starts the build, in a background thread unless `wait` (default: the
    BOB_COMPILE_CPP_NODE setting) asks to wait for it."""
    global _build_started
    if _extension is not None:
        return _extension
    mode = kernel_settings.current().cpp_node
    if mode == "off":
        return None
    wait = mode == "wait" if wait is None else wait
    with _lock:
        if not _build_started:
            _build_started = True
            if wait:
                _build()
            else:
                threading.Thread(target=_build, name="bob_compile C++ node build",
                                 daemon=True).start()
    if wait:
        _ready.wait()
    return _extension


def attention_output(q, k, v, scale, causal, needs_graph):
    """o of a plain eager call without a mask through the C++ node (needs_graph: some input
    requires grad under grad mode; else the forward alone, without the lse); None where the
    node does not apply (not PyTorch's fused kernels, forward-mode AD, the profiler, a
    compiled graph's kernel choices; not built yet) or the kernel refused."""
    if _forward_ad._current_level >= 0 or _profiling() or kernel_settings.overridden() is not None:
        return None
    path = _call_path(kernels.select, q, k, v, None, scale, causal)
    if path is None or path.native is None:
        return None
    module = _extension
    if module is None:
        module = extension()
        if module is None:
            return None
    elif kernel_settings.current().cpp_node == "off":
        return None
    try:
        if not needs_graph:
            return module.forward_output(q, k, v, scale, causal, KERNEL_NAMES.index(path.native))
        return module.attention(q, k, v, scale, causal, KERNEL_NAMES.index(path.native))[0]
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError) as e:
        triton_attention.native_refused(path.native, q, v, causal, e)
        return None
