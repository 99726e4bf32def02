"""The options of the flashbob backend: `torch.compile(m, backend="flashbob", options={...})`.

The set is closed: an unknown key is an error that lists the valid ones, so that a typo
never silently turns a feature off. OPTIONS below describes each; the kernel choices among
them override the environment's switches (kernels/settings.py: SWITCHES) for one compiled
graph, in every order of derivative. docs/settings.md is generated from both:
`python -m bob_compile.settings_doc > docs/settings.md`.

`mode` (torch.compile's argument) is passed on to inductor where inductor compiles
(torch.compile takes `mode` or `options`, not both; `backend=functools.partial(flashbob,
mode=..., options=...)` passes both).
"""
import dataclasses
import os
from typing import Optional

from . import _compat
from .kernels import settings as kernel_settings

DUMP_DIR_ENV = "BOB_COMPILE_DUMP_DIR"
COMPILERS = ("inductor", "aot_eager", "eager")
REGIONS = ("blocks", "graph")


@dataclasses.dataclass(frozen=True)
class Options:
    dump_dir: Optional[str] = None
    compiler: str = "inductor"
    fallback: bool = True
    regions: str = "graph"
    # Inductor config patches for torch.compile's `mode` (not an option key).
    inductor_config: tuple = ()
    kernel_choices: Optional[kernel_settings.KernelChoices] = None   # None: the environment's


# The options that are not kernel switches: (key, values, default, what it does).
OWN_OPTIONS = (
    ("dump_dir", "a folder", f"${DUMP_DIR_ENV}, else none",
     "write, per compiled graph, the graph before and after the rewrite, their diff and a "
     "report of every attention site into <dump_dir>/<compile id>/"),
    ("compiler", "`inductor`, `aot_eager`, `eager`", "`inductor`",
     "what compiles the graphs whose route compiles: `aot_eager` traces with AOTAutograd "
     "and generates no code (fast to compile, for debugging); `eager` runs every graph as "
     "rewritten"),
    ("fallback", "`True`, `False`", "`True`",
     "if the backend fails on a graph, warn and run it anyway, exact at every order (the "
     "rewritten graph eagerly where the compiler failed; else the graph untouched, its "
     "attention as math where gradients are on); `False` raises, for debugging the backend "
     "itself"),
    ("regions", "`graph`, `blocks`", "`graph`",
     "what one compile of a training graph covers: `graph` compiles it whole, fusing across "
     "the blocks' boundaries, one autograd node per order; `blocks` cuts the graph at its "
     "repeated blocks (the children of a module list, alike) and compiles each distinct "
     "block once for all of them, the code around them apart: GPT-2 small's first step "
     "2.7x sooner and its second-order peak memory a third lower, each step ~1.5x slower "
     "(host time per block; H100, docs/measurements.md)"),
)
VALID_KEYS = tuple(key for key, *_ in OWN_OPTIONS) + tuple(
    switch.option for switch in kernel_settings.SWITCHES if switch.option)
# the values each kernel option takes: its switch's (a 1/0 switch's option is a bool instead)
_CHOICES = {switch.option: switch.choices for switch in kernel_settings.SWITCHES
            if switch.option and switch.choices is not kernel_settings.SWITCH}


def parse(options=None, mode=None):
    """Options from torch.compile's `options` dict and `mode`; ValueError/TypeError if invalid."""
    options = dict(options or {})
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
    regions = options.get("regions", "graph")
    if regions not in REGIONS:
        raise ValueError(f"flashbob: options['regions']={regions!r}; expected one of {list(REGIONS)}")
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
        regions=regions,
        inductor_config=tuple(sorted(inductor_config.items())),
        kernel_choices=kernel_settings.KernelChoices.of(
            kernels=options.get("kernels"), native_backend=options.get("native_backend"),
            bwd_dq_atomics=schedule["bwd_dq"], bob_row_atomics=schedule["bob_schedule"],
            bob_form=options.get("bob_form"), tune=options.get("tune")),
    )
