"""The attention op's first order as a C++ autograd node, where PyTorch's fused kernels
compute it, and the first backward of a folded second order as another
(csrc/native_node.cpp; why: docs/host-overhead.md).

A plain eager call whose call path is PyTorch's cuDNN or FA2 kernels runs through the node
where it needs a graph (grad mode on, an input requiring grad): its forward and its
first-order backward are C++, the backward run without the GIL; where it needs none, the
module's forward_output runs (the same kernel call, from C++). Its create_graph backward
(a second order) in the folded form is the second node, whose backward is the folded BoB.
Every other backward calls general_backward, which is what the Python node (AttnFn in
autograd.py) runs there: exact at every order either way.

A plain eager call with a mask runs through the same nodes with the op's Triton kernels
(masked_output), the mask's summary kept in the node.

The Triton kernels run in stages (a masked call's forward and first backward, any call's
folded BoB): each from a program of its allocations and launches once Python has recorded
one (run_triton_stage, programs.py), launched from C++; by Python (run_triton_stage, or
bob_backward for a BoB that is differentiated again) otherwise.

The node is compiled on first use with torch.utils.cpp_extension (a C++ compiler and ninja,
which PyTorch's own extensions need too) into BOB_COMPILE_CACHE_DIR, keyed by its source,
the torch version and the Python version, so a machine builds it once. BOB_COMPILE_CPP_NODE
(bob_compile/kernels/settings.py) says how: `background` (default; the Python node runs
until the build is ready, ~30 s), `wait` (the first call waits: benchmarks), `off`. A failed
build is logged once, and the Python node runs.
"""
import contextlib
import ctypes
import hashlib
import logging
import os
import sys
import threading
import time

try:
    import fcntl
except ImportError:         # Windows: the age rule alone (_clear_stale_build_lock)
    fcntl = None

import torch

from .. import autograd, kernels, ops
from ..kernels import layout, native_sdpa, triton_attention, triton_masks
from ..kernels import settings as kernel_settings
from ..kernels.params import AttentionParams
from . import programs

log = logging.getLogger("bob_compile.eager")

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "native_node.cpp")
KERNEL_NAMES = ("cudnn", "flash", "cpu_flash")    # the node's kernel numbers (CUDNN, ...)
_KERNEL_NUMBERS = {name: number for number, name in enumerate(KERNEL_NAMES)}

_extension = None           # the built module, once ready
# module.fast_attention, which bob_compile.attention calls first (None: not built, or off)
fast_entry = None
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


# A build takes a minute or two. torch's build lock (a file in the build folder, taken by
# every load(), even of a built module) left by a process that died inside load() (killed,
# or exiting while this background build ran) makes every later build wait on it forever.
# So each load() runs under an OS lock of our own on the folder, which the system releases
# when its holder dies: a torch lock found while holding it belongs to a dead build. Where
# the system has no such locks (fcntl: not on Windows), a torch lock older than this is
# taken for a dead build's.
STALE_BUILD_LOCK_S = 30 * 60
BUILD_FLOCK = "build.flock"


@contextlib.contextmanager
def _exclusive_build(directory):
    """Hold the build folder's OS lock for one load(), after removing a torch build lock left
    there by a build that died; said in the log."""
    if fcntl is None:
        _clear_stale_build_lock(directory)
        yield
        return
    with open(os.path.join(directory, BUILD_FLOCK), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)        # released by the system if we die
        try:
            _remove_build_lock(directory, "its build died before it finished")
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _clear_stale_build_lock(directory):
    """Without OS locks: remove the build folder's torch lock where it is older than
    STALE_BUILD_LOCK_S (a build killed before it finished); said in the log."""
    try:
        age = time.time() - os.path.getmtime(os.path.join(directory, "lock"))
    except OSError:
        return
    if age > STALE_BUILD_LOCK_S:
        _remove_build_lock(directory, f"{age / 60:.0f} min old: a build was killed before it "
                                      f"finished")


def _remove_build_lock(directory, why):
    lock = os.path.join(directory, "lock")
    if os.path.exists(lock):
        log.warning("bob_compile: removing a stale C++ node build lock (%s: %s)", lock, why)
        try:
            os.remove(lock)
        except OSError:
            pass


def _build():
    global _extension
    start = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load
        directory, key = _build_directory()
        os.makedirs(directory, exist_ok=True)
        with _exclusive_build(directory):
            module = load(f"bob_compile_native_node_{key}", [_SOURCE], extra_cflags=["-O2"],
                          build_directory=directory, verbose=False)
        module.set_general_backward(general_backward)
        module.set_bob_backward(bob_backward)
        module.set_triton_stage(run_triton_stage)
        module.set_keys_out_above_head_dim(triton_attention.ACCUMULATE_B_MAX_HEAD_DIM)
        module.set_python_state(kernel_settings.kernel_choices_variable(), _forward_ad)
        _connect_driver(module)
        _extension = module
        _install_entry(kernel_settings.current())
        log.info("bob_compile: C++ autograd node ready in %.1f s (%s)",
                 time.perf_counter() - start, directory)
    except Exception as e:      # no compiler, no ninja, no headers, a failed compile
        log.warning("bob_compile: could not build the C++ autograd node of the first order "
                    "(%s: %s); the Python node runs instead (exact, more host time per call; "
                    "BOB_COMPILE_CPP_NODE=off skips the build)", type(e).__name__, e)
    finally:
        _ready.set()


def _connect_driver(module):
    """Hands the module the CUDA driver's cuLaunchKernel and cuCtxGetCurrent (it links no CUDA
    library, so that it builds on machines without one), for the programs it replays.
    Without a driver, no program is made: Python launches every Triton stage."""
    if not torch.cuda.is_available():
        return
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        module.set_driver(ctypes.cast(driver.cuLaunchKernel, ctypes.c_void_p).value,
                          ctypes.cast(driver.cuCtxGetCurrent, ctypes.c_void_p).value)
    except (OSError, AttributeError) as e:
        log.info("bob_compile: no CUDA driver entry points for the C++ node (%s); the BoB "
                 "launches from Python", e)


def _install_entry(settings):
    global fast_entry
    fast_entry = None if _extension is None or settings.cpp_node == "off" \
        else _extension.fast_attention


@kernel_settings.on_reload
def _forget_programs(settings):
    """Programs hold launch configs chosen under the previous settings (kernel choices,
    tuning, fast launches), routes the kernels chosen: made again under the new ones."""
    if _extension is not None:
        _extension.forget_programs()
        _extension.forget_routes()
    _install_entry(settings)


@native_sdpa.on_refused
def _forget_routes():
    if _extension is not None:
        _extension.forget_routes()


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


def _something_intercepts():
    """Forward-mode AD, the profiler or a compiled graph's kernel choices: the op's Python
    path runs (the nodes have no jvp, the profiler should see the op's name, and kernel
    choices are Python's)."""
    return _forward_ad._current_level >= 0 or _profiling() or \
        kernel_settings.overridden() is not None


def unmasked_output(q, k, v, scale, causal, needs_graph):
    """o of a plain eager call without a mask through the C++ node (needs_graph: some input
    requires grad under grad mode; else the forward alone, without the lse); None where the
    node does not apply (not PyTorch's fused kernels, forward-mode AD, the profiler, a
    compiled graph's kernel choices; not built yet) or the kernel refused."""
    if _something_intercepts():
        return None
    path = _call_path(kernels.select, q, k, v, None, scale, causal)
    module = _extension
    # the node runs the fused kernels it names; any other call path (Triton's, or one
    # whose kernels it does not know) stays in Python
    kernel = None if path is None else _KERNEL_NUMBERS.get(path.native)
    if kernel is None:
        if module is not None:      # the C++ entry leaves this signature to Python
            module.remember_route(q, k, v, None, scale, causal, -1, False)
        return None
    if module is None:
        module = extension()
        if module is None:
            return None
    elif kernel_settings.current().cpp_node == "off":
        return None
    fold = kernels.fold_bob(q, k, v)
    # from the next call of this signature on, the C++ entry runs what follows (fast_entry)
    module.remember_route(q, k, v, None, scale, causal, kernel, fold)
    try:
        if not needs_graph:
            return module.forward_output(q, k, v, None, scale, causal, kernel)
        return module.attention(q, k, v, None, scale, causal, kernel, fold)[0]
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError) as e:
        native_sdpa.refused(path.native, q, v, causal, e)
        return None


# --------------------------------------------------------------------------------------
# What the nodes call back into Python for
# --------------------------------------------------------------------------------------
def general_backward(q, k, v, o, lse, do, dlse, scale, causal, kernels, refused, mask):
    """The backwards of the C++ node that it does not run itself: what AttnFn.backward runs
    there (a create_graph backward, an lse cotangent, a tensor subclass,
    deterministic algorithms). refused: the message of the fused backward's refusal, if it
    refused. o and lse are the node's outputs (they carry its history, for a third order);
    mask: the call's (B, Hq, L, S) mask view, or None."""
    if refused is not None:
        native_sdpa.refused(KERNEL_NAMES[kernels], q, v, causal, refused)
    if do is None and dlse is None:
        return None, None, None
    return autograd.differentiable_first_backward(q, k, v, o, lse, do, dlse, mask, scale, causal)


def bob_backward(q, k, v, o, lse, do, o_attached, lse_attached, gdq, gdk, gdv, dq,
                 scale, causal, mask):
    """The backward of the C++ node's first backward where it does not run it itself: what
    AttnBwdFn.backward runs for o and lse that came in detached (the folded BoB), returning
    (gq, gk, gv, gdo). o_attached, lse_attached: the forward's outputs with
    their history, which a third order differentiates through; dq: the first backward's dq
    (None if modified in place since); mask: the call's (B, Hq, L, S) mask view, or None."""
    if torch.is_grad_enabled():     # a third order differentiates the BoB, o and lse too
        o, lse = o_attached, lse_attached
    path = None
    if not torch.is_grad_enabled() and not _profiling() and autograd.plain_eager((gdq, gdk, gdv)):
        path = ops.call_path(kernels.select, q, k, v, mask, scale, causal)
    return autograd.run_bob(True, path, None, q, k, v, o, lse, do, None, gdq, gdk, gdv, dq,
                            mask, scale, causal)[:4]


# --------------------------------------------------------------------------------------
# Masked calls: the op's Triton kernels in the C++ nodes, replayed from programs
# --------------------------------------------------------------------------------------
# PyTorch's fused kernels take no mask that skips hidden tiles, so a masked call's stages are
# the Triton kernels (its forward with the mask's summary, its first backward, the folded
# BoB). The nodes run them as they run the fused ones (kernels TRITON): each stage from a
# program of its launches where the node holds one for the call's signature (made from a
# recording of the first Python run that took replayable paths: programs.py), else
# through run_triton_stage below. The mask's summary is made by the forward's program and
# kept in the node for the backwards.
def masked_output(q, k, v, mask, scale, causal, needs_graph):
    """o of a plain eager call with a mask through the C++ node (needs_graph as for
    unmasked_output); None where the node does not apply: inputs the Triton kernels do not
    take or an empty length, forward-mode AD, the profiler, a compiled graph's kernel
    choices, Triton's own launcher (fast launches off), or the node not built yet."""
    if _something_intercepts():
        return None
    if not (q.is_cuda and q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and q.shape[2]
            and k.shape[2]):
        return None
    settings = kernel_settings.current()
    if not settings.fast_launch or settings.cpp_node == "off" \
            or kernels.select(q, k, v) is not triton_attention:
        return None
    module = _extension if _extension is not None else extension()
    if module is None:
        return None
    fold = kernels.fold_bob(q, k, v)
    # from the next call of this signature on, the C++ entry runs what follows (fast_entry)
    module.remember_route(q, k, v, mask, scale, causal, module.TRITON, fold)
    mask = ops.flat_mask(mask, q, k)
    if needs_graph:
        return module.attention(q, k, v, mask, scale, causal, module.TRITON, fold)[0]
    return module.forward_output(q, k, v, mask, scale, causal, module.TRITON)


def _forward_stage(q, k, v, mask, scale, causal):
    summary = triton_masks.mask_summary(mask)
    params = AttentionParams(scale=scale, causal=causal, mask=mask, mask_summary=summary)
    o, lse = triton_attention.attention_forward(q, k, v, params)
    return (o, 0), (lse, None), (summary, None)


def _backward_stage(q, k, v, o, lse, do, mask, key_range, scale, causal):
    params = AttentionParams(scale=scale, causal=causal, mask=mask, mask_summary=key_range)
    dq, dk, dv = triton_attention.attention_backward(
        q, k, v, o, lse, do, None, params, dq_atomics=kernel_settings.current().bwd_dq_atomics)
    return (dq, 0), (dk, 1), (dv, 2)


def _bob_stage(q, k, v, o, lse, do, dq, gdq, gdk, gdv, mask, key_range, keys_out, scale,
               causal):
    params = AttentionParams(scale=scale, causal=causal, mask=mask, mask_summary=key_range)
    gq, gk, gv, gdo, _ = triton_attention.bob_folded(q, k, v, o, lse, do, None, gdq, gdk, gdv,
                                                     dq, params, keys_out=keys_out)
    return (gq, 0), (gk, 1), (gv, 2), (gdo, 5)


# by the node's stage numbers (module.STAGES): (output, the input it is laid out like), each
_STAGES = (_forward_stage, _backward_stage, _bob_stage)


def run_triton_stage(stage, inputs, scale, causal, wants_program):
    """A Triton stage for the node (native_node.cpp run_stage), by Python: its outputs, each
    laid out like its input. wants_program: recorded, and its program handed to the node,
    or, where every launch took a replayable path and still the stage cannot be replayed
    (an op besides allocations and views), the mark that it has none. Nothing is recorded
    under Triton's own launcher (fast launches off), whose launches cannot be replayed."""
    run = _STAGES[stage]
    if not wants_program or not kernel_settings.current().fast_launch:
        return _laid_out(run(*inputs, scale, causal), inputs)
    with programs.recorded_stage() as recorded:
        outputs = run(*inputs, scale, causal)
    module = _extension
    if module is not None:
        program = recorded.program(module, inputs, outputs)
        if program is not None:
            module.register_program(stage, list(inputs), scale, causal, True, *program)
        elif programs.replays_complete(recorded.record):
            log.info("bob_compile: the %s stage runs from Python for this signature (its "
                     "recording cannot be replayed)", module.STAGES[stage])
            module.register_program(stage, list(inputs), scale, causal, False, [], [], [])
    return _laid_out(outputs, inputs)


def _laid_out(outputs, inputs):
    return tuple(t if like is None else layout.in_order_of(t, inputs[like])
                 for t, like in outputs)
