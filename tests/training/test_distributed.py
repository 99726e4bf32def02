"""Second order across processes (bob_compile/distributed.py): 2 ranks, gloo, CPU, float64.

Each rank runs flashbob-compiled code on its half of a batch; the results must equal a
single process on the whole batch (<= 1e-9): DDP's first-order step, the averaged
Hessian-vector product, the averaged MAML meta-gradient (one task per rank), and FSDP2's
first-order step. The single-process answers use eager PyTorch with math attention.
"""
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

import distributed_worker as worker
from bob_compile import distributed
from models import loss_of

# the full matrix of a run of two ranks (2.5 min on 2 cores): the slow tier; the default tier
# runs examples/distributed_sophia_h.py (DDP and the averaged HVP) instead
pytestmark = [pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="torch.distributed with gloo is not available"),
              pytest.mark.slow, pytest.mark.spawns]
WORLD = 2
TOL = 1e-9


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks():
    """What each rank computed: the ranks run once, as one subprocess, for every test here."""
    out = pathlib.Path(tempfile.mkdtemp(prefix="bob_compile_ranks_"))
    try:
        done = subprocess.run([sys.executable, worker.__file__, str(out), str(free_port()), str(WORLD)],
                              env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                              text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
        yield [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def max_error(actual, expected):
    return max((a - e).abs().max().item() for a, e in zip(actual, expected, strict=True))


def single_process():
    model = worker.make_model()
    params = list(model.parameters())
    x = worker.global_batch()
    with sdpa_kernel(SDPBackend.MATH):
        grad = torch.autograd.grad(loss_of(model(x)), params)
        grads = torch.autograd.grad(loss_of(model(x)), params, create_graph=True)
        hvp = torch.autograd.grad(grads, params, worker.hvp_vectors(params))
        metas = []
        for task in x.chunk(WORLD):
            outer, _ = worker.maml_meta_gradient(
                model, lambda w, inputs: functional_call(model, w, (inputs,)), task[:1], task[1:])
            metas.append(torch.autograd.grad(outer, params))
    maml = [sum(parts) / WORLD for parts in zip(*metas)]
    return dict(grad=grad, hvp=hvp, maml=maml)


@pytest.fixture(scope="module")
def expected():
    return single_process()


def test_ddp_first_order_equals_one_process(ranks, expected):
    for result in ranks:
        assert result["sites_replaced"] >= 4     # DDP, split DDP, MAML, FSDP2: all fused
        assert max_error(result["ddp_grad"], expected["grad"]) <= TOL


def test_averaged_hvp_equals_one_process(ranks, expected):
    for result in ranks:
        assert max_error(result["ddp_hvp"], expected["hvp"]) <= TOL


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_ddp_graph_split_into_buckets_stays_exact(ranks, expected, compiler):
    """DDPOptimizer compiles one graph per gradient bucket (and, with inductor, runs each
    compiled piece on fake tensors while compiling); first and second order stay exact."""
    for result in ranks:
        assert result[f"split_graphs_{compiler}"] > 1
        assert result[f"split_sites_{compiler}"] == 2      # both attention sites fused
        assert result[f"split_failures_{compiler}"] == 0   # and no piece failed to compile
        grad, hvp = result[f"split_{compiler}"]
        assert max_error(grad, expected["grad"]) <= TOL
        assert max_error(hvp, expected["hvp"]) <= TOL


def test_ddp_graph_split_at_new_lengths_stays_exact(ranks):
    """Three lengths (dynamic shapes on the third), including a piece inductor cannot
    compile there and flashbob runs as written."""
    for result in ranks:
        assert result["split_new_lengths_error"] <= TOL
        assert result["split_new_lengths_eager"] == 0


def test_averaged_maml_meta_gradient_equals_one_process(ranks, expected):
    for result in ranks:
        assert max_error(result["maml"], expected["maml"]) <= TOL


def test_fsdp2_first_order_equals_one_process(ranks, expected):
    for result in ranks:
        assert max_error(result["fsdp2_grad"], expected["grad"]) <= TOL


def test_fsdp2_second_order_is_refused_not_zero(ranks):
    for result in ranks:
        assert "sharded DTensors (FSDP2's fully_shard)" in result["fsdp2_hvp_refusal"]


def test_helpers_refuse_what_they_cannot_do():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        distributed.mean_over_ranks([torch.ones(2)])
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match="not differentiable"):
        distributed.gradient((x * x).sum(), [x], create_graph=True)

