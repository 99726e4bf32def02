"""The host side of the Triton launches, on CPU (no kernel runs here).

LaunchPlan sends a launch straight to the compiled kernel of an earlier launch when the
arguments specialize the same way in Triton, bypassing JITFunction.run. These tests check,
without a GPU, that (1) every launch site of triton_forward / triton_backward / triton_bob
passes its runtime arguments then its constexprs in the kernel's own parameter order, so
that the positional call of the fast path binds exactly as Triton's keyword call does, and
(2) the fast path is taken only for arguments that specialize like the cached launch's:
same ints, same tensor dtypes and 16-byte alignment, same device (floats do not matter),
and (3) it calls the compiled kernel's C launcher with the arguments Triton's own launch
would give it (addresses as integers, the current stream, no hooks), and only when no
launch hook is set and the kernel needs no scratch memory; (4) a choice made without
timing takes the first candidate that builds on the device.
The kernels themselves are exercised by test_triton_interpret.py (interpreter, where the
plan always takes Triton's path) and test_gpu_kernels.py.
"""
import pytest
import torch

triton = pytest.importorskip("triton")

from bob_compile.kernels import launching, settings, tuning  # noqa: E402
from bob_compile.kernels.launching import LaunchPlan  # noqa: E402
from bob_compile.kernels.params import AttentionParams  # noqa: E402

OPTIONS = ("num_warps", "num_stages")


@pytest.fixture(autouse=True)
def reread_settings():
    settings.reload()
    yield
    settings.reload()


# --------------------------------------------------------------------------------------
# (1) argument layout of every launch site
# --------------------------------------------------------------------------------------
@pytest.fixture
def recorded_launches(monkeypatch):
    """Run the host functions on CPU tensors, recording each launch instead of running it."""
    monkeypatch.setenv("BOB_COMPILE_TUNE", "0")
    monkeypatch.setenv("BOB_COMPILE_NATIVE_BACKEND", "none")
    settings.reload()
    if settings.current().interpret:
        pytest.skip("the kernels are interpreted functions in this process")
    # each site's own launches only, not the launches that check an untimed choice builds
    monkeypatch.setattr(tuning, "_first_that_builds", lambda key, candidates, run:
                        candidates[0])
    launches = []

    def record(plan, kernel, grid, **named):
        launches.append((plan, kernel, grid, named))
    monkeypatch.setattr(LaunchPlan, "__call__", record)
    return launches


def host_calls(dtype, gqa, atomics):
    from bob_compile.kernels.triton_backward import attention_backward
    from bob_compile.kernels.triton_bob import attention_bob
    from bob_compile.kernels.triton_forward import attention_forward
    B, Hq, Hkv, L, S, E, Ev = 1, 4, 2 if gqa else 4, 37, 45, 32, 16
    q, k, v = (torch.randn(B, h, n, e, dtype=dtype)
               for h, n, e in ((Hq, L, E), (Hkv, S, E), (Hkv, S, Ev)))
    o, do = torch.randn(B, Hq, L, Ev, dtype=dtype), torch.randn(B, Hq, L, Ev, dtype=dtype)
    lse, dlse = torch.randn(B, Hq, L), torch.randn(B, Hq, L)
    params = AttentionParams(scale=0.3, causal=True)
    attention_forward(q, k, v, params)
    attention_backward(q, k, v, o, lse, do, dlse, AttentionParams(scale=0.3, causal=False), dq_atomics=atomics)
    attention_bob(q, k, v, o, lse, do, None, torch.randn_like(q), None, torch.randn_like(v),
                  params, row_atomics=atomics)


@pytest.mark.parametrize("atomics", [False, True], ids=["two_pass", "atomic"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_launch_binds_the_same_positionally(recorded_launches, dtype, gqa, atomics):
    host_calls(dtype, gqa, atomics)
    names = [kernel.fn.__name__ for _, kernel, _, _ in recorded_launches]
    assert names == (["_forward_kernel", "_row_dot_kernel", "_column_kernel"]
                     + ([] if atomics else ["_dq_kernel"])
                     + ["_row_dot_kernel", "_column_kernel"]
                     + (["_finish_rows_kernel"] if atomics else ["_row_kernel"]))
    for plan, kernel, grid, named in recorded_launches:
        assert len(grid) == 2
        args = launching.packer(kernel)(**named)
        # every runtime parameter gets a value: the named ones as given, strides from their
        # tensor (checked against the tensor itself)
        runtime = [p for p in kernel.params if not p.is_constexpr]
        assert len(args) == len(runtime), kernel.fn.__name__
        for p, value in zip(runtime, args):
            if p.name in named:
                assert value is named[p.name], (kernel.fn.__name__, p.name)
            else:
                assert type(value) is int and p.name.startswith("s"), (kernel.fn.__name__, p.name)
        # ... and the fast path's positional call binds exactly as Triton's keyword call
        constexprs = {k: v for k, v in plan.kwargs.items() if k not in OPTIONS}
        by_keyword = kernel.signature.bind(*args, **constexprs)
        assert plan._constexpr_values(kernel, len(args)), kernel.fn.__name__
        positional = kernel.signature.bind(*args, *plan._constexprs)
        assert positional.arguments.keys() == by_keyword.arguments.keys()
        for name, value in by_keyword.arguments.items():
            assert positional.arguments[name] is value, (kernel.fn.__name__, name)
        assert all(p.is_constexpr for p in kernel.params[len(args):])


def test_strides_come_from_the_tensor_they_belong_to():
    from bob_compile.kernels.triton_forward import _forward_kernel
    q = torch.empty(2, 3, 5, 8).transpose(1, 2)            # strides (120, 8, 24, 1)
    k, v, o, lse = torch.empty(2, 3, 7, 8), torch.empty(2, 3, 7, 4), torch.empty(2, 5, 3, 4), \
        torch.empty(2, 5, 3)
    mask = torch.empty(2, 1, 1, 7, dtype=torch.bool).expand(2, 5, 3, 7)   # broadcast: stride 0
    key_range = torch.empty(2, 1, 1, 2, dtype=torch.int32).expand(2, 5, 1, 2)
    args = launching.packer(_forward_kernel)(
        Q=q, K=k, V=v, O=o, LSE=lse, MASK=mask, KEY_RANGE=key_range, SEED=lse, num_q_heads=5,
        kv_group=1, L=3, S=7, drop_threshold=0, qk_scale_log2=0.5, keep_scale=0.0, scale=0.5,
        softcap=1.0)
    named = dict(zip([p.name for p in _forward_kernel.params], args))
    assert [named[n] for n in ("sqb", "sqh", "sql", "sqe")] == list(q.stride())
    assert [named[n] for n in ("skb", "skh", "skn", "ske")] == list(k.stride())
    assert [named[n] for n in ("svb", "svh", "svn", "sve")] == list(v.stride())
    assert [named[n] for n in ("sob", "soh", "sol", "soe")] == list(o.stride())
    assert [named[n] for n in ("smb", "smh", "sml", "sme")] == [7, 0, 0, 1]
    assert [named[n] for n in ("srb", "srh", "srl", "sre")] == [2, 0, 2, 1]


def test_a_missing_or_misspelled_argument_is_an_error():
    from bob_compile.kernels.triton_forward import _forward_kernel
    pack = launching.packer(_forward_kernel)
    t = torch.empty(1, 1, 2, 4)
    given = dict(Q=t, K=t, V=t, O=t, LSE=t, MASK=t, KEY_RANGE=t, SEED=t, num_q_heads=1,
                 kv_group=1, L=2, S=2, drop_threshold=0, qk_scale_log2=1.0, keep_scale=0.0,
                 scale=1.0, softcap=1.0)
    pack(**given)
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'kv_group'"):
        pack(**{k: v for k, v in given.items() if k != "kv_group"})
    with pytest.raises(TypeError, match="unexpected keyword argument 'kv_groups'"):
        pack(**given, kv_groups=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'sqb'"):
        pack(**given, sqb=1)                                # strides are never passed
    with pytest.raises(TypeError, match="positional"):
        pack(*given.values())
    with pytest.raises(ValueError, match="no parameter 'sxb'"):
        launching.strides_of(_forward_kernel, Q="sx")


# --------------------------------------------------------------------------------------
# (2) when the fast path is taken
# --------------------------------------------------------------------------------------
class Param:
    def __init__(self, name, is_constexpr):
        self.name, self.is_constexpr = name, is_constexpr


class FakeCompiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("fast", grid, args))


class FakeKernel:
    """A JITFunction stand-in: (X, n, scale, BLOCK: constexpr)."""
    params = [Param("X", False), Param("n", False), Param("scale", False), Param("BLOCK", True)]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return FakeCompiled(self.log)
        return run


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(launching, "_CompiledKernel", FakeCompiled)
    monkeypatch.setattr(launching, "_current_device", lambda: 0)
    assert settings.current().fast_launch or settings.current().interpret


def kinds(log):
    return [entry[0] for entry in log]


def test_repeated_launch_goes_to_the_compiled_kernel(fake_gpu):
    if settings.current().interpret:
        pytest.skip("no fast path in the interpreter")
    kernel, plan = FakeKernel(), LaunchPlan(dict(BLOCK=64, num_warps=4, num_stages=2))
    x = torch.zeros(64)
    plan.launch(kernel, (3, 2), x, 128, 0.5)
    assert kernel.log == [("jit", (3, 2), (x, 128, 0.5),
                           dict(BLOCK=64, num_warps=4, num_stages=2))]
    plan.launch(kernel, (3, 2), x, 128, 0.25)            # a float never changes the kernel
    assert kernel.log[-1] == ("fast", (3, 2, 1), (x, 128, 0.25, 64))
    y = torch.zeros(64)
    plan.launch(kernel, (5, 2), y, 128, 0.5)             # another aligned tensor, another grid
    assert kernel.log[-1] == ("fast", (5, 2, 1), (y, 128, 0.5, 64))


@pytest.mark.parametrize("change", ["int value", "int one", "misaligned", "dtype", "device"])
def test_a_differently_specialized_launch_takes_tritons_path(fake_gpu, monkeypatch, change):
    if settings.current().interpret:
        pytest.skip("no fast path in the interpreter")
    kernel, plan = FakeKernel(), LaunchPlan(dict(BLOCK=64, num_warps=4, num_stages=2))
    x = torch.zeros(64)
    plan.launch(kernel, (1, 1), x, 32, 0.5)
    args = {"int value": (x, 33, 0.5), "int one": (x, 1, 0.5),
            "misaligned": (torch.zeros(65)[1:], 32, 0.5),
            "dtype": (torch.zeros(64, dtype=torch.float64), 32, 0.5),
            "device": (x, 32, 0.5)}[change]
    if change == "device":
        monkeypatch.setattr(launching, "_current_device", lambda: 1)
    plan.launch(kernel, (1, 1), *args)
    assert kinds(kernel.log) == ["jit", "jit"]
    plan.launch(kernel, (1, 1), *args)                   # and is cached in its turn
    assert kinds(kernel.log) == ["jit", "jit", "fast"]


def test_switched_off_every_launch_takes_tritons_path(fake_gpu, monkeypatch):
    monkeypatch.setenv("BOB_COMPILE_DEV_FAST_LAUNCH", "0")
    settings.reload()
    kernel, plan = FakeKernel(), LaunchPlan(dict(BLOCK=64, num_warps=4))
    x = torch.zeros(64)
    for _ in range(3):
        plan.launch(kernel, (1, 1), x, 32, 0.5)
    assert kinds(kernel.log) == ["jit", "jit", "jit"]


def test_unknown_argument_kinds_and_layouts_are_not_cached(fake_gpu):
    if settings.current().interpret:
        pytest.skip("no fast path in the interpreter")
    kernel, plan = FakeKernel(), LaunchPlan(dict(BLOCK=64, num_warps=4))
    x = torch.zeros(64)
    for _ in range(2):
        plan.launch(kernel, (1, 1), x, torch.tensor(3).numpy(), 0.5)   # a numpy int: not handled
    assert kinds(kernel.log) == ["jit", "jit"]
    plan = LaunchPlan(dict(BLOCK=64, OTHER=1, num_warps=4))   # not a constexpr of kernel
    for _ in range(2):
        plan.launch(kernel, (1, 1), x, 3, 0.5)
    assert kinds(kernel.log) == ["jit"] * 4


def test_an_int_where_a_float_was_takes_tritons_path(fake_gpu):
    """Triton would specialize an int (a constant if 1); only floats are free to change."""
    if settings.current().interpret:
        pytest.skip("no fast path in the interpreter")
    kernel, plan = FakeKernel(), LaunchPlan(dict(BLOCK=64, num_warps=4))
    x = torch.zeros(64)
    plan.launch(kernel, (1, 1), x, 32, 1.0)
    plan.launch(kernel, (1, 1), x, 32, 1)
    plan.launch(kernel, (1, 1), x, 32, 2.0)
    assert kinds(kernel.log) == ["jit", "jit", "fast"]


# --------------------------------------------------------------------------------------
# (3) the direct call of the C launcher
# --------------------------------------------------------------------------------------
class FakeLauncher:
    """Triton's CudaLauncher as DirectLaunch sees it: `launch` is the C entry point."""

    def __init__(self, log, scratch=0):
        self.log = log
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True

    def launch(self, *args):
        self.log.append(("direct", args))


class FakeLaunchableCompiled(FakeCompiled):
    def __init__(self, log, scratch=0):
        super().__init__(log)
        self.run = FakeLauncher(log, scratch)
        self.function, self.packed_metadata = 1234, (4, 1, 0)


class FakeLaunchableKernel(FakeKernel):
    scratch = 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return FakeLaunchableCompiled(self.log, self.scratch)
        return run


@pytest.fixture
def direct_gpu(fake_gpu, monkeypatch):
    if settings.current().interpret:
        pytest.skip("no fast path in the interpreter")
    monkeypatch.setattr(launching, "_CompiledKernel", FakeLaunchableCompiled)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7 + device,
                        raising=False)   # absent from CPU builds


def test_repeated_launch_calls_the_c_launcher_with_addresses(direct_gpu):
    kernel, plan = FakeLaunchableKernel(), LaunchPlan(dict(BLOCK=64, num_warps=4, num_stages=2))
    x = torch.zeros(64)
    plan.launch(kernel, (3, 2), x, 128, 0.5)
    plan.launch(kernel, (5, 2), x, 128, 0.25)
    assert kinds(kernel.log) == ["jit", "direct"]
    # grid, stream, function, cooperative, pdl, no scratch, metadata, no launch metadata,
    # no hooks, then the kernel's arguments: tensors as addresses, scalars, constexprs
    assert kernel.log[-1][1] == (5, 2, 1, 7, 1234, False, True, None, None, (4, 1, 0),
                                 None, None, None, x.data_ptr(), 128, 0.25, 64)


def test_a_launch_hook_sends_launches_through_triton(direct_gpu, monkeypatch):
    from triton import knobs
    kernel, plan = FakeLaunchableKernel(), LaunchPlan(dict(BLOCK=64, num_warps=4))
    x = torch.zeros(64)
    plan.launch(kernel, (1, 1), x, 32, 0.5)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    plan.launch(kernel, (1, 1), x, 32, 0.5)
    assert kinds(kernel.log) == ["jit", "fast"]        # CompiledKernel[grid]: runs the hook


def test_a_kernel_with_scratch_memory_is_not_launched_directly(direct_gpu):
    kernel, plan = FakeLaunchableKernel(), LaunchPlan(dict(BLOCK=64, num_warps=4))
    kernel.scratch = 128
    x = torch.zeros(64)
    plan.launch(kernel, (1, 1), x, 32, 0.5)
    plan.launch(kernel, (1, 1), x, 32, 0.5)
    assert kinds(kernel.log) == ["jit", "fast"]


def test_a_launcher_that_refuses_the_arguments_falls_back_for_good(direct_gpu, monkeypatch):
    def refuse(self, *args):
        raise TypeError("function takes exactly 20 arguments")
    monkeypatch.setattr(FakeLauncher, "launch", refuse)
    kernel, plan = FakeLaunchableKernel(), LaunchPlan(dict(BLOCK=64, num_warps=4))
    x = torch.zeros(64)
    for _ in range(3):
        plan.launch(kernel, (1, 1), x, 32, 0.5)
    assert kinds(kernel.log) == ["jit", "fast", "fast"]


# --------------------------------------------------------------------------------------
# (4) untimed choices on a device where the first config does not build
# --------------------------------------------------------------------------------------
@pytest.fixture
def untimed_choice(monkeypatch):
    """A device on which the configs with BLOCK_M 128 need more shared memory than it has;
    records each launch, and fails the test if anything is timed."""
    from triton.runtime.errors import OutOfResources
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning, "_builds", {})
    monkeypatch.setattr(tuning.TUNING_CACHE, "get", lambda key: None)
    monkeypatch.setattr(tuning.TUNING_CACHE, "put",
                        lambda key, config: pytest.fail("an untimed choice was written"))
    monkeypatch.setattr(tuning.triton.testing, "do_bench",
                        lambda *a, **k: pytest.fail("an untimed choice was timed"))
    ran = []

    def run(config):
        ran.append(config["BLOCK_M"])
        if config["BLOCK_M"] == 128:
            raise OutOfResources(180224, 166912, "shared memory")
    return run, ran


@pytest.mark.parametrize("why", ["tuning off", "untimed list", "too long to tune"])
def test_an_untimed_choice_is_the_first_config_that_builds(untimed_choice, monkeypatch, why):
    run, ran = untimed_choice
    monkeypatch.setattr(tuning, "tuning_enabled", lambda: why != "tuning off")
    kind = tuning.Untimed if why == "untimed list" else list
    candidates = kind([dict(BLOCK_M=128), dict(BLOCK_M=64), dict(BLOCK_M=32)])
    pairs = tuning.TUNE_MAX_PAIRS + 1 if why == "too long to tune" else 1
    for _ in range(3):
        config, final = tuning.choose_config("key", candidates, run, pairs)
        assert config == dict(BLOCK_M=64) and final == (why != "too long to tune")
    assert ran == [128, 64], "each candidate is tried once per key"


def test_the_last_candidate_stands_when_none_before_it_builds(untimed_choice):
    run, ran = untimed_choice
    candidates = tuning.Untimed([dict(BLOCK_M=128), dict(BLOCK_M=128, num_warps=4),
                                        dict(BLOCK_M=16)])
    config, _ = tuning.choose_config("key", candidates, run, 1)
    assert config == dict(BLOCK_M=16) and ran == [128, 128], "its own launch raises, if any"


def test_a_single_candidate_or_the_interpreter_launches_nothing_to_choose(untimed_choice,
                                                                         monkeypatch):
    run, ran = untimed_choice
    assert tuning.choose_config("key", [dict(BLOCK_M=128)], run, 1)[0]["BLOCK_M"] == 128
    monkeypatch.setattr(tuning, "interpreting", lambda: True)
    candidates = tuning.Untimed([dict(BLOCK_M=128), dict(BLOCK_M=64)])
    assert tuning.choose_config("key", candidates, run, 1)[0]["BLOCK_M"] == 128
    assert ran == []


def test_nothing_extra_is_launched_into_a_cuda_graph_capture(untimed_choice, monkeypatch):
    run, ran = untimed_choice
    monkeypatch.setattr(tuning, "_capturing", lambda: True)
    candidates = tuning.Untimed([dict(BLOCK_M=128), dict(BLOCK_M=64)])
    assert tuning.choose_config("key", candidates, run, 1)[0]["BLOCK_M"] == 128
    assert ran == []


def test_the_row_pass_with_dropout_or_a_soft_cap_takes_narrow_key_tiles_first(monkeypatch):
    """Dropout's mask state and the cap's derivatives spill the plain causal row tile
    (128 x 64; kernel_resources.py --dropout / --softcap): both take 128 x 32 first."""
    from bob_compile.kernels import triton_bob
    monkeypatch.setattr(triton_bob, "interpreting", lambda: False)
    bf16 = torch.bfloat16
    plain = triton_bob.row_candidates(bf16, 64, 64, fold=True, reads_dq=True)[0]
    for feature in ("dropout", "softcap"):
        first = triton_bob.row_candidates(bf16, 64, 64, fold=True, reads_dq=True,
                                          **{feature: True})[0]
        assert (first["BLOCK_M"], first["BLOCK_N"]) == (128, 32) and first != plain


def test_the_bob_passes_without_a_choice_have_fallbacks(monkeypatch):
    """The folded passes whose first config won through the step are untimed lists (a tuner
    timing the launch alone picks by noise), not single configs: a device on which the first
    does not build takes the next. With a mask they are timed."""
    from bob_compile.kernels import triton_bob
    monkeypatch.setattr(triton_bob, "interpreting", lambda: False)
    bf16 = torch.bfloat16
    rows = triton_bob.row_candidates(bf16, 64, 64, fold=True, reads_dq=True)
    columns = triton_bob.column_candidates(bf16, 64, 64, False, fold=True, causal=True)
    for untimed in (rows, columns):
        assert isinstance(untimed, tuning.Untimed) and len(untimed) > 1
    assert not isinstance(triton_bob.row_candidates(bf16, 64, 64, fold=True, reads_dq=True,
                                                    masked=True), tuning.Untimed)
    assert not isinstance(triton_bob.column_candidates(bf16, 64, 64, False, fold=True),
                          tuning.Untimed)
