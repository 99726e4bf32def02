"""PyTorch's OpInfo database: the compiled second order equals eager's for every op.

For every OpInfo whose op supports gradgrad in float64 on the CPU, opinfo_models.py puts the
op between two attention layers (activations in, activations out, its sample's other
arguments as they are) and compares the Hessian-vector product through
torch.compile(backend="flashbob") (aot_eager, so that compiling costs seconds, not minutes;
the inductor route's exactness is tested per case in test_second_order_ops.py) with eager's,
to 1e-9 relative. Each op's outcome (compiled, second order eager, eager route, graph break,
excluded, with the reason) is recorded, and the session prints their counts
(conftest.py); the README's reliability section quotes them.

A few ops run in the default tier; the whole database in the `slow` tier:

    python -m pytest -q -m slow -n auto tests/training/test_opinfo_second_order.py
"""
import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

from opinfo_models import classify

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

OPTIONS = {"compiler": "aot_eager", "fallback": False}


def _second_order_ops():
    return [op for op in op_db if op.supports_autograd and op.supports_gradgrad
            and torch.float64 in op.supported_dtypes("cpu")]


ALL = _second_order_ops()
# One of each kind the first design got wrong or failed on, and plain ones.
FAST = {"sin", "matmul", "linalg.det", "linalg.slogdet", "cumsum", "flip", "logcumsumexp",
        "nn.functional.unfold", "nn.functional.max_pool1d", "fft.rfft", "polar",
        "nn.functional.layer_norm", "nn.functional.gelu", "linalg.solve"}


def _id(op):
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def check(op, record_property):
    outcome = classify(op, OPTIONS)
    record_property("opinfo_outcome", (_id(op), outcome.kind, outcome.reason))
    if outcome.kind != "excluded":
        assert outcome.error <= outcome.tolerance, outcome
    return outcome


@pytest.mark.parametrize("op", [op for op in ALL if op.name in FAST and not op.variant_test_name],
                         ids=_id)
def test_second_order_of_op(op, record_property):
    outcome = check(op, record_property)
    assert outcome.kind == "compiled", outcome


@pytest.mark.slow
@pytest.mark.parametrize("op", ALL, ids=_id)
def test_second_order_of_every_op(op, record_property):
    check(op, record_property)
