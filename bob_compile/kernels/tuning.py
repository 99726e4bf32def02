"""Launch configurations: a few candidates per kernel, timed once per shape bucket and
remembered in a JSON file so that later processes skip the timing; without timing, the
first candidate that builds on the device.
"""
import json
import logging
import math
import os
import threading

import torch
import triton

from . import settings
from .tiles import padded_dim

log = logging.getLogger("bob_compile.kernels")

try:        # what Triton raises when a kernel cannot be built for the device
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources
    BUILD_ERRORS = (CompilationError, OutOfResources)
except ImportError:
    BUILD_ERRORS = ()


def error_summary(error):
    """'Type: first line of the message' (at most 200 characters of it), for a log line."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


def interpreting():
    return settings.current().interpret


def _patch_interpreter_scalar_index():
    """Triton 3.6's interpreter keeps scalars as 1-element arrays and turns them into loop
    bounds with int(array), which NumPy >= 2.4 refuses for 1-D arrays; loops whose bounds
    are computed in the kernel then fail. Read the single element instead."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_bob_compile_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._bob_compile_patched = True
    interpreter._patch_lang_tensor = patched


if interpreting():
    _patch_interpreter_scalar_index()


def row_bytes(dtype, head_dim, head_dim_v):
    """Bytes of one row of the widest operand tile: what bounds the block sizes that fit
    in shared memory (228 KiB per program on Hopper)."""
    return dtype.itemsize * padded_dim(max(head_dim, head_dim_v))


def wide_candidates(nbytes, column):
    """Small, single-stage tiles for wide rows (fp32 inputs, head dims above 64/128):
    a row-major program keeps ~3 tiles of its rows and streams ~4 of the other side; a
    column program keeps 4 key-side tiles resident, so its query blocks stay at 16."""
    if nbytes <= 256:
        return ([dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2),
                 dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=1)] if column else
                [dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
                 dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2)])
    if nbytes <= 512:
        return ([dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)] if column else
                [dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1),
                 dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)])
    return [dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)]


# Timing candidates costs a few runs of each; above this many (query, key) pairs per head
# that would take minutes, so longer problems reuse the decision of the largest tuned
# bucket (measured on the H200: the best configs no longer change from 16K on).
TUNE_MAX_PAIRS = 16384 * 16384


def length_bucket(n):
    """Lengths that share tuning decisions: powers of two from 1K up to 16K."""
    return min(max(1 << (max(n, 1) - 1).bit_length(), 1024), 16384)   # next power of 2


class TuningCache:
    """Remembers the fastest launch config per key, in memory and in a small JSON file.

    `chosen` holds the final LaunchPlan per launch site and bucket (`launch_plan`): the
    per-call lookup, without building the string key or locking."""

    def __init__(self):
        root = settings.current().cache_dir
        self.path = os.path.join(root, "triton_attention_configs.json")
        self.lock = threading.Lock()
        self.entries = None
        self.chosen = {}

    def _load(self):
        if self.entries is None:
            try:
                with open(self.path) as f:
                    self.entries = json.load(f)
            except (OSError, ValueError):
                self.entries = {}
        return self.entries

    def get(self, key):
        with self.lock:
            return self._load().get(key)

    def put(self, key, config):
        with self.lock:
            entries = self._load()
            entries[key] = config
            try:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                tmp = f"{self.path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(entries, f, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
            except OSError:
                pass  # a read-only home only costs re-tuning in the next process


TUNING_CACHE = TuningCache()


@settings.on_reload
def _forget_choices(_settings):
    TUNING_CACHE.chosen.clear()   # BOB_COMPILE_TUNE may have changed


def tuning_enabled():
    return settings.current().tune


class Untimed(list):
    """Candidates that are not timed: the first that builds for the device is the choice.
    For launch sites whose first config won when measured through the whole step, where a
    tuner timing the launch alone picks among them by noise; the others are there for
    devices on which the first does not build."""


_builds = {}    # (tuning key, config) -> whether its kernel built and launched on the device


def _capturing():
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _first_that_builds(key, candidates, run):
    """The first candidate whose kernel builds for the device. The lists' first configs are
    sized for the H200; on a device with less shared memory (an A100 has 163 KiB, consumer
    GPUs about 100) an untimed choice must still launch. Each candidate is launched once
    per key to find out, as tuning would (the launch sites compute their plans before
    their real launches, so an extra launch changes no result); if none but the last
    builds, the last is the choice and its launch raises Triton's error. While a CUDA graph
    is being captured nothing extra is launched (it would be captured, and replayed every
    time): the first candidate stands."""
    if len(candidates) == 1 or interpreting() or _capturing():
        return candidates[0]
    for config in candidates[:-1]:
        memo = (key, tuple(sorted(config.items())))
        builds = _builds.get(memo)
        if builds is None:
            try:
                run(config)
                builds = True
            except BUILD_ERRORS as e:
                log.info("launch config %s of %s does not build on this device: %s",
                         config, key, error_summary(e))
                builds = False
            _builds[memo] = builds
        if builds:
            return config
    return candidates[-1]


def choose_config(key, candidates, run, pairs, has_work=None):
    """The fastest of `candidates` for `key`, as (config, final); `run(config)` launches the
    kernel once.

    Without tuning (interpreter, BOB_COMPILE_TUNE=0, one candidate, an `Untimed` list, or a
    problem of more than TUNE_MAX_PAIRS (query, key) pairs per head with no decision cached
    yet) the first candidate that builds for the device is the choice, so the candidate
    lists put the measured best default first. final is False for the provisional first candidate of a problem too
    large to tune, which a later tuned decision for the same key replaces. has_work: for a
    launch whose work depends on data (a masked kernel's MASK_PATH, one of whose two
    launches may have nothing to do), whether this one has any; where not, timing would
    choose by noise (measured: the noise choices cost a mask read per tile 8 % over its
    default configs), so the first candidate stands, and is not written to the file."""
    if len(candidates) == 1 or isinstance(candidates, Untimed) or not tuning_enabled():
        return _first_that_builds(key, candidates, run), True
    known = TUNING_CACHE.get(key)
    if known is not None and known in candidates:
        return known, True
    if pairs > TUNE_MAX_PAIRS:
        return _first_that_builds(key, candidates, run), False
    if has_work is not None and not has_work():
        return _first_that_builds(key, candidates, run), True
    best, best_ms = candidates[0], math.inf
    for config in candidates:
        try:
            ms = triton.testing.do_bench(lambda: run(config), warmup=3, rep=12,
                                         return_mode="median")
        except Exception as e:  # e.g. out of shared memory for this block shape
            log.info("launch config %s of %s is not a candidate: %s", config, key,
                     error_summary(e))
            continue
        if ms < best_ms:
            best, best_ms = config, ms
    TUNING_CACHE.put(key, best)
    return best, True


_device_names = {}


def device_name(device):
    """torch.cuda.get_device_name, asked once per device ("cpu" for other devices)."""
    if device.type != "cuda":
        return "cpu"
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = _device_names.get(index)
    if name is None:
        name = _device_names[index] = torch.cuda.get_device_name(index)
    return name


def tuning_key(kernel, q, k, v, causal, *flags):
    return "|".join(str(x) for x in (
        kernel, device_name(q.device), q.dtype,
        q.shape[-1], v.shape[-1], causal, length_bucket(q.shape[-2]), length_bucket(k.shape[-2]),
        *flags))
