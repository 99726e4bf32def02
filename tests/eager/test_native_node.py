"""The C++ autograd node of the first order (bob_compile/eager/node.py), on the CPU.

In use the node runs PyTorch's CUDA kernels (cuDNN, FA2); here it runs PyTorch's CPU flash
kernels (its CPU_FLASH number), in float64, against autograd through plain math attention:
the forward and the first-order backward it runs itself, and the second and third orders
and lse cotangents it hands to the op's Python path. The CUDA kernels: test_gpu_training.py.
"""
import gc
import logging
import sys
import types
import weakref

import pytest
import torch

import bob_compile
from bob_compile.eager import node as eager_node
from bob_compile.eager.node import bob_backward, general_backward
from bob_compile.kernels import settings


def counted(set_callback, callback):
    """Sets a counting wrapper of callback (one of the nodes' Python backwards) with
    set_callback; yields the list of the arguments of its calls, then restores callback."""
    calls = []
    set_callback(lambda *args: calls.append(args) or callback(*args))
    yield calls
    set_callback(callback)


@pytest.fixture
def general_calls(cpp_node):
    """The arguments of every call of the first-order node's Python backward."""
    yield from counted(cpp_node.set_general_backward, general_backward)


def math_attention(q, k, v, scale, causal):
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        L, S = s.shape[-2:]
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v, s.logsumexp(-1)


def inputs(B, H, L, S, E, layout="bhld"):
    def one(n):
        if layout == "blhd":        # a permuted view of one projection, as models make them
            return torch.randn(B, n, H, E, dtype=torch.float64).transpose(1, 2).requires_grad_()
        return torch.randn(B, H, n, E, dtype=torch.float64, requires_grad=True)
    return one(L), one(S), one(S)


def close(got, want):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def same_layout(a, b):
    return all(n == 1 or x == y for n, x, y in zip(a.shape, a.stride(), b.stride()))


# (B, H, L, S, E, causal): odd lengths, a rectangle (never causal: fused kernels align a
# causal rectangle bottom-right, and the op never sends them one)
@pytest.mark.parametrize("shape", [(2, 3, 7, 7, 8, False), (2, 3, 7, 7, 8, True),
                                   (1, 2, 33, 33, 16, True), (1, 1, 5, 9, 8, False)])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_first_order_runs_in_cpp(cpp_node, general_calls, shape, layout):
    B, H, L, S, E, causal = shape
    torch.manual_seed(0)
    q, k, v = inputs(B, H, L, S, E, layout)
    o, lse = cpp_node.attention(q, k, v, None, 0.3, causal, cpp_node.CPU_FLASH, True)
    ro, rlse = math_attention(q, k, v, 0.3, causal)
    close((o, lse), (ro, rlse))
    assert same_layout(o, q)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    close(grads, torch.autograd.grad(ro, (q, k, v), do))
    assert all(same_layout(g, t) for g, t in zip(grads, (q, k, v)))
    assert general_calls == []              # no Python in the first-order backward


@pytest.fixture
def bob_calls(cpp_node):
    """The arguments of every call of the second node's Python backward (the BoB)."""
    yield from counted(cpp_node.set_bob_backward, bob_backward)


@pytest.mark.parametrize("bob_form", ["chain", "folded"])
@pytest.mark.parametrize("causal", [False, True])
def test_second_and_third_order(cpp_node, general_calls, bob_calls, reread_settings,
                                monkeypatch, bob_form, causal):
    """Folded: the create_graph backward is the second C++ node (no Python), whose backward
    (the BoB) calls Python on the CPU (no plans without a GPU); chain: Python from the
    create_graph backward on. Exact at every order either way."""
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_FORM", bob_form)
    settings.reload()
    folded = bob_form == "folded"
    torch.manual_seed(1)
    q, k, v = inputs(2, 2, 11, 11, 8)
    do = torch.randn(2, 2, 11, 8, dtype=torch.float64)
    ours = cpp_node.attention(q, k, v, None, 0.4, causal, cpp_node.CPU_FLASH, folded)[0]
    ref = math_attention(q, k, v, 0.4, causal)[0]
    g1 = torch.autograd.grad(ours, (q, k, v), do, create_graph=True)
    r1 = torch.autograd.grad(ref, (q, k, v), do, create_graph=True)
    assert len(general_calls) == (0 if folded else 1)
    assert _is_cpp_node(g1[0]) == folded
    close(g1, r1)
    vs = [torch.randn_like(t) for t in g1]
    h = torch.autograd.grad(g1, (q, k, v), vs, create_graph=True)
    hr = torch.autograd.grad(r1, (q, k, v), vs, create_graph=True)
    close(h, hr)
    assert len(bob_calls) == (1 if folded else 0)
    third = torch.autograd.grad([t.square().sum() for t in h], (q, k, v))
    close(third, torch.autograd.grad([t.square().sum() for t in hr], (q, k, v)))


@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_folded_second_order_of_some_outputs(cpp_node, general_calls, bob_calls, layout):
    """Cotangents of only some of dq, dk, dv (the others None: their GEMMs skipped), the
    cotangent of dO too, permuted layouts: exact, with the first backward's dq handed to
    the BoB (its row pass reads R = dS k from it)."""
    torch.manual_seed(3)
    q, k, v = inputs(2, 3, 13, 13, 8, layout)
    do = torch.randn(2, 3, 13, 8, dtype=torch.float64, requires_grad=True)
    ours = cpp_node.attention(q, k, v, None, 0.35, True, cpp_node.CPU_FLASH, True)[0]
    ref = math_attention(q, k, v, 0.35, True)[0]
    g1 = torch.autograd.grad(ours, (q, k, v), do, create_graph=True)
    r1 = torch.autograd.grad(ref, (q, k, v), do, create_graph=True)
    for pick in ((0,), (1,), (2,), (0, 2)):
        vs = [torch.randn_like(g1[i]) for i in pick]
        # (dv does not depend on v)
        got = torch.autograd.grad([g1[i] for i in pick], (q, k, v, do), vs, retain_graph=True,
                                  materialize_grads=True)
        close(got, torch.autograd.grad([r1[i] for i in pick], (q, k, v, do), vs,
                                       retain_graph=True, materialize_grads=True))
        assert all(same_layout(g, t) for g, t in zip(got, (q, k, v, do)))
    assert general_calls == [] and len(bob_calls) == 4
    assert all(call[11] is not None for call in bob_calls)      # dq


def test_a_dq_changed_in_place_is_not_read(cpp_node, bob_calls):
    torch.manual_seed(4)
    q, k, v = inputs(1, 2, 9, 9, 8)
    do = torch.randn(1, 2, 9, 8, dtype=torch.float64)
    ours = cpp_node.attention(q, k, v, None, 0.5, False, cpp_node.CPU_FLASH, True)[0]
    ref = math_attention(q, k, v, 0.5, False)[0]
    g1 = list(torch.autograd.grad(ours, (q, k, v), do, create_graph=True))
    r1 = list(torch.autograd.grad(ref, (q, k, v), do, create_graph=True))
    for g in (g1, r1):
        g[0].mul_(2)
    vs = [torch.randn_like(t) for t in g1]
    close(torch.autograd.grad(g1, (q, k, v), vs), torch.autograd.grad(r1, (q, k, v), vs))
    assert len(bob_calls) == 1 and bob_calls[0][11] is None


def test_a_dual_cotangent_goes_to_python(cpp_node, general_calls):
    """dO carrying a forward-mode tangent: the Python path (whose first backward has a jvp)."""
    import torch.autograd.forward_ad as fwAD
    torch.manual_seed(5)
    q, k, v = inputs(1, 1, 6, 6, 8)
    ours = cpp_node.attention(q, k, v, None, 0.5, True, cpp_node.CPU_FLASH, True)[0]
    ref = math_attention(q, k, v, 0.5, True)[0]
    do, tangent = torch.randn_like(ours), torch.randn_like(ours)
    with fwAD.dual_level():
        got = torch.autograd.grad(ours, (q, k, v), fwAD.make_dual(do, tangent),
                                  create_graph=True)
        want = torch.autograd.grad(ref, (q, k, v), fwAD.make_dual(do, tangent),
                                   create_graph=True)
        close([fwAD.unpack_dual(g).tangent for g in got],
              [fwAD.unpack_dual(w).tangent for w in want])
    assert len(general_calls) == 1


def test_lse_cotangent_goes_to_python(cpp_node, general_calls):
    torch.manual_seed(2)
    q, k, v = inputs(1, 2, 9, 9, 8)
    o, lse = cpp_node.attention(q, k, v, None, 0.5, True, cpp_node.CPU_FLASH, True)
    ro, rlse = math_attention(q, k, v, 0.5, True)
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    close(torch.autograd.grad((o, lse), (q, k, v), (do, dlse)),
          torch.autograd.grad((ro, rlse), (q, k, v), (do, dlse)))
    assert len(general_calls) == 1 and general_calls[0][6] is not None


def test_deterministic_algorithms_go_to_python(cpp_node, general_calls):
    """PyTorch's fused backwards accumulate with atomics: the op's deterministic path runs."""
    q, k, v = inputs(1, 1, 6, 6, 8)
    o = cpp_node.attention(q, k, v, None, 0.5, False, cpp_node.CPU_FLASH, True)[0]
    torch.use_deterministic_algorithms(True)
    try:
        grads = torch.autograd.grad(o.sum(), (q, k, v))
    finally:
        torch.use_deterministic_algorithms(False)
    close(grads, torch.autograd.grad(math_attention(q, k, v, 0.5, False)[0].sum(), (q, k, v)))
    assert len(general_calls) == 1


@pytest.mark.parametrize("which", ["general", "bob"])
def test_python_errors_keep_their_type(cpp_node, which):
    class Refused(Exception):
        pass

    def refusing(*args):
        raise Refused(f"from the {which} backward")
    setter = cpp_node.set_general_backward if which == "general" else cpp_node.set_bob_backward
    setter(refusing)
    try:
        q, k, v = inputs(1, 1, 4, 4, 8)
        # the chain form's create_graph backward calls the general backward, the folded
        # form's second order the BoB's
        o = cpp_node.attention(q, k, v, None, 0.5, False, cpp_node.CPU_FLASH, which == "bob")[0]
        with pytest.raises(Refused, match=f"from the {which} backward"):
            g = torch.autograd.grad(o.sum(), (q, k, v), create_graph=True)
            torch.autograd.grad(g[0].sum(), q)
    finally:
        cpp_node.set_general_backward(general_backward)
        cpp_node.set_bob_backward(bob_backward)


def test_saved_tensors_die_with_the_backward(cpp_node):
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64, requires_grad=True)
    q = x * 1
    alive = weakref.ref(q)
    o = cpp_node.attention(q, x, x, None, 0.3, True, cpp_node.CPU_FLASH, True)[0]
    del q
    gc.collect()
    assert alive() is not None
    torch.autograd.grad(o.sum(), x)
    gc.collect()
    assert alive() is None


# ----------------------------------------------------------------------------- routing
@pytest.fixture
def cpu_kernels_as_native(cpp_node, monkeypatch):
    """Let bob_compile.attention take the node on the CPU, as it does on CUDA where
    PyTorch's fused kernels compute the call (routes remembered meanwhile are dropped
    after)."""
    monkeypatch.setattr(eager_node, "_call_path",
                        lambda *args: types.SimpleNamespace(native="cpu_flash"))
    cpp_node.forget_routes()
    yield
    cpp_node.forget_routes()


def _is_cpp_node(t):
    return type(t.grad_fn).__name__ == "CppFunction"


def test_attention_takes_the_node(cpu_kernels_as_native, general_calls):
    q, k, v = inputs(2, 2, 8, 8, 16, "blhd")
    o = bob_compile.attention(q, k, v, is_causal=True)
    assert _is_cpp_node(o)
    do = torch.randn_like(o)
    ref = math_attention(q, k, v, 16 ** -0.5, True)[0]
    close(torch.autograd.grad(o, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do))
    assert general_calls == []


def test_attention_without_grad_takes_the_forward_alone(cpp_node, cpu_kernels_as_native,
                                                        monkeypatch):
    ran = []
    real = cpp_node.forward_output
    monkeypatch.setattr(cpp_node, "forward_output", lambda *a: ran.append(1) or real(*a))
    q, k, v = inputs(1, 2, 6, 9, 8)
    want = math_attention(q, k, v, 8 ** -0.5, False)[0]
    with torch.no_grad():
        o = bob_compile.attention(q, k, v)
    assert ran == [1] and o.grad_fn is None
    close((o,), (want,))
    cpp_node.forget_routes()    # (else the C++ entry, which calls the C++ function itself)
    o = bob_compile.attention(q.detach(), k.detach(), v.detach())      # nothing requires grad
    assert ran == [1, 1] and o.grad_fn is None
    close((o,), (want,))


def test_attention_without_the_node(cpu_kernels_as_native, reread_settings, monkeypatch):
    """Where the node must not run: forward-mode AD, torch.func, a mask, the profiler, a
    compiled graph's kernel choices, BOB_COMPILE_CPP_NODE=off."""
    q, k, v = inputs(1, 2, 6, 6, 8)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    assert not _is_cpp_node(bob_compile.attention(q, k, v, attn_mask=mask))
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(q, torch.randn_like(q))
        assert not _is_cpp_node(bob_compile.attention(dual, k, v))
    assert torch.func.grad(lambda x: bob_compile.attention(x, k, v).sum())(q).shape == q.shape
    with torch.profiler.profile():
        assert not _is_cpp_node(bob_compile.attention(q, k, v))
    with settings.using(settings.KernelChoices.of(bob_form="chain")):
        assert not _is_cpp_node(bob_compile.attention(q, k, v))
    assert _is_cpp_node(bob_compile.attention(q, k, v))
    monkeypatch.setenv("BOB_COMPILE_CPP_NODE", "off")
    settings.reload()
    assert not _is_cpp_node(bob_compile.attention(q, k, v))


# ----------------------------------------------------------------------------- the build
@pytest.fixture
def unbuilt(monkeypatch, cpp_node):
    """native_node as before its first use (restored after the test). After the session's
    build (cpp_node), which conftest may have started in the background: a build still
    running would write into the state this fixture replaces."""
    monkeypatch.setattr(eager_node, "_extension", None)
    monkeypatch.setattr(eager_node, "_build_started", False)
    monkeypatch.setattr(eager_node, "_ready", eager_node.threading.Event())


def test_a_failed_build_is_logged_and_the_python_node_runs(unbuilt, monkeypatch, caplog):
    import torch.utils.cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    with caplog.at_level(logging.WARNING, logger="bob_compile.eager"):
        assert eager_node.extension(wait=True) is None
    assert "Ninja is required" in caplog.text and "BOB_COMPILE_CPP_NODE=off" in caplog.text
    assert eager_node.extension(wait=True) is None      # tried once, not on every call


def test_off_never_builds(unbuilt, reread_settings, monkeypatch):
    import torch.utils.cpp_extension
    monkeypatch.setenv("BOB_COMPILE_CPP_NODE", "off")
    settings.reload()
    monkeypatch.setattr(torch.utils.cpp_extension, "load", pytest.fail)
    assert eager_node.extension() is None


def test_an_unknown_build_setting_is_an_error(reread_settings, monkeypatch):
    monkeypatch.setenv("BOB_COMPILE_CPP_NODE", "sometimes")
    with pytest.raises(ValueError, match="BOB_COMPILE_CPP_NODE='sometimes'.*background"):
        settings.reload()


def test_saved_tensor_hooks_and_checkpointing(cpu_kernels_as_native):
    """The node's saved tensors go through torch.autograd.graph.saved_tensors_hooks, so
    activation checkpointing and offloading work at first and second order."""
    from torch.utils.checkpoint import checkpoint
    q, k, v = inputs(2, 2, 9, 9, 8)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t):
        o = bob_compile.attention(q, k, v, is_causal=True)
    assert _is_cpp_node(o) and len(packed) == 5         # q, k, v, o, lse

    def loss(q, k, v):
        return bob_compile.attention(q, k, v, is_causal=True).square().sum()

    def loss_math(q, k, v):
        return math_attention(q, k, v, 8 ** -0.5, True)[0].square().sum()
    for create_graph in (False, True):
        got = torch.autograd.grad(checkpoint(loss, q, k, v, use_reentrant=False), (q, k, v),
                                  create_graph=create_graph)
        want = torch.autograd.grad(loss_math(q, k, v), (q, k, v), create_graph=create_graph)
        close(got, want)
        if create_graph:
            close(torch.autograd.grad(sum(g.sum() for g in got), (q, k, v)),
                  torch.autograd.grad(sum(w.sum() for w in want), (q, k, v)))


def test_a_refused_forward_is_logged_and_the_python_path_runs(cpp_node, monkeypatch, caplog):
    """PyTorch's kernel refusing the inputs (here cuDNN's forward, given CPU tensors) is
    logged, that configuration is marked for the Triton kernels, and the call runs the
    op's Python path: the same result."""
    from bob_compile.kernels import native_sdpa
    monkeypatch.setattr(native_sdpa, "failed", set())
    monkeypatch.setattr(eager_node, "_call_path",
                        lambda *args: types.SimpleNamespace(native="cudnn"))
    q, k, v = inputs(1, 2, 7, 7, 8)
    with caplog.at_level(logging.WARNING, logger="bob_compile.kernels"):
        o = bob_compile.attention(q, k, v, is_causal=True)
    assert not _is_cpp_node(o)
    assert "PyTorch fused attention (cudnn) failed" in caplog.text
    assert native_sdpa.failed == {("cudnn", torch.float64, 8, 8, True)}
    want = math_attention(q, k, v, 8 ** -0.5, True)[0]
    close((o,), (want,))
    close(torch.autograd.grad(o.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v)))


# ----------------------------------------------------------------------------- programs
def test_programs_of_recorded_stages(cpp_node):
    """What programs.py makes of a Triton stage (a launch recorded by hand: without a GPU
    nothing launches): the inputs first among the slots, then each tensor the stage made,
    fresh (sizes, strides, dtype) or a view (its base slot and offset); the outputs by slot;
    each launch argument a slot's address or stride, or a constant, with Triton's
    specialization of it. No program where the stage did more than allocate and view,
    launched on a tensor it neither got nor made, got one tensor in two roles, or launched
    otherwise than through a remembered launch config."""
    import types
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from bob_compile.eager import programs
    from bob_compile.kernels import launching
    from bob_compile.kernels.triton_backward import _row_dot_kernel

    do = torch.randn(2, 5, 3, 8, dtype=torch.bfloat16).transpose(1, 2)    # strides 120, 8, 24, 1
    o = torch.randn(2, 3, 5, 8, dtype=torch.bfloat16)
    outside = torch.empty(2, 3, 5)
    names, _ = launching.runtime_parameters(_row_dot_kernel)

    def stage(do, o, then=None, d_from_outside=False, direct_launch=True, kept=True):
        with programs.recorded_stage() as recorded:
            d = outside if d_from_outside else torch.empty(o.shape[:3])
            rows = d.unsqueeze(-1)[:, 1:]
            args = launching.packer(_row_dot_kernel)(DO=do, O=o, DLSE=d, D=d,
                                                         num_q_heads=3, L=5)
            signature = {n: native_specialize_impl(BaseBackend, a, False, True, True)[0]
                         for n, a in zip(names, args)}
            direct = types.SimpleNamespace(
                compiled=types.SimpleNamespace(src=types.SimpleNamespace(signature=signature)),
                function=99, metadata=(4, 1, 512), cooperative=False, pdl=False)
            recorded.record.launches.append(
                (_row_dot_kernel, (1, 6), args, direct if direct_launch else None, kept))
            if then is not None:
                then(d)
        return recorded, d, rows

    recorded, d, rows = stage(do, o)
    assert programs.replays_complete(recorded.record)
    made, launches, outputs = recorded.program(cpp_node, (do, o), [(d, None), (rows, 0)])
    fresh, unsqueezed, sliced = made
    assert fresh == (-1, [2, 3, 5], [15, 5, 1], 0, cpp_node.scalar_type_code(d))
    assert unsqueezed[:4] == (2, [2, 3, 5, 1], [15, 5, 1, 1], 0)       # a view of slot 2
    assert sliced[:4] == (3, [2, 2, 5, 1], [15, 5, 1, 1], 5)            # of slot 3, 5 further
    assert outputs == [(2, -1), (4, 0)]
    (launch,) = launches
    assert launch[:5] == (99, 1, 6, 128, 512)        # function, grid, threads, shared bytes
    got = dict(zip(names, launch[5], strict=True))
    kind = cpp_node.ARG_KINDS.index
    assert got["DO"][:2] == (kind("pointer"), 0) and got["O"][:2] == (kind("pointer"), 1)
    assert got["D"][:2] == got["DLSE"][:2] == (kind("pointer"), 2)
    assert got["DO"][5] == cpp_node.scalar_type_code(do) != cpp_node.scalar_type_code(d)
    # strides of 1 are compiled in: checked on every replay, not passed
    assert got["sde"] == (kind("stride_one"), 0, 3, 0, 0, 0, 0, 0.0)
    assert got["sdl"] == (kind("stride"), 0, 2, 0, 0, 0, 0, 0.0)     # 24: not divisible by 16
    assert got["sdb"][:4] == (kind("stride"), 0, 0, 0)                 # 120
    assert got["sob"][:4] == (kind("stride"), 1, 0, 0)                 # 120
    assert got["num_q_heads"] == (kind("int32"), 0, 0, 0, 0, 0, 3, 0.0)
    # the node takes it; registering makes one replayable program, reloading drops it
    before = cpp_node.program_count()
    cpp_node.register_program(1, [do, o, None], 1.0, False, True, made, launches, outputs)
    assert cpp_node.program_count() == before + 1
    cpp_node.register_program(1, [do, o, do], 1.0, False, False, [], [], [])
    assert cpp_node.program_count() == before + 1       # marked: Python runs it
    cpp_node.forget_programs()
    assert cpp_node.program_count() == 0

    assert stage(do, o, then=lambda d: d.zero_())[0].program(cpp_node, (do, o), []) is None
    assert stage(do, o, d_from_outside=True)[0].program(cpp_node, (do, o), []) is None
    for launched_otherwise in (stage(do, o, direct_launch=False)[0],   # Triton's launcher
                               stage(do, o, kept=False)[0]):           # a provisional config
        assert not programs.replays_complete(launched_otherwise.record)
        assert launched_otherwise.program(cpp_node, (do, o), []) is None
    assert recorded.program(cpp_node, (do, do), [(d, None)]) is None      # two roles
    assert recorded.program(cpp_node, (do, o), [(outside, None)]) is None  # not the stage's
    recorded.record.launches[0] = (*recorded.record.launches[0][:4], False)
    assert not programs.replays_complete(recorded.record)        # a provisional config
    assert recorded.program(cpp_node, (do, o), [(d, None)]) is None


@pytest.fixture
def blockwise_stages(cpp_node):
    """The masked node's stages (kernels TRITON) run by the blockwise CPU kernels, as
    eager_node.run_triton_stage runs the Triton ones on CUDA (the same inputs and outputs;
    never recorded: no driver here), so that the masked node's plumbing runs on the CPU in
    float64. Yields the names of the stages run."""
    from bob_compile.kernels import blockwise, triton_masks
    from bob_compile.kernels.params import AttentionParams
    ran = []

    def stage(number, inputs, scale, causal, wants_program):
        assert not wants_program
        ran.append(cpp_node.STAGES[number])
        if number == 0:
            *tensors, mask = inputs
        elif number == 1:
            *tensors, mask, _ = inputs                  # the mask's summary: not needed here
        else:
            *tensors, mask, _, keys_out = inputs
            assert keys_out is None                     # computed by the node for fused kernels
        params = AttentionParams(scale=scale, causal=causal, mask=mask)
        if number == 0:
            return (*blockwise.forward(*tensors, params), triton_masks.summarize_with_torch(mask))
        if number == 1:
            return blockwise.backward(*tensors, None, params)
        q, k, v, o, lse, do, dq, gdq, gdk, gdv = tensors
        return blockwise.bob_folded(q, k, v, o, lse, do, None, gdq, gdk, gdv, dq, params)[:4]

    cpp_node.set_triton_stage(stage)
    yield ran
    cpp_node.set_triton_stage(eager_node.run_triton_stage)


def masked_math_attention(q, k, v, mask, scale):
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    L, S = s.shape[-2:]
    return s.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf")).softmax(-1) @ v


def test_masked_node_at_every_order(cpp_node, blockwise_stages):
    """A masked call through the node (kernels TRITON): forward, first backward and folded BoB
    in its stages, the mask's summary kept from the forward for the backwards, a third order
    by the op's Python path with the mask; all equal to autograd through math attention."""
    torch.manual_seed(2)
    q, k, v = inputs(2, 2, 11, 11, 8, "blhd")
    mask = torch.rand(2, 1, 11, 11) > 0.4
    mask[..., 0] = True         # every row sees a key (math attention gives NaN otherwise)
    flat = mask.expand(2, 2, 11, 11)

    def ours(q, k, v):
        return cpp_node.attention(q, k, v, flat, 0.4, True, cpp_node.TRITON, True)[0]

    def math(q, k, v):
        return masked_math_attention(q, k, v, flat, 0.4)

    do, t = torch.randn(2, 2, 11, 8, dtype=torch.float64), torch.randn(2, 2, 11, 8)
    results = []
    for attend in (ours, math):
        o = attend(q, k, v)
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
        hvp = torch.autograd.grad((dq * t).sum() + dk.square().sum(), (q, k, v),
                                  create_graph=True)
        third = torch.autograd.grad(hvp[1].square().sum(), (q, v))
        results.append((o, dq, dk, dv, *hvp, *third))
    assert type(results[0][0].grad_fn).__name__ == "CppFunction"
    assert blockwise_stages == ["forward", "backward", "bob_folded"]
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_masked_node_errors(cpp_node, blockwise_stages):
    """A mask modified in place before the backward is refused, as autograd refuses it; a
    Python exception raised in a stage reaches the caller as itself."""
    q, k, v = inputs(1, 1, 5, 5, 8)
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool)
    o = cpp_node.attention(q, k, v, mask, 0.5, False, cpp_node.TRITON, True)[0]
    mask[0, 0, 0, 0] = False
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.sum().backward()

    def refuse(*args):
        raise ValueError("no stage here")
    cpp_node.set_triton_stage(refuse)
    with pytest.raises(ValueError, match="no stage here"):
        cpp_node.attention(q, k, v, mask, 0.5, False, cpp_node.TRITON, True)


# ----------------------------------------------------------------------------- the C++ entry
@pytest.fixture
def python_calls(cpu_kernels_as_native, monkeypatch):
    """How many bob_compile.attention calls ran their Python lines (not the C++ entry)."""
    module = sys.modules["bob_compile.attention"]
    calls = []
    real = module._check_inputs
    monkeypatch.setattr(module, "_check_inputs", lambda *a: calls.append(1) or real(*a))
    return calls


def test_repeated_calls_take_the_cpp_entry(python_calls):
    q, k, v = inputs(2, 2, 9, 9, 8, "blhd")
    for grad in (True, False, True):
        with torch.set_grad_enabled(grad):
            o = bob_compile.attention(q, k, v, is_causal=True)
        assert _is_cpp_node(o) == grad
        want = math_attention(q, k, v, 8 ** -0.5, True)[0]
        close((o,), (want,))
        assert same_layout(o, q)
    assert len(python_calls) == 1           # the first call decides the route
    do = torch.randn_like(o)
    close(torch.autograd.grad(o, (q, k, v), do), torch.autograd.grad(want, (q, k, v), do))
    bob_compile.attention(q, k, v, is_causal=True, scale=0.25)     # another signature
    bob_compile.attention(q, k, v, is_causal=True, scale=0.25)
    assert len(python_calls) == 2


def test_the_cpp_entry_declines_what_python_must_see(python_calls):
    """Each of these calls runs attention()'s Python lines (the same results as there)."""
    import numpy
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode
    q, k, v = inputs(1, 2, 6, 6, 8)
    want = math_attention(q, k, v, 8 ** -0.5, False)[0]
    bob_compile.attention(q, k, v)
    assert len(python_calls) == 1

    class Subclass(torch.Tensor):
        pass

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class FunctionPassThrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def check(o, reason):
        before = len(python_calls)
        close((o if isinstance(o, torch.Tensor) else o(),), (want,))
        assert len(python_calls) == before + 1, reason
    check(lambda: bob_compile.attention(q, k, v, scale=numpy.float64(8 ** -0.5)), "numpy scale")
    check(lambda: bob_compile.attention(q, k, v, scale=torch.tensor(8 ** -0.5, dtype=torch.float64)), "tensor scale")
    check(lambda: bob_compile.attention(q, k, v, attn_mask=torch.ones(6, 6, dtype=torch.bool)),
          "mask")
    check(lambda: bob_compile.attention(q.as_subclass(Subclass), k, v), "subclass")
    with torch.profiler.profile():
        check(lambda: bob_compile.attention(q, k, v), "profiler")
    with PassThrough():
        check(lambda: bob_compile.attention(q, k, v), "dispatch mode")
    with FunctionPassThrough():
        check(lambda: bob_compile.attention(q, k, v), "torch function mode")
    with settings.using(settings.KernelChoices.of(bob_form="chain")):
        check(lambda: bob_compile.attention(q, k, v), "kernel choices")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=True):
        before = len(python_calls)
        bob_compile.attention(q, k, v)
        assert len(python_calls) == before + 1, "autocast"
    with torch.inference_mode():
        check(lambda: bob_compile.attention(q.detach(), k.detach(), v.detach()), "inference")
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(q, torch.randn_like(q))
        check(lambda: bob_compile.attention(dual, k, v), "forward-mode tangent")
        check(lambda: bob_compile.attention(q, k, v), "a dual level open")
    before = len(python_calls)
    got = torch.func.grad(lambda x: bob_compile.attention(x, k, v).sum())(q)
    close((got,), torch.autograd.grad(want.sum(), q))
    assert len(python_calls) > before, "torch.func"
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        bob_compile.attention(q, k, v, is_causal=1)
    kv_heads = inputs(1, 1, 6, 6, 8)[1]
    with pytest.raises(RuntimeError, match="do not broadcast|heads"):
        bob_compile.attention(q, kv_heads.expand(1, 3, 6, 8), kv_heads.expand(1, 3, 6, 8))


def test_calls_of_other_ranks_are_left_to_python(cpp_node):
    """The entry and its routes take 4-D inputs only; 3-D and 2-D calls (reshaped by ops.py)
    run the Python lines every time, with the same results as math attention."""
    for shape in ((3, 7, 8), (7, 8)):
        q, k, v = (torch.randn(*shape, dtype=torch.float64, requires_grad=True)
                   for _ in range(3))
        for _ in range(2):
            o = bob_compile.attention(q, k, v, is_causal=True)
            close((o,), (math_attention(q, k, v, 8 ** -0.5, True)[0],))


def test_no_cpp_entry_when_off(cpu_kernels_as_native, reread_settings, monkeypatch):
    assert eager_node.fast_entry is not None
    monkeypatch.setenv("BOB_COMPILE_CPP_NODE", "off")
    settings.reload()
    assert eager_node.fast_entry is None


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, caplog):
    """Without OS locks: torch's build lock left by a build killed midway would make every
    later build wait forever; one younger than STALE_BUILD_LOCK_S may be a live build in
    another process."""
    import os
    import time
    lock = tmp_path / "lock"
    lock.touch()
    eager_node._clear_stale_build_lock(str(tmp_path))
    assert lock.exists()                        # fresh: another process may be building
    old = time.time() - eager_node.STALE_BUILD_LOCK_S - 60
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger="bob_compile.eager"):
        eager_node._clear_stale_build_lock(str(tmp_path))
    assert not lock.exists() and "stale C++ node build lock" in caplog.text
    eager_node._clear_stale_build_lock(str(tmp_path))     # no lock: nothing to do


@pytest.mark.skipif(eager_node.fcntl is None, reason="no OS file locks (Windows)")
def test_a_build_waits_for_a_live_build_and_clears_a_dead_ones_lock(tmp_path, caplog):
    """Each load() holds the folder's OS lock, which the system releases when its holder
    dies: a build waits while another holds it, and a torch lock found once it holds it is
    a dead build's, however fresh (a process that exited during the background build left
    one, and the next test session's build waited on it forever)."""
    import threading
    fcntl = eager_node.fcntl
    lock = tmp_path / "lock"
    lock.touch()
    live = open(tmp_path / eager_node.BUILD_FLOCK, "a")
    fcntl.flock(live, fcntl.LOCK_EX)               # another process inside load()
    entered = threading.Event()

    def build():
        with eager_node._exclusive_build(str(tmp_path)):
            entered.set()
    with caplog.at_level(logging.WARNING, logger="bob_compile.eager"):
        waiting = threading.Thread(target=build, daemon=True)
        waiting.start()
        assert not entered.wait(0.5) and lock.exists()
        fcntl.flock(live, fcntl.LOCK_UN)           # it dies, its torch lock left behind
        live.close()
        assert entered.wait(10)
        waiting.join(10)
    assert not lock.exists() and "its build died" in caplog.text