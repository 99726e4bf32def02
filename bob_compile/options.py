"""The options of the flashbob backend: `torch.compile(m, backend="flashbob", options={...})`.

The set is closed: an unknown key is an error that lists the valid ones, so that a typo
never silently turns a feature off.

    dump_dir         str or None. Write, per compiled graph, the graph before and after the
                     rewrite, their diff and a report of every attention site into
                     <dump_dir>/<compile id>/. Default: the environment variable
                     BOB_COMPILE_DUMP_DIR, else no dumps.
    compiler         "inductor" (default), "aot_eager" or "eager": what compiles the graphs
                     whose route compiles (in-graph differentiation, inference). "aot_eager"
                     traces with AOTAutograd but generates no code (fast to compile, good for
                     debugging); "eager" runs every graph as rewritten, compiling nothing.
    fallback         bool, default True. If the backend fails on a graph, warn and run that
                     graph untouched (as backend="eager" would). False raises instead, for
                     debugging the backend itself.

Kernel choices for this compile's graphs, in every order of derivative (default: the
environment variable named, else the automatic choice; bob_compile/kernels/settings.py):
    kernels          "triton", "blockwise" or "reference"      (BOB_COMPILE_KERNELS)
    native_backend   "cudnn", "flash" or "none": PyTorch's fused first-order kernels
                                                               (BOB_COMPILE_NATIVE_BACKEND)
    bwd_dq           "two_pass" or "atomic"                    (BOB_COMPILE_BWD_DQ)
    bob_schedule     "two_pass" or "atomic"                    (BOB_COMPILE_BOB_SCHEDULE)
    bob_form         "auto", "folded" or "chain": the factorization of the second order
                     (docs/second-order.md)                    (BOB_COMPILE_BOB_FORM)
    tune             bool: time candidate launch configs       (BOB_COMPILE_TUNE)

`mode` (torch.compile's argument) is passed on to inductor where inductor compiles
(torch.compile takes `mode` or `options`, not both; `backend=functools.partial(flashbob,
mode=..., options=...)` passes both).

Removed: `double_backward` (False sent training graphs through stock AOTAutograd, for a
faster first order). The training route now runs the same compiled forward and backward
as stock compile when no double backward happens (docs/routing.md), so the option bought
nothing and could only break Hessian-vector products; passing it is an error that says so.
"""
import dataclasses
import os
from typing import Optional

from . import _compat
from .kernels import settings as kernel_settings

DUMP_DIR_ENV = "BOB_COMPILE_DUMP_DIR"
COMPILERS = ("inductor", "aot_eager", "eager")


@dataclasses.dataclass(frozen=True)
class Options:
    dump_dir: Optional[str] = None
    compiler: str = "inductor"
    fallback: bool = True
    # Inductor config patches for torch.compile's `mode` (not an option key).
    inductor_config: tuple = ()
    kernel_choices: Optional[kernel_settings.KernelChoices] = None   # None: the environment's


VALID_KEYS = ("dump_dir", "compiler", "fallback", "kernels", "native_backend", "bwd_dq",
              "bob_schedule", "bob_form", "tune")
_CHOICES = {"kernels": kernel_settings.KERNELS, "native_backend": kernel_settings.NATIVE_BACKENDS,
            "bwd_dq": kernel_settings.SCHEDULES, "bob_schedule": kernel_settings.SCHEDULES,
            "bob_form": kernel_settings.BOB_FORMS}
REMOVED_KEYS = {
    "double_backward": "options['double_backward'] was removed: training graphs compile in "
                       "every order, and a step without double backward runs what stock "
                       "torch.compile runs (see bob_compile/options.py); drop the key",
}


def parse(options=None, mode=None):
    """Options from torch.compile's `options` dict and `mode`; ValueError/TypeError if invalid."""
    options = dict(options or {})
    for key in sorted(set(options) & set(REMOVED_KEYS)):
        raise ValueError(f"flashbob: {REMOVED_KEYS[key]}")
    unknown = sorted(set(options) - set(VALID_KEYS))
    if unknown:
        raise ValueError(f"flashbob: unknown option(s) {unknown}; valid options are "
                         f"{list(VALID_KEYS)} (documented in bob_compile/options.py)")
    dump_dir = options.get("dump_dir", os.environ.get(DUMP_DIR_ENV) or None)
    if dump_dir is not None and not isinstance(dump_dir, (str, os.PathLike)):
        raise TypeError(f"flashbob: options['dump_dir'] must be a path, got {type(dump_dir).__name__}")
    compiler = options.get("compiler", "inductor")
    if compiler not in COMPILERS:
        raise ValueError(f"flashbob: options['compiler']={compiler!r}; expected one of {list(COMPILERS)}")
    for key in ("fallback", "tune"):
        if not isinstance(options.get(key, True), bool):
            raise TypeError(f"flashbob: options[{key!r}] must be True or False, "
                            f"got {options[key]!r}")
    for key, valid in _CHOICES.items():
        if key in options and options[key] not in valid:
            raise ValueError(f"flashbob: options[{key!r}]={options[key]!r}; expected one of "
                             f"{list(valid)}")
    inductor_config = _compat.inductor_mode_options(mode or "default")
    schedule = {key: None if key not in options else options[key] == "atomic"
                for key in ("bwd_dq", "bob_schedule")}
    return Options(
        dump_dir=None if dump_dir is None else os.fspath(dump_dir),
        compiler=compiler,
        fallback=options.get("fallback", True),
        inductor_config=tuple(sorted(inductor_config.items())),
        kernel_choices=kernel_settings.KernelChoices.of(
            kernels=options.get("kernels"), native_backend=options.get("native_backend"),
            bwd_dq_atomics=schedule["bwd_dq"], bob_row_atomics=schedule["bob_schedule"],
            bob_form=options.get("bob_form"), tune=options.get("tune")),
    )
