"""Context parallelism (bob_compile/context_parallel.py): an attention layer over a
sequence sharded across 2 and 4 gloo ranks (CPU, float64) against one process on the whole
sequence with SDPA's math attention: each rank's positions of the output, and the sums
over ranks of each rank's share of the gradient, the Hessian-vector product (reverse over
reverse and forward over reverse) and the MAML meta-gradient (<= 1e-9); causal and not,
key padding, grouped key/value heads (on 4 ranks fewer than the ranks: repeated), the model
compiled with flashbob; the head-tail order of PyTorch's load balancing; the layer calling
F.scaled_dot_product_attention inside PyTorch's `context_parallel` and compiled with
flashbob (eager code and other backends keep PyTorch's attention); ranks that do not divide
the heads (the keys gathered instead, chunks merged by their log-sum-exps); a mask under
PyTorch's context_parallel refused."""
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
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import context_parallel_worker as worker

pytestmark = [pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="torch.distributed with gloo is not available"),
              pytest.mark.spawns]
TOL = 1e-9


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world):
    out = pathlib.Path(tempfile.mkdtemp(prefix="bob_compile_context_parallel_"))
    try:
        done = subprocess.run([sys.executable, worker.__file__, str(out), str(free_port()),
                               str(world)], env=dict(os.environ, OMP_NUM_THREADS="1"),
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
        return [torch.load(out / f"rank{r}.pt") for r in range(world)]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def one_process(case):
    model, support, query, mask, vectors = worker.make(case)
    causal = worker.CASES[case]["is_causal"]
    visible = torch.ones(1, 1, worker.N, worker.N, dtype=torch.bool)
    if causal:
        visible = visible & torch.ones(worker.N, worker.N, dtype=torch.bool).tril()
    if mask is not None:
        visible = visible & mask

    def attend(q, k, v):
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=visible,
                                                  enable_gqa=q.shape[1] != k.shape[1])
    return worker.derivatives(model, support, query, attend, (lambda ts: ts, vectors))


def check(world, ranks):
    for case in worker.CASES:
        if case == "refusals":
            expected_words = {"unknown order": "order must be one of",
                              "odd head-tail shard": "even shard length",
                              "key heads not dividing": "must divide the query heads",
                              "lengths differ": "same positions"}
            for r in ranks:
                for name, words in expected_words.items():
                    assert r[case][name] is not None and words in r[case][name], (name, r[case])
            continue
        if case == "torch context_parallel, mask":
            assert all("attn_mask" in r[case]["refused"] for r in ranks), case
            continue
        expected = one_process(case)
        if case.endswith("eager or other backends"):
            check_left_to_torch(world, ranks, case, expected["out"])
            continue
        for r in range(world):
            torch.testing.assert_close(ranks[r][case]["out"],
                                       expected["out"][:, worker.positions(case, r, world)],
                                       rtol=0, atol=TOL)
        for what in ("grad", "hvp", "meta", "forward_over_reverse"):
            if what not in ranks[0][case]:      # forward mode: not through compiled graphs
                assert worker.CASES[case].get("compiled") or worker.CASES[case].get("torch_cp"), \
                    (case, what)
                continue
            summed = [sum(parts) for parts in zip(*(r[case][what] for r in ranks))]
            error = max((a - e).abs().max().item() for a, e in zip(summed, expected[what]))
            assert error <= TOL, (case, what, error)


def check_left_to_torch(world, ranks, case, expected_out):
    """Eager code and other backends run PyTorch's own context-parallel attention: on the
    CPU its refusal (no CPU ring kernel), elsewhere its output; F is restored on exit."""
    for r in range(world):
        assert ranks[r][case]["restored"], case
        for backend in ("eager code", "aot_eager"):
            outcome = ranks[r][case][backend]
            if isinstance(outcome, str):
                assert "sharding strategy" in outcome, (backend, outcome)
            else:
                torch.testing.assert_close(
                    outcome, expected_out[:, worker.positions(case, r, world)], rtol=0,
                    atol=1e-7)


def test_two_ranks():
    check(2, run_ranks(2))


@pytest.mark.slow       # four ranks on two cores: ~40 s
def test_four_ranks():
    check(4, run_ranks(4))
