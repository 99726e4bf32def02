"""The key of a cached pair (bob_compile/training/pair_cache.py): whatever the traced halves
depend on changes it, and what it cannot pin down is not cached at all. A wrong hit would
hand one graph another's compiled derivatives, so each ingredient is checked here; the
warm start itself is tested in test_compile_cache.py."""
import pytest
import torch
from torch import fx

from bob_compile.training import pair_cache


def traced(function, *inputs):
    return fx.symbolic_trace(function), list(inputs)


def key_of(gm, inputs, options=("inductor",)):
    return pair_cache.key(gm, inputs, options)


def scaled(x, y):
    return torch.sin(x) * y


def example():
    return traced(scaled, torch.randn(3, 4, requires_grad=True), torch.randn(3, 4))


def test_the_same_graph_and_inputs_give_the_same_key():
    gm, inputs = example()
    again, inputs_again = example()
    assert key_of(gm, inputs) == key_of(again, inputs_again)


def test_node_names_do_not_change_the_key():
    """A model's blocks split apart (by DDP, or by a graph break in each) differ only in
    their node names: one entry serves them all."""
    import copy
    gm, inputs = example()
    renamed = copy.deepcopy(gm)
    for i, node in enumerate(renamed.graph.nodes):
        if node.op != "output":
            node.name = f"block_3_value_{i}"
            if node.op == "placeholder":
                node.target = node.name
    renamed.recompile()
    assert "block_3_value" in renamed.code
    assert key_of(gm, inputs) == key_of(renamed, inputs)


def test_an_argument_known_by_its_address_is_not_cached():
    gm = fx.symbolic_trace(lambda x: torch.sin(x))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.kwargs = {"out": None, "tag": object()}
    with pytest.raises(pair_cache.Uncacheable, match="address|at 0x"):
        key_of(gm, [torch.randn(3)])


def test_the_code_changes_the_key():
    gm, inputs = example()
    other, _ = traced(lambda x, y: torch.cos(x) * y)
    assert key_of(gm, inputs) != key_of(other, inputs)


@pytest.mark.parametrize("change", ["shape", "stride", "dtype", "requires_grad", "parameter"])
def test_each_input_property_changes_the_key(change):
    gm, (x, y) = example()
    changed = {"shape": lambda: torch.randn(3, 5, requires_grad=True),
               "stride": lambda: torch.randn(4, 3).t().requires_grad_(),
               "dtype": lambda: torch.randn(3, 4, dtype=torch.float64, requires_grad=True),
               "requires_grad": lambda: torch.randn(3, 4),
               "parameter": lambda: torch.nn.Parameter(torch.randn(3, 4))}[change]()
    assert key_of(gm, [x, y]) != key_of(gm, [changed, y])


def test_options_configuration_and_autocast_change_the_key():
    gm, inputs = example()
    plain = key_of(gm, inputs)
    assert key_of(gm, inputs, ("inductor", "donate")) != plain
    with torch._functorch.config.patch(activation_memory_budget=0.5):
        assert key_of(gm, inputs) != plain
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert key_of(gm, inputs) != plain
    assert key_of(gm, inputs) == plain


class WithConstant(torch.nn.Module):
    def __init__(self, value):
        super().__init__()
        self.register_buffer("table", torch.full((4,), value))

    def forward(self, x):
        return x + self.table


def test_the_values_of_tensors_the_graph_holds_change_the_key():
    x = torch.randn(4, requires_grad=True)
    one, two = fx.symbolic_trace(WithConstant(1.0)), fx.symbolic_trace(WithConstant(2.0))
    assert key_of(one, [x]) != key_of(two, [x])
    assert key_of(one, [x]) == key_of(fx.symbolic_trace(WithConstant(1.0)), [x])


def users_own(x):
    return x * 2


torch.fx.wrap("users_own")


def test_a_function_of_the_users_inside_the_graph_is_not_cached():
    gm = fx.symbolic_trace(lambda x: users_own(x) + 1)
    assert any(n.target is users_own for n in gm.graph.nodes)
    with pytest.raises(pair_cache.Uncacheable, match="users_own"):
        key_of(gm, [torch.randn(3)])


def test_symbolic_shapes_are_not_cached():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)
    x = FakeTensorMode(shape_env=ShapeEnv()).from_tensor(
        torch.randn(3, 4), symbolic_context=StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    assert x._has_symbolic_sizes_strides
    gm, _ = example()
    with pytest.raises(pair_cache.Uncacheable, match="symbolic"):
        key_of(gm, [x, x])


def test_the_cache_follows_inductors():
    with torch._inductor.config.patch(fx_graph_cache=False):
        assert not pair_cache.enabled()
    with torch._inductor.config.patch(fx_graph_cache=True, force_disable_caches=True):
        assert not pair_cache.enabled()
