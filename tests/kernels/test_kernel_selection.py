"""Which implementation runs: blockwise on CPU, a forced choice through BOB_COMPILE_KERNELS,
and a clear error for an unknown one; the settings page generated from the switches."""
import pathlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from bob_compile import attention
from bob_compile import kernels, settings_doc
from bob_compile.kernels import blockwise, reference, settings
from models import CASES, SDPABlock, loss_of


_reference_forward = reference.forward


def qkv():
    return (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(3))


def test_cpu_tensors_take_the_blockwise_path(monkeypatch):
    monkeypatch.delenv("BOB_COMPILE_KERNELS", raising=False)
    settings.reload()
    assert kernels.select(*qkv()) is blockwise


def test_forced_reference_is_used_by_the_op(monkeypatch):
    calls = []
    monkeypatch.setenv("BOB_COMPILE_KERNELS", "reference")
    settings.reload()
    monkeypatch.setattr(reference, "forward", lambda *a: calls.append(1) or _reference_forward(*a))
    q, k, v = qkv()
    attention(q, k, v, is_causal=True)
    assert calls == [1]


@pytest.mark.parametrize("name,value,valid", [
    ("BOB_COMPILE_KERNELS", "fast", r"blockwise, reference, triton"),
    ("BOB_COMPILE_NATIVE_BACKEND", "cudnn9", r"cudnn, flash, none"),
    ("BOB_COMPILE_DEV_BWD_DQ", "atomics", r"two_pass, atomic"),
    ("BOB_COMPILE_DEV_BOB_SCHEDULE", "twopass", r"two_pass, atomic"),
    ("BOB_COMPILE_DEV_BOB_FORM", "flashbob", r"auto, folded, chain"),
    ("BOB_COMPILE_TUNE", "no", r"1, 0"),
    ("BOB_COMPILE_DEV_FAST_LAUNCH", "off", r"1, 0"),
])
def test_an_unknown_value_is_an_error_that_lists_the_valid_ones(monkeypatch, name, value, valid):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}='{value}': expected one of {valid}"):
        settings.reload()


@pytest.mark.parametrize("old,new", [("BOB_COMPILE_NATIVE_SDPA", "BOB_COMPILE_NATIVE_BACKEND=none"),
                                     ("BOB_COMPILE_BOB_FORM", "BOB_COMPILE_DEV_BOB_FORM")])
def test_a_renamed_variable_says_what_replaced_it(monkeypatch, old, new):
    monkeypatch.setenv(old, "0")
    with pytest.raises(ValueError, match=f"{old} was renamed: set {new}"):
        settings.reload()


def test_the_settings_page_is_generated_from_the_switches():
    """docs/settings.md is `python -m bob_compile.settings_doc`'s output (regenerate it after
    changing a switch or an option)."""
    page = pathlib.Path(__file__).resolve().parents[2] / "docs" / "settings.md"
    assert page.read_text() == settings_doc.settings_markdown()


def test_empty_values_mean_the_default(monkeypatch):
    for name in ("BOB_COMPILE_KERNELS", "BOB_COMPILE_DEV_BWD_DQ", "BOB_COMPILE_TUNE"):
        monkeypatch.setenv(name, "")
    s = settings.reload()
    assert s.kernels is None and not s.bwd_dq_atomics and s.tune


# ---------------------------------------------------------------------------- PyTorch's fused kernels
def test_a_refused_native_configuration_falls_back_for_that_configuration_only(monkeypatch):
    """A configuration cuDNN/flash refuses runs Triton from then on; other configurations
    keep the native kernel; out-of-memory propagates and switches nothing off."""
    native_sdpa = pytest.importorskip("bob_compile.kernels.native_sdpa")
    monkeypatch.setattr(native_sdpa, "failed", set())
    q64, v64 = torch.empty(1, 1, 4, 64), torch.empty(1, 1, 4, 64)
    q128 = torch.empty(1, 1, 4, 128)

    def refuses(backend, q, k, v, scale, causal):
        raise RuntimeError("cuDNN Frontend error: No valid execution plans built.")

    def out_of_memory(backend, q, k, v, scale, causal):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        native_sdpa.attempt("cudnn", out_of_memory, q64, q64, v64, 0.1, True)
    assert native_sdpa.failed == set()
    assert native_sdpa.attempt("cudnn", refuses, q64, q64, v64, 0.1, True) is None
    failed = native_sdpa.failed
    assert native_sdpa.key("cudnn", q64, v64, True) in failed
    assert native_sdpa.key("cudnn", q64, v64, False) not in failed
    assert native_sdpa.key("cudnn", q128, q128, True) not in failed


# --------------------------------------------------------------------------------------
# Kernel choices per compile (flashbob options), in every order
# --------------------------------------------------------------------------------------
def hvp(model, x):
    params = list(model.parameters())
    grads = torch.autograd.grad(loss_of(model(x)), params, create_graph=True)
    return torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params])


@pytest.fixture
def selections(monkeypatch):
    """The implementation modules kernels.select picked, by name, in call order."""
    picked = []
    original = kernels.select

    def spy(q, k, v):
        module = original(q, k, v)
        picked.append(module.__name__.rpartition(".")[2])
        return module
    monkeypatch.setattr(kernels, "select", spy)
    return picked


@pytest.mark.parametrize("compiler", ["aot_eager", "eager"])   # training route, eager route
def test_options_choose_the_kernels_of_every_order(selections, compiler):
    from bob_compile.backend import flashbob
    torch._dynamo.reset()
    model = SDPABlock().double()
    x, = CASES["sdpa"].batch(0)
    with sdpa_kernel(SDPBackend.MATH):          # the only SDPA with a double backward
        expected = hvp(model, x)
    selections.clear()
    compiled = torch.compile(model, backend=flashbob,
                             options={"kernels": "reference", "compiler": compiler})
    actual = hvp(compiled, x)
    assert max((a - e).abs().max().item() for a, e in zip(actual, expected)) < 1e-10
    # forward, backward (create_graph), BoB, second backward: all forced
    assert len(selections) >= 4 and set(selections) == {"reference"}, selections
    selections.clear()
    other = torch.compile(SDPABlock().double(), backend=flashbob, options={"compiler": compiler})
    hvp(other, x)                       # another compile, without the option
    assert len(selections) >= 4 and set(selections) == {"blockwise"}, selections
    selections.clear()
    attention(*qkv())                   # and the op in plain code, outside both
    assert selections == ["blockwise"]


@pytest.mark.parametrize("options,error", [
    ({"kernels": "cuda"}, r"options\['kernels'\]='cuda'; expected one of \['blockwise', "),
    ({"native_backend": "cudnn9"}, r"\['cudnn', 'flash', 'none'\]"),
    ({"bwd_dq": "atomics"}, r"\['two_pass', 'atomic'\]"),
    ({"bob_form": "fold"},
     r"options\['bob_form'\]='fold'; expected one of \['auto', 'folded', 'chain'\]"),
    ({"tune": "no"}, r"options\['tune'\] must be True or False"),
])
def test_bad_kernel_options_say_what_is_valid(options, error):
    from bob_compile import options as options_module
    with pytest.raises((ValueError, TypeError), match=error):
        options_module.parse(options)


def test_bob_form_option_applies_over_the_environment():
    """options={'bob_form': ...} reaches kernels.fold_bob through the graph's KernelChoices."""
    from bob_compile import kernels, options as options_module
    settings.reload()
    q = torch.randn(1, 1, 3, 8)
    assert kernels.fold_bob(q, q, q)                            # auto, blockwise: folded
    with settings.using(options_module.parse({"bob_form": "chain"}).kernel_choices):
        assert not kernels.fold_bob(q, q, q)
    assert kernels.fold_bob(q, q, q)


def test_choices_apply_over_the_environment(monkeypatch):
    monkeypatch.setenv("BOB_COMPILE_DEV_BWD_DQ", "atomic")
    base = settings.reload()
    choices = settings.KernelChoices(kernels="reference", tune=False)
    with settings.using(choices):
        inside = settings.current()
        assert settings.overridden() is choices
    assert (inside.kernels, inside.tune, inside.bwd_dq_atomics) == ("reference", False, True)
    assert settings.current() is base and settings.overridden() is None


def test_no_kernel_option_means_nothing_to_apply():
    """Without kernel options a compile carries None, which the runtime tests with `is`
    on every step (no per-step work for a feature that is not used)."""
    from bob_compile import options as options_module
    assert options_module.parse({}).kernel_choices is None
    assert options_module.parse({"compiler": "aot_eager"}).kernel_choices is None
    assert options_module.parse({"tune": False}).kernel_choices == settings.KernelChoices(tune=False)


# --------------------------------------------------------------------------------------
# Triton kernels a device cannot build: a logged fallback, never an error or a wrong result
# --------------------------------------------------------------------------------------
def test_forward_mode_kernels_that_cannot_be_built_fall_back_to_blockwise(monkeypatch, caplog):
    triton_attention = pytest.importorskip("bob_compile.kernels.triton_attention")
    from triton.runtime.errors import OutOfResources
    from bob_compile.kernels.params import AttentionParams

    def cannot_build(*args):
        raise OutOfResources(300_000, 232_448, "shared memory")
    monkeypatch.setattr(triton_attention, "attention_forward_jvp", cannot_build)
    monkeypatch.setattr(triton_attention, "_forward_mode_failed", set())
    q, k, v = qkv()
    params = AttentionParams(scale=0.5, causal=True)
    o, lse = reference.forward(q, k, v, params)
    tq = torch.randn_like(q)
    with caplog.at_level("WARNING", logger="bob_compile.kernels"):
        outs = triton_attention.forward_jvp(q, k, v, o, lse, tq, None, None, params)
    expected = reference.forward_jvp(q, k, v, o, lse, tq, None, None, params)
    for a, e in zip(outs, expected):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)
    assert "failed to build" in caplog.text and "OutOfResources: " in caplog.text
    assert ("forward_jvp", q.dtype, 4, 4) in triton_attention._forward_mode_failed


def test_a_build_error_is_logged_by_its_type_and_first_line():
    from bob_compile.kernels.tuning import error_summary
    assert error_summary(ValueError("first\nsecond")) == "ValueError: first"
    assert error_summary(RuntimeError()) == "RuntimeError: "
    assert error_summary(RuntimeError("x" * 300)) == "RuntimeError: " + "x" * 200


def test_mask_summary_kernels_that_cannot_be_built_fall_back_to_torch(monkeypatch, caplog):
    triton_masks = pytest.importorskip("bob_compile.kernels.triton_masks")
    from triton.runtime.errors import OutOfResources

    def cannot_build(key, kwargs):
        raise OutOfResources(300_000, 232_448, "shared memory")
    monkeypatch.setattr(triton_masks, "fixed_plan", cannot_build)
    monkeypatch.setattr(triton_masks, "_build_failed", [])
    mask = (torch.arange(6)[None, :] < torch.tensor([6, 3])[:, None])[:, None, None, :]
    mask = mask.expand(2, 3, 5, 6)
    with caplog.at_level("WARNING", logger="bob_compile.kernels"):
        summary = triton_masks.mask_summary(mask)
    assert torch.equal(summary, triton_masks.summarize_with_torch(mask))
    assert summary[1, 0, 0, :3].tolist() == [0, 3, triton_masks.KEYS_IN_RANGE]
    assert "failed to build" in caplog.text and triton_masks._build_failed
