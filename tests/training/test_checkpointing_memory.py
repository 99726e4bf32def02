"""Activation checkpointing at every order: what the compiled orders keep, and exactness.

Four SDPA blocks, each checkpointed (torch.utils.checkpoint with use_reentrant False and
True; selective checkpointing that saves the matmuls and recomputes the rest), compiled by
flashbob: the bytes each compiled order keeps for its backward (the report's "keeping"
lines, checked against autograd's packed tensors in test_training_route.py) must drop below
the unchecked model's at the first order (to a few per cent) and at the second (the VJP
pair's forward half: today ~0.7x, since the first-order backward inside it is not
checkpointed), and the Hessian-vector product and MAML meta-gradient must equal eager
math's on the same weights without checkpointing (eager PyTorch cannot be the reference with
it: selective checkpointing refuses a second backward, reentrant checkpointing refuses
autograd.grad, and under functional_call checkpointing recomputes with the module's own
weights instead of MAML's fast ones: docs/routing.md, "Known limits").
"""
import functools
import re

import pytest
import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from bob_compile.backend import flashbob, recent_reports
from kept_bytes import FIRST, SECOND, kept_bytes
from models import SDPABlock, float_batch
from test_training_route import AOT_EAGER, TOLERANCE, hessian_vector_product, maml, max_error

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

def save_matmuls(ctx, op, *args, **kwargs):
    """A selective-checkpointing policy: keep the projections' outputs, recompute the rest."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Stack(nn.Module):
    def __init__(self, checkpointing):
        super().__init__()
        self.blocks = nn.ModuleList([SDPABlock() for _ in range(4)])
        self.checkpointing = checkpointing

    def forward(self, x):
        for block in self.blocks:
            if self.checkpointing is None:
                x = block(x)
            elif self.checkpointing == "selective":
                x = checkpoint(block, x, use_reentrant=False, context_fn=functools.partial(
                    create_selective_checkpoint_contexts, save_matmuls))
            else:
                x = checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")
        return x


def stack(checkpointing):
    """The same weights whatever the checkpointing."""
    torch.manual_seed(0)
    return Stack(checkpointing).double()


def compiled_and_kept(checkpointing, x):
    torch._dynamo.reset()
    recent_reports.clear()
    compiled = torch.compile(stack(checkpointing), backend=flashbob, options=AOT_EAGER)
    return hessian_vector_product(compiled, x), kept_bytes(FIRST), kept_bytes(SECOND)


@functools.lru_cache(maxsize=1)
def unchecked(seed, seq):
    """(x, eager math's HVP, what the unchecked model's compiled orders keep): once per
    process for every kind of checkpointing."""
    x, = float_batch(seed, seq=seq)
    with sdpa_kernel(SDPBackend.MATH):
        expected = hessian_vector_product(stack(None), x)
    _, first, second = compiled_and_kept(None, x)
    return x, expected, first, second


@pytest.mark.parametrize("checkpointing", [
    "non_reentrant", pytest.param("reentrant", marks=pytest.mark.slow),
    pytest.param("selective", marks=pytest.mark.slow)])
def test_checkpointing_lowers_what_every_order_keeps_and_stays_exact(checkpointing):
    x, expected, plain_first, plain_second = unchecked(0, 64)
    hvp, first, second = compiled_and_kept(checkpointing, x)
    assert max_error(hvp, expected) <= TOLERANCE
    assert all(site.replaced for report in recent_reports for site in report.sites)
    bound = 0.6 if checkpointing == "selective" else 0.1     # the matmuls' outputs stay
    # a checkpointed block cut into its own region keeps nothing beyond its input
    assert any(re.search(FIRST, line) for r in recent_reports for line in r.compiled)
    assert 0 <= first < bound * plain_first, (first, plain_first)
    assert 0 < second < plain_second, (second, plain_second)


def test_maml_through_checkpointed_blocks():
    x, = float_batch(1, seq=16)
    with sdpa_kernel(SDPBackend.MATH):
        expected = maml(stack(None), x)
    compiled = torch.compile(stack("non_reentrant"), backend=flashbob, options=AOT_EAGER)
    assert max_error(maml(compiled, x), expected) <= TOLERANCE


def test_the_second_order_honours_the_partitioners_memory_budget():
    """PyTorch's own knob for recomputation over saving (torch._functorch.config's
    activation_memory_budget, what stock compile's users set) reaches the second order's
    partition too: a budget keeps less there, and the HVP stays exact."""
    import torch._functorch.config as functorch_config
    x, expected, _, plain_second = unchecked(0, 64)
    with functorch_config.patch(activation_memory_budget=0.3):
        hvp, _, second = compiled_and_kept(None, x)
    assert max_error(hvp, expected) <= TOLERANCE
    assert 0 < second < 0.8 * plain_second, (second, plain_second)
