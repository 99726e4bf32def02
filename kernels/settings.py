"""The environment switches of the kernels, read in one place, once.

Reading `os.environ` costs about a microsecond per variable, and the op's call path used to
read up to a dozen of them per call. They are now read on first use (the first op call, or
the first `current()`) into one `Settings` object. A program that changes one of these
variables after that, in its own process (tests, benchmarks comparing schedules), calls
`reload()` to make the change take effect; a variable set before the process starts, or
before the first call, needs nothing.

    BOB_COMPILE_KERNELS         blockwise | reference | triton: force an implementation
                                (unset or empty: Triton on supported CUDA inputs, else
                                blockwise); an unknown value is an error at the first call
    BOB_COMPILE_NATIVE_SDPA     0: never call PyTorch's fused first-order kernels
    BOB_COMPILE_NATIVE_BACKEND  cudnn | flash | none: which of them (default: cudnn for head
                                dims <= 128, none above)
    BOB_COMPILE_BWD_DQ          atomic | two_pass (default): dq of the Triton backward
    BOB_COMPILE_BOB_SCHEDULE    atomic | two_pass (default): BoB row outputs
    BOB_COMPILE_TUNE            0: the first candidate launch config, no timing
    BOB_COMPILE_FAST_LAUNCH     0: every Triton launch through JITFunction.run (default:
                                a launch whose arguments specialize exactly like an earlier
                                one reuses that launch's compiled kernel; triton_common.py)
    BOB_COMPILE_CACHE_DIR       where tuned launch configs are kept
                                (default ~/.cache/bob_compile)
    TRITON_INTERPRET            1: the Triton kernels run in Triton's interpreter (Triton
                                itself reads it when the kernels are defined)

The meaning of every value is unchanged from when each was read per call
(BOB_COMPILE_FAST_LAUNCH is new).
"""
import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Settings:
    kernels: Optional[str]            # None: automatic choice
    native_sdpa: bool
    native_backend: Optional[str]     # None: the default by head dim
    bwd_dq_atomics: bool
    bob_row_atomics: bool
    tune: bool
    cache_dir: str
    interpret: bool
    fast_launch: bool

    @classmethod
    def from_environ(cls, environ=None):
        env = os.environ if environ is None else environ
        interpret = env.get("TRITON_INTERPRET", "0") == "1"
        return cls(
            kernels=env.get("BOB_COMPILE_KERNELS") or None,
            native_sdpa=env.get("BOB_COMPILE_NATIVE_SDPA", "1") != "0",
            native_backend=env.get("BOB_COMPILE_NATIVE_BACKEND"),
            bwd_dq_atomics=env.get("BOB_COMPILE_BWD_DQ", "two_pass") == "atomic",
            bob_row_atomics=env.get("BOB_COMPILE_BOB_SCHEDULE", "two_pass") == "atomic",
            tune=env.get("BOB_COMPILE_TUNE", "1") != "0" and not interpret,
            cache_dir=env.get("BOB_COMPILE_CACHE_DIR",
                              os.path.join(os.path.expanduser("~"), ".cache", "bob_compile")),
            interpret=interpret,
            fast_launch=env.get("BOB_COMPILE_FAST_LAUNCH", "1") != "0" and not interpret,
        )


_current: Optional[Settings] = None
_listeners = []


def current() -> Settings:
    """The settings, read from the environment on the first call."""
    s = _current
    return s if s is not None else reload()


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
