"""Launching the Triton kernels: every launch's keyword arguments (constexprs, block sizes,
warps, stages) are chosen once per tuning bucket and remembered (`launch_plan`), and
repeated launches go straight to the compiled kernel (`LaunchPlan`), so a call costs the
allocation of its outputs, its launches and little else (benchmarks/bench_host_overhead.py
measures it). Launch sites pass arguments by name (`strides_of`, `packer`); `recording`
lists what ran, for the C++ node's programs (bob_compile/eager/node.py).
"""
import inspect
import threading

import torch
import triton.language as tl

from . import settings
from . import tuning
from .tuning import choose_config, length_bucket, tuning_key

# --------------------------------------------------------------------------------------
# Launching: what is fixed per launch site and bucket is worked out once
# --------------------------------------------------------------------------------------
# A launch through JITFunction.run binds and specializes every argument (up to 64 here),
# hashes the result to find the compiled kernel, then launches. Even a CompiledKernel's own
# launch (`compiled[grid](*args)`) asks for the current device and stream, builds launch
# metadata for hooks, calls two (empty) Python hook chains from C, and for each tensor
# calls its data_ptr() method and asks the driver to validate the pointer
# (cuPointerGetAttribute): 15 us per launch on the H200's host, against 6.4 us for the C
# launcher called directly, more than the kernel itself at short lengths
# (docs/measurements.md, host overhead).
#
# The specialization depends only on: each tensor's dtype and whether its address is
# 16-byte aligned, each int's value (== 1 becomes a constant, multiples of 16 are marked,
# the width is 32 or 64 bit), the constexprs and options, and the current device.
# LaunchPlan keys the compiled kernel on exactly those properties (ints by value), so a
# later launch that specializes the same way goes straight to that kernel's C launcher
# with the tensors' addresses as integers, the current stream, and no hooks, as inductor
# launches its kernels. Anything else (a new specialization, a Triton launch hook set by
# a profiler such as proton, a kernel that needs scratch memory, a launcher of another
# shape) takes Triton's own path.
_MAX_SPECIALIZATIONS = 64   # per plan; varying lengths would otherwise grow it forever
_OPTIONS = ("num_warps", "num_stages", "maxnreg")


def _current_device():
    return torch._C._cuda_getDevice()


def _layout(args):
    """(number of tensors, number of ints) when args are tensors, then Python ints, then
    Python floats, as at every launch site here; None otherwise (no fast path)."""
    n = len(args)
    nt = 0
    while nt < n and isinstance(args[nt], torch.Tensor):
        nt += 1
    ni = nt
    while ni < n and type(args[ni]) is int:
        ni += 1
    if any(type(a) is not float for a in args[ni:]):
        return None
    return nt, ni - nt


try:
    from triton import knobs as _knobs
    from triton.knobs import HookChain as _HookChain
except ImportError:  # an older Triton: hooks cannot be inspected, so never skip them
    _knobs = _HookChain = None


def _no_launch_hooks():
    """True when no Triton launch hook is set (then the C launcher need not call any)."""
    if _knobs is None:
        return False
    runtime = _knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and not (type(hook) is _HookChain and not hook.calls):
            return False
    return True


class DirectLaunch:
    """A compiled kernel's C launcher entry point, with what it needs besides the arguments
    (the loaded function, its packed metadata, the launch flags). `of(compiled)` is None
    when the kernel cannot be launched this way (scratch memory, an unknown launcher)."""
    __slots__ = ("compiled", "launch", "function", "metadata", "cooperative", "pdl")

    def __init__(self, compiled, launcher):
        self.compiled = compiled
        self.launch = launcher.launch
        self.function = compiled.function
        self.metadata = compiled.packed_metadata
        self.cooperative = launcher.launch_cooperative_grid
        self.pdl = launcher.launch_pdl

    @classmethod
    def of(cls, compiled):
        try:
            launcher = compiled.run     # loads the kernel's handles if not done yet
            if launcher.global_scratch_size or launcher.profile_scratch_size:
                return None
            return cls(compiled, launcher)
        except AttributeError:
            return None



def _raw_stream(device):
    return torch._C._cuda_getCurrentRawStream(device)


# --------------------------------------------------------------------------------------
# Arguments by name
# --------------------------------------------------------------------------------------
# Launch sites pass a kernel's tensors and scalars by name; the four strides of each
# (B, H, N, X) operand are derived from the tensor itself. Each kernel declares, once,
# which tensor parameter each group of four stride parameters belongs to
# (`strides_of(kernel, Q="sq", ...)`: the parameters sqb, sqh, sql|sqn, sqe are Q's
# strides), and gets a packer: a function of its tensors and scalars by keyword only that
# returns every runtime argument in the kernel's order. It is generated code, so Python's
# own binding checks the names (a missing, unexpected or misspelled one is a TypeError that
# names it), for 1.6 us more per launch than positional arguments (3.2 against 1.6 us for
# the BoB row kernel's 51 arguments on a 2-core CI-class CPU).
_packers = {}
_stride_owners = {}     # kernel -> {stride parameter: (its tensor parameter, dimension)}


def _runtime_parameter_names(kernel):
    """The names of the kernel's non-constexpr parameters, in order (a JITFunction lists
    its params; under TRITON_INTERPRET=1 the kernel is an InterpretedFunction, whose
    Python signature's annotations say which parameters are constexprs)."""
    params = getattr(kernel, "params", None)
    if params is not None:
        return [p.name for p in params if not p.is_constexpr]
    return [name for name, p in inspect.signature(kernel.fn).parameters.items()
            if not (p.annotation is tl.constexpr or p.annotation == "tl.constexpr")]


def strides_of(kernel, **groups):
    """Declare kernel's stride parameters: tensor parameter name -> stride prefix (see
    above); make its packer. Returns the kernel."""
    names = _runtime_parameter_names(kernel)
    owner = {}
    for tensor, prefix in groups.items():
        row = "l" if f"{prefix}l" in names else "n"
        for dim, suffix in enumerate(("b", "h", row, "e")):
            name = prefix + suffix
            if name not in names or tensor not in names:
                raise ValueError(f"{kernel.fn.__name__}: no parameter {name!r} or {tensor!r}")
            owner[name] = f"_{tensor}[{dim}]"
            _stride_owners.setdefault(kernel, {})[name] = (tensor, dim)
    given = [n for n in names if n not in owner]
    strides = "".join(f"    _{tensor} = {tensor}.stride()\n" for tensor in groups)
    body = ", ".join(owner.get(n, n) for n in names)
    namespace = {}
    exec(f"def {kernel.fn.__name__}(*, {', '.join(given)}):\n{strides}    return ({body},)\n",
         namespace)
    _packers[kernel] = namespace[kernel.fn.__name__]
    return kernel


def packer(kernel):
    """The function that packs kernel's runtime arguments from its tensors and scalars by
    name (declared with strides_of)."""
    return _packers[kernel]


def runtime_parameters(kernel):
    """(names of kernel's runtime parameters in order, {stride parameter: (tensor parameter,
    dimension)}) as strides_of declared them."""
    return _runtime_parameter_names(kernel), _stride_owners.get(kernel, {})


# --------------------------------------------------------------------------------------
# Recording launches (the C++ node's programs: bob_compile/eager/programs.py)
# --------------------------------------------------------------------------------------
class Recording:
    """What ran inside `recording()` on this thread: `launches`, one (kernel, grid, args,
    direct, kept) per LaunchPlan launch (args: the runtime arguments in the kernel's order;
    direct: the DirectLaunch the launch went through, None where it took another path;
    kept: whether the plan is a remembered one, not a provisional choice)."""
    __slots__ = ("launches",)

    def __init__(self):
        self.launches = []


class _RecordingState(threading.local):
    record = None


_recording = _RecordingState()


class recording:
    """Context manager: records this thread's launches into the Recording it returns."""

    def __enter__(self):
        self.previous, _recording.record = _recording.record, Recording()
        return _recording.record

    def __exit__(self, *exc):
        _recording.record = self.previous


class LaunchPlan:
    """One launch site at one tuning bucket: `kwargs` (constexprs, BLOCK_M/BLOCK_N,
    num_warps, num_stages) and the compiled kernels seen so far, by specialization.

    plan(kernel, grid, **args) is kernel[grid](**args, **plan.kwargs): args are the
    kernel's tensors and scalars by name, its strides derived from the tensors (see
    "Arguments by name"), and grid has two dimensions. The key of a compiled
    kernel is what Triton specializes on (see above): the current device, the ints by
    value, each tensor's dtype and 16-byte alignment; floats are passed as fp32 and never
    specialized."""
    __slots__ = ("kwargs", "kept", "_compiled", "_constexprs", "_layout")

    def __init__(self, kwargs):
        self.kwargs = kwargs
        self.kept = False         # remembered per site and bucket (launch_plan, fixed_plan)
        self._compiled = {}       # key -> DirectLaunch, or CompiledKernel where it cannot
        self._constexprs = None   # their values in the kernel's parameter order; False: none
        self._layout = None       # (tensors, ints) among the runtime arguments; False: none

    def __call__(self, kernel, grid, **named):
        self.launch(kernel, grid, *_packers[kernel](**named))

    def launch(self, kernel, grid, *args):
        """plan(...) with the runtime arguments already in the kernel's order."""
        if not settings.current().fast_launch:   # off in the interpreter
            kernel[grid](*args, **self.kwargs)
            return
        record = _recording.record
        if record is not None:      # launch as usual, then record what the launch went through
            _recording.record = None
            try:
                self.launch(kernel, grid, *args)
            finally:
                _recording.record = record
            record.launches.append((kernel, grid, args, self._direct_launch(args), self.kept))
            return
        layout = self._layout
        if layout:
            # the hot path: inlined (a Python call costs ~0.5 us on a server's host)
            nt, ni = layout
            pointers = [t.data_ptr() for t in args[:nt]]
            aligned = 0
            for p in pointers:
                aligned = aligned + aligned + (p % 16 == 0)
            device = _current_device()
            key = (device, args[nt:nt + ni], tuple([t.dtype for t in args[:nt]]), aligned)
            entry = self._compiled.get(key)
            floats = True
            for a in args[nt + ni:]:
                if type(a) is not float:
                    floats = False
                    break
            if entry is not None and floats:
                if type(entry) is DirectLaunch and _no_launch_hooks():
                    try:
                        entry.launch(grid[0], grid[1], 1, _raw_stream(device), entry.function,
                                     entry.cooperative, entry.pdl, None, None, entry.metadata,
                                     None, None, None, *pointers, *args[nt:], *self._constexprs)
                        return
                    except TypeError:
                        # the launcher parses its arguments before launching: one with
                        # another calling convention launches nothing and raises here;
                        # this kernel takes Triton's path from now on
                        self._compiled[key] = entry = entry.compiled
                # CompiledKernel[grid] takes every parameter positionally, constexprs
                # included (their values are not passed to the GPU), and a 3-D grid
                compiled = entry.compiled if type(entry) is DirectLaunch else entry
                compiled[(*grid, 1)](*args, *self._constexprs)
                return
        compiled = kernel[grid](*args, **self.kwargs)   # Triton's path (compiles if new)
        if layout is None:   # first launch: may this site take the fast path at all?
            fits = self._constexpr_values(kernel, len(args))
            self._layout = layout = (_layout(args) or False) if fits else False
            if layout:
                nt = layout[0]
                pointers = [t.data_ptr() for t in args[:nt]]
                device = _current_device()
                key = self._key(args, layout, pointers, device)
        if layout and isinstance(compiled, _CompiledKernel):
            if len(self._compiled) >= _MAX_SPECIALIZATIONS:
                self._compiled.clear()
            self._compiled[key] = DirectLaunch.of(compiled) or compiled

    def _direct_launch(self, args):
        """The DirectLaunch a launch with these arguments takes, or None where it takes
        another path."""
        if not (self._layout and self._constexprs not in (None, False) and _no_launch_hooks()):
            return None
        nt = self._layout[0]
        key = self._key(args, self._layout, [t.data_ptr() for t in args[:nt]], _current_device())
        entry = self._compiled.get(key)
        return entry if type(entry) is DirectLaunch else None

    @staticmethod
    def _key(args, layout, pointers, device):
        """The key of a compiled kernel (the hot path in `launch` computes it inline)."""
        nt, ni = layout
        aligned = 0
        for p in pointers:
            aligned = aligned + aligned + (p % 16 == 0)
        return (device, args[nt:nt + ni], tuple([t.dtype for t in args[:nt]]), aligned)

    def _constexpr_values(self, kernel, num_args):
        """Whether args + kwargs fill the kernel's parameters as runtime arguments followed
        by constexprs (true for every kernel here); remembers the constexprs' values."""
        if self._constexprs is None:
            params = kernel.params
            tail = params[num_args:]
            names = {p.name for p in tail}
            fits = (all(not p.is_constexpr for p in params[:num_args])
                    and all(p.is_constexpr and p.name in self.kwargs for p in tail)
                    and all(k in names or k in _OPTIONS for k in self.kwargs))
            self._constexprs = tuple(self.kwargs[p.name] for p in tail) if fits else False
        return self._constexprs is not False


try:
    from triton.compiler import CompiledKernel as _CompiledKernel
except ImportError:  # a Triton without it: every launch takes Triton's path
    class _CompiledKernel:
        pass


def _plan_of(constexprs, cfg):
    """The LaunchPlan of a candidate config (BLOCK_M, BLOCK_N, num_warps, num_stages, and
    optionally maxnreg: a bound on registers per thread)."""
    return LaunchPlan(dict(constexprs, **{name: cfg[name] for name in
                                          ("BLOCK_M", "BLOCK_N", *_OPTIONS) if name in cfg}))


def launch_plan(kernel, q, k, v, causal, flags, candidates, constexprs, launch, pairs,
                has_work=None):
    """The LaunchPlan of one launch site: `constexprs()` plus the chosen config's BLOCK_M,
    BLOCK_N, num_warps and num_stages. Chosen (tuned, or read from the tuning cache) on the
    first call per (kernel, device, dtype, head dims, causal, flags, length buckets) and
    then remembered, so that later calls skip the candidate lists, the string key and the
    lock: one dict lookup. `candidates()` returns the candidate configs, `launch(plan)`
    launches once (timed while tuning); flags are the extra parts of `tuning_key`, whose
    persistent keys stay as they were; has_work: see choose_config."""
    chosen = tuning.TUNING_CACHE.chosen
    memo = (kernel, q.device, q.dtype, q.shape[-1], v.shape[-1], causal, flags,
            length_bucket(q.shape[-2]), length_bucket(k.shape[-2]))
    plan = chosen.get(memo)
    if plan is not None:
        return plan
    fixed = constexprs()

    def as_plan(cfg):
        return _plan_of(fixed, cfg)

    cfg, final = choose_config(tuning_key(kernel, q, k, v, causal, *flags), candidates(),
                                lambda c: launch(as_plan(c)), pairs, has_work)
    plan = as_plan(cfg)
    if final:
        chosen[memo] = plan
        plan.kept = True
    return plan


def read_path_first(candidates, best):
    """The candidates with `best` first: the read path's measured best, where it is one."""
    return [best] + [c for c in candidates if c != best] if best in candidates else candidates


_fixed_plans = {}


def fixed_plan(key, kwargs):
    """The LaunchPlan of a launch site without tuning (kwargs() is called once per key)."""
    plan = _fixed_plans.get(key)
    if plan is None:
        plan = _fixed_plans[key] = LaunchPlan(kwargs())
        plan.kept = True
    return plan
