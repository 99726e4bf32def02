"""The switches of the kernels: read from the environment in one place, once, and
overridable per compiled graph.

Reading `os.environ` costs about a microsecond per variable, and the op's call path used to
read up to a dozen of them per call. They are read on first use (the first op call, or the
first `current()`) into one `Settings` object, and each value is checked then: an unknown
value is a ValueError that lists the valid ones. A program that changes one of these
variables after that, in its own process (tests, benchmarks comparing schedules), calls
`reload()`; a variable set before the process starts, or before the first call, needs
nothing.

SWITCHES below is the one description of every variable: docs/settings.md is generated from
it with the backend's options (`python -m bob_compile.settings_doc > docs/settings.md`; a
test keeps them equal).
Users' switches are `BOB_COMPILE_*`; the developers' (one schedule or rounding against
another, for measurements) are `BOB_COMPILE_DEV_*`. Per compiled graph, the flashbob
backend's options named in the table replace the matching variables while that graph's
code runs, in every order of derivative (`using()`, `overridden()`; bob_compile/options.py).
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
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "bob_compile")


@dataclass(frozen=True)
class Switch:
    variable: str
    choices: Optional[tuple]      # None: any text (a path)
    default: Optional[str]        # None: unset (its meaning is in `what`)
    what: str
    option: Optional[str] = None  # the flashbob option that overrides it per compiled graph

    @property
    def developer(self):
        return self.variable.startswith("BOB_COMPILE_DEV_")

    def read(self, env):
        """env's value if valid (unset or empty: the default), else a ValueError."""
        value = env.get(self.variable) or self.default
        if value is not None and self.choices is not None and value not in self.choices:
            raise ValueError(f"{self.variable}={value!r}: expected one of "
                             f"{', '.join(self.choices)} (or unset; see docs/settings.md)")
        return value


SWITCHES = (
    Switch("BOB_COMPILE_KERNELS", KERNELS, None,
           "force one implementation (unset: Triton on supported CUDA inputs, else "
           "blockwise; `reference` holds O(L·S) memory, for debugging)", option="kernels"),
    Switch("BOB_COMPILE_NATIVE_BACKEND", NATIVE_BACKENDS, None,
           "which of PyTorch's fused kernels compute the first order of half-precision "
           "calls without a mask (unset: cuDNN up to head dim 128, none above; `none`: "
           "always Triton)", option="native_backend"),
    Switch("BOB_COMPILE_TUNE", SWITCH, "1",
           "time candidate launch configs at the first call per shape class (`0`: the "
           "first candidate that builds on the device)", option="tune"),
    Switch("BOB_COMPILE_CACHE_DIR", None, DEFAULT_CACHE_DIR,
           "where tuned launch configs and the C++ node's build are kept"),
    Switch("BOB_COMPILE_CPP_NODE", CPP_NODE_BUILDS, "background",
           "build the C++ autograd nodes on first use in a background thread (the Python "
           "node runs meanwhile), before that call returns, or never "
           "(docs/host-overhead.md)"),
    Switch("BOB_COMPILE_DEV_BOB_FORM", BOB_FORMS, "auto",
           "the factorization of the second order: `auto` folds up to head dim 128 "
           "(docs/second-order.md)", option="bob_form"),
    Switch("BOB_COMPILE_DEV_BOB_SCHEDULE", SCHEDULES, "two_pass",
           "the BoB's row outputs: a deterministic second pass, or fp32 atomics (chain form "
           "only)", option="bob_schedule"),
    Switch("BOB_COMPILE_DEV_BWD_DQ", SCHEDULES, "two_pass",
           "the same choice for dq in the Triton backward", option="bwd_dq"),
    Switch("BOB_COMPILE_DEV_SBAR_SPLIT", SWITCH, "0",
           "`1`: the BoB row pass multiplies the score cotangent by k as two half-precision "
           "GEMMs (high and low part) on every tile: gq's bf16 error 2.06e-3 instead of "
           "2.3e-3 causal, ~5 % more time (triton_bob.py)"),
    Switch("BOB_COMPILE_DEV_EDGE_SPLIT", SWITCH, "1",
           "`1`: the same two-part GEMMs on the row pass's masked tiles only (the causal "
           "diagonal, a mask's edges), where most of gq's and gdo's rounding error is, for "
           "< 1 % of the time (triton_bob.py)"),
    Switch("BOB_COMPILE_DEV_RELATIVE_ROWS", SWITCH, "0",
           "`1`: a flex_attention score_mod bias that reads q_idx - kv_idx alone, whose "
           "materialized form would exceed 1 GiB, reaches the kernels as one row of "
           "L + S - 1 values per head with the mask's tiles (kernels/block_sparse_masks.py), "
           "added in every loop, the mask applied from its intervals where it has them; off "
           "until timed on a GPU in that form (docs/measurements.md)"),
    Switch("BOB_COMPILE_DEV_SOFTCAP_RECIPROCAL", ("mufu", "newton"), "mufu",
           "soft-capped scores: the reciprocal inside tanh on the multifunction unit, or by "
           "three Newton iterations on the FMA units (a capped pair needs the multifunction "
           "unit three times against once uncapped; triton_softcap.py); not yet timed"),
    Switch("BOB_COMPILE_DEV_FAST_LAUNCH", SWITCH, "1",
           "reuse the compiled kernel of an earlier launch that specialized the same way, "
           "through its C launcher (`0`: every launch through `JITFunction.run`; "
           "launching.py)"),
)
_SWITCH = {switch.variable: switch for switch in SWITCHES}
# Variables an earlier version read: setting one is an error that says what replaced it.
RENAMED = {
    "BOB_COMPILE_NATIVE_SDPA": "BOB_COMPILE_NATIVE_BACKEND=none (for NATIVE_SDPA=0)",
    **{old: f"BOB_COMPILE_DEV_{old[len('BOB_COMPILE_'):]}" for old in (
        "BOB_COMPILE_BOB_FORM", "BOB_COMPILE_BOB_SCHEDULE", "BOB_COMPILE_BWD_DQ",
        "BOB_COMPILE_SBAR_SPLIT", "BOB_COMPILE_EDGE_SPLIT", "BOB_COMPILE_FAST_LAUNCH")},
}


@dataclass(frozen=True)
class Settings:
    kernels: Optional[str]            # None: automatic choice
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
    relative_rows: bool = False
    softcap_reciprocal: str = "mufu"

    @classmethod
    def from_environ(cls, environ=None):
        env = os.environ if environ is None else environ
        for old in RENAMED:
            if env.get(old):
                raise ValueError(f"{old} was renamed: set {RENAMED[old]} instead "
                                 f"(see docs/settings.md)")

        def read(variable):
            return _SWITCH[variable].read(env)
        interpret = env.get("TRITON_INTERPRET", "0") == "1"
        return cls(
            kernels=read("BOB_COMPILE_KERNELS"),
            native_backend=read("BOB_COMPILE_NATIVE_BACKEND"),
            bwd_dq_atomics=read("BOB_COMPILE_DEV_BWD_DQ") == "atomic",
            bob_row_atomics=read("BOB_COMPILE_DEV_BOB_SCHEDULE") == "atomic",
            bob_form=read("BOB_COMPILE_DEV_BOB_FORM"),
            sbar_split=read("BOB_COMPILE_DEV_SBAR_SPLIT") == "1",
            edge_split=read("BOB_COMPILE_DEV_EDGE_SPLIT") == "1",
            tune=read("BOB_COMPILE_TUNE") == "1" and not interpret,
            cache_dir=os.path.expanduser(read("BOB_COMPILE_CACHE_DIR")),
            interpret=interpret,
            fast_launch=read("BOB_COMPILE_DEV_FAST_LAUNCH") == "1" and not interpret,
            cpp_node=read("BOB_COMPILE_CPP_NODE"),
            relative_rows=read("BOB_COMPILE_DEV_RELATIVE_ROWS") == "1",
            softcap_reciprocal=read("BOB_COMPILE_DEV_SOFTCAP_RECIPROCAL"),
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
    reads it directly: bob_compile/eager/node.py)."""
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
