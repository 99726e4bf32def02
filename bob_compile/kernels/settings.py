"""The switches of the kernels: read from the environment in one place, once, and
overridable per compiled graph.

Reading `os.environ` costs about a microsecond per variable, and the op's call path used to
read up to a dozen of them per call. They are now read on first use (the first op call, or
the first `current()`) into one `Settings` object, and each value is checked then: an
unknown value is a ValueError that lists the valid ones. A program that changes one of
these variables after that, in its own process (tests, benchmarks comparing schedules),
calls `reload()` to make the change take effect; a variable set before the process
starts, or before the first call, needs nothing.

    BOB_COMPILE_KERNELS         blockwise | reference | triton: force an implementation
                                (unset or empty: Triton on supported CUDA inputs, else
                                blockwise)
    BOB_COMPILE_NATIVE_SDPA     1 | 0: 0 never calls PyTorch's fused first-order kernels
    BOB_COMPILE_NATIVE_BACKEND  cudnn | flash | none: which of them (unset: cudnn for head
                                dims <= 128, none above)
    BOB_COMPILE_BWD_DQ          two_pass (default) | atomic: dq of the Triton backward
    BOB_COMPILE_BOB_SCHEDULE    two_pass (default) | atomic: BoB row outputs (atomic: chain
                                form only)
    BOB_COMPILE_BOB_FORM        auto (default) | folded | chain: how a second-order step
                                factors (docs/second-order.md; kernels.fold_bob)
    BOB_COMPILE_SBAR_SPLIT      1 | 0: 1 multiplies the BoB row pass's score cotangent by k
                                as two half-precision parts (high and low), one GEMM more
                                per tile for gq's accuracy (triton_bob.py)
    BOB_COMPILE_EDGE_SPLIT      1 (default) | 0: 1 does the same on the row pass's masked
                                tiles (the causal diagonal, a mask's edges) for the score
                                cotangent, dS, P and A: gq's and gdo's accuracy for a
                                fraction of a percent of the time (triton_bob.py)
    BOB_COMPILE_TUNE            1 | 0: 0 takes the first candidate launch config, no timing
    BOB_COMPILE_FAST_LAUNCH     1 | 0: 0 sends every Triton launch through JITFunction.run
                                (default: a launch that specializes like an earlier one
                                reuses its compiled kernel, called directly; triton_common.py)
    BOB_COMPILE_CACHE_DIR       where tuned launch configs and the C++ node's build are
                                kept (default ~/.cache/bob_compile)
    BOB_COMPILE_CPP_NODE        background (default) | wait | off: how the C++ autograd node
                                of the first order is built on first use (in a background
                                thread, the Python node running until it is ready; before
                                that first call returns; never: bob_compile/native_node.py)
    TRITON_INTERPRET            1: the Triton kernels run in Triton's interpreter (Triton
                                itself reads it when the kernels are defined)

Per compiled graph, the flashbob backend's options `kernels`, `native_backend`, `bwd_dq`,
`bob_schedule`, `bob_form` and `tune` replace the matching variables while that graph's code runs, in
every order of derivative (`using()`, `overridden()`; bob_compile/options.py).
"""
import contextlib
import contextvars
import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

KERNELS = ("blockwise", "reference", "triton")
NATIVE_BACKENDS = ("cudnn", "flash", "none")
SCHEDULES = ("two_pass", "atomic")
BOB_FORMS = ("auto", "folded", "chain")
SWITCH = ("1", "0")
CPP_NODE_BUILDS = ("background", "wait", "off")


def _choice(env, name, valid, default=None):
    """env[name] if it is one of `valid` (unset or empty: default), else a ValueError."""
    value = env.get(name) or default
    if value is not None and value not in valid:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(valid)} "
                         f"(or unset; see bob_compile/kernels/settings.py)")
    return value


@dataclass(frozen=True)
class Settings:
    kernels: Optional[str]            # None: automatic choice
    native_sdpa: bool
    native_backend: Optional[str]     # None: the default by head dim
    bwd_dq_atomics: bool
    bob_row_atomics: bool
    bob_form: str
    sbar_split: bool
    edge_split: bool
    tune: bool
    cache_dir: str
    interpret: bool
    fast_launch: bool
    cpp_node: str

    @classmethod
    def from_environ(cls, environ=None):
        env = os.environ if environ is None else environ
        interpret = env.get("TRITON_INTERPRET", "0") == "1"
        return cls(
            kernels=_choice(env, "BOB_COMPILE_KERNELS", KERNELS),
            native_sdpa=_choice(env, "BOB_COMPILE_NATIVE_SDPA", SWITCH, "1") == "1",
            native_backend=_choice(env, "BOB_COMPILE_NATIVE_BACKEND", NATIVE_BACKENDS),
            bwd_dq_atomics=_choice(env, "BOB_COMPILE_BWD_DQ", SCHEDULES, "two_pass") == "atomic",
            bob_row_atomics=_choice(env, "BOB_COMPILE_BOB_SCHEDULE", SCHEDULES,
                                    "two_pass") == "atomic",
            bob_form=_choice(env, "BOB_COMPILE_BOB_FORM", BOB_FORMS, "auto"),
            sbar_split=_choice(env, "BOB_COMPILE_SBAR_SPLIT", SWITCH, "0") == "1",
            edge_split=_choice(env, "BOB_COMPILE_EDGE_SPLIT", SWITCH, "1") == "1",
            tune=_choice(env, "BOB_COMPILE_TUNE", SWITCH, "1") == "1" and not interpret,
            cache_dir=env.get("BOB_COMPILE_CACHE_DIR",
                              os.path.join(os.path.expanduser("~"), ".cache", "bob_compile")),
            interpret=interpret,
            fast_launch=_choice(env, "BOB_COMPILE_FAST_LAUNCH", SWITCH, "1") == "1"
            and not interpret,
            cpp_node=_choice(env, "BOB_COMPILE_CPP_NODE", CPP_NODE_BUILDS, "background"),
        )

    def with_choices(self, choices):
        """These settings with a compiled graph's kernel choices (KernelChoices) applied."""
        changes = {name: value for name, value in dataclasses.asdict(choices).items()
                   if value is not None}
        if "tune" in changes:
            changes["tune"] = changes["tune"] and not self.interpret
        return dataclasses.replace(self, **changes) if changes else self


@dataclass(frozen=True)
class KernelChoices:
    """Kernel settings chosen for one compiled graph (None: the environment's); the
    flashbob options `kernels`, `native_backend`, `bwd_dq`, `bob_schedule`, `bob_form`,
    `tune`."""
    kernels: Optional[str] = None
    native_backend: Optional[str] = None
    bwd_dq_atomics: Optional[bool] = None
    bob_row_atomics: Optional[bool] = None
    bob_form: Optional[str] = None
    tune: Optional[bool] = None

    @classmethod
    def of(cls, **choices):
        """KernelChoices of the choices made, or None when none is (then nothing needs to
        be applied, and callers test `is None`, which costs nothing on the hot path)."""
        made = {name: value for name, value in choices.items() if value is not None}
        return cls(**made) if made else None


_current: Optional[Settings] = None
_listeners = []


# The kernel choices of the compiled graph whose code is running (None: none of its own).
_choices = contextvars.ContextVar("bob_compile_kernel_choices", default=None)


def current() -> Settings:
    """The settings: the environment's (read on the first call), with the kernel choices
    of the compiled graph that is running, if it has any."""
    s = _current
    if s is None:
        s = reload()
    choices = _choices.get()
    if choices is None:
        return s
    applied = _applied.get(choices)
    if applied is None or applied[0] is not s:
        if len(_applied) >= 64:
            _applied.clear()
        applied = _applied[choices] = (s, s.with_choices(choices))
    return applied[1]


_applied = {}   # choices -> (environment settings, those settings with the choices applied)


def kernel_choices_variable():
    """The contextvar holding the kernel choices in force (for the C++ node's entry, which
    reads it directly: bob_compile/native_node.py)."""
    return _choices


def overridden():
    """The kernel choices in force (KernelChoices), or None: what an autograd node saves
    at forward time so that its backward, run later on the autograd engine's thread,
    uses the same kernels."""
    return _choices.get()


@contextlib.contextmanager
def using(choices):
    """Run a compiled graph's code with its kernel choices (None: no change)."""
    if choices is None:
        yield
        return
    token = _choices.set(choices)
    try:
        yield
    finally:
        _choices.reset(token)


def run_with(choices, fn, *args):
    """fn(*args) under these kernel choices; with None (the usual case), just fn(*args)."""
    if choices is None:
        return fn(*args)
    with using(choices):
        return fn(*args)


def reload() -> Settings:
    """Read the environment again (after changing a variable in this process) and drop what
    was derived from the previous values (chosen launch configs, the tuning cache's path)."""
    global _current
    _current = Settings.from_environ()
    for listener in _listeners:
        listener(_current)
    return _current


def on_reload(listener):
    """Call listener(settings) after every reload (modules that cache derived values)."""
    _listeners.append(listener)
    return listener
