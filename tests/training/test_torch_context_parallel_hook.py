"""bob_compile/torch_context_parallel.py's wrapping of PyTorch's context-parallel SDPA, in
one process (the multi-rank behaviour: test_context_parallel.py): PyTorch's own
`_distribute_function` and `_restore_function` on a stand-in module, so that no process
group is needed. Outside a flashbob trace the wrapper calls PyTorch's; PyTorch's restore
finds it; a context entered before the import is wrapped too."""
import types

import pytest
import torch
import torch.nn.functional as F

from bob_compile import flashbob
from bob_compile import torch_context_parallel as hook

cp = hook._context_parallel_module()
pytestmark = pytest.mark.skipif(cp is None, reason="torch has no context parallelism here")


class InputFn:
    """Stands for PyTorch's bound `sdpa_input_fn` (its instance carries seq_dim)."""
    seq_dim = 2

    def __init__(self):
        self.calls = 0

    def __call__(self, module, args, kwargs, mesh):
        self.calls += 1
        return args, kwargs


def stand_in_module():
    return types.SimpleNamespace(scaled_dot_product_attention=hook._SDPA)


def patched(module, distribute):
    input_fn = InputFn()
    mesh = object()
    distribute(hook._SDPA, module, mesh, input_fn.__call__, lambda m, i, out, mesh: out)
    return input_fn


def test_wrapped_as_pytorch_installs_it_and_restored_on_exit():
    module = stand_in_module()
    input_fn = patched(module, cp._distribute_function)
    ours = module.scaled_dot_product_attention
    assert getattr(ours, "bob_compile_wrapper", False), "PyTorch's wrapper was not wrapped"
    q = torch.randn(1, 2, 5, 4)
    torch.testing.assert_close(ours(q, q, q, is_causal=True),
                               hook._SDPA(q, q, q, is_causal=True))
    assert input_fn.calls == 1, "outside a flashbob trace PyTorch's wrapper must run"
    cp._restore_function(ours, module)
    assert module.scaled_dot_product_attention is hook._SDPA


def test_a_context_entered_before_the_import_is_wrapped():
    module = stand_in_module()
    original = cp._distribute_function
    # PyTorch's own function, as it was before bob_compile hooked it
    unhooked = original.__closure__[[c for c in original.__code__.co_freevars].index(
        "distribute")].cell_contents
    patched(module, unhooked)
    theirs = module.scaled_dot_product_attention
    assert not getattr(theirs, "bob_compile_wrapper", False)
    hook._wrap_already_installed(cp, module)
    ours = module.scaled_dot_product_attention
    assert getattr(ours, "bob_compile_wrapper", False)
    cp._restore_function(ours, module)
    assert module.scaled_dot_product_attention is hook._SDPA


def test_install_is_idempotent_and_leaves_F_alone():
    hooked = cp._distribute_function
    hook.install()
    assert cp._distribute_function is hooked
    assert F.scaled_dot_product_attention is hook._SDPA


def test_not_compiling_for_flashbob_outside_a_trace():
    assert not torch.compiler.is_compiling()
    seen = []

    def f(x):
        seen.append(hook._tracing_for_flashbob())
        return x + 1
    torch.compile(f, backend="flashbob")(torch.randn(2))
    torch.compile(f, backend="eager")(torch.randn(3))
    torch.compile(f, backend="flashbob", options={"compiler": "eager"})(torch.randn(4))
    torch.compile(f, backend=flashbob)(torch.randn(5))
    assert seen == [True, False, True, True]
