"""One rank of tests/training/test_distributed.py (run as a script: it spawns the ranks itself).

    python tests/training/distributed_worker.py OUT_DIR PORT WORLD

Every rank computes, with torch.compile(backend=flashbob) on CPU (gloo, float64), on its
own slice of one global batch: a DDP first-order step (`.backward()`: DDP averages), a
Hessian-vector product and a MAML meta-gradient averaged with bob_compile.distributed, and
an FSDP2 (`fully_shard`) first-order step; and saves them to OUT_DIR/rank<r>.pt.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel

# tests/ (models.py), as pytest's conftest puts it on the path
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bob_compile import distributed  # noqa: E402
from bob_compile.backend import counters, flashbob  # noqa: E402
from models import GPT, NanoGPTBlock, SDPABlock, loss_of, token_batch  # noqa: E402

OPTIONS = {"compiler": "aot_eager", "fallback": False}
GLOBAL_BATCH = 4
INNER_LR = 0.1


def make_model(block=SDPABlock):
    """Two blocks (so that a graph split at gradient buckets has attention in a later piece
    too); `NanoGPTBlock` gives the same weights and function, attention written by hand."""
    torch.manual_seed(0)
    return torch.nn.Sequential(block(), block()).double()


def global_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(GLOBAL_BATCH, 8, 16, generator=g, dtype=torch.float64)


def hvp_vectors(params):
    g = torch.Generator().manual_seed(2)     # the same on every rank
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]


def maml_meta_gradient(model, run, support, query):
    """One inner SGD step on the support half, the outer loss on the query half."""
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad(loss_of(run(dict(zip(names, params)), support)), params,
                                create_graph=True)
    fast = {n: p - INNER_LR * g for n, p, g in zip(names, params, grads)}
    return loss_of(run(fast, query)), params


def backend_failures():
    """Graph breaks Dynamo made because a backend raised (DDPOptimizer breaks the graph
    there rather than fail)."""
    breaks = torch._dynamo.utils.counters["graph_break"]
    return sum(n for reason, n in breaks.items() if "Backend compiler" in reason)


def ddp_grad_and_hvp(model, ddp, x, options=OPTIONS):
    """A DDP first-order step (`.backward()`: DDP's reducer averages the gradients), then
    a Hessian-vector product under no_sync: each rank's own double backward, averaged."""
    compiled = torch.compile(ddp, backend=flashbob, options=options)
    loss_of(compiled(x)).backward()
    grad = [p.grad.clone() for p in model.parameters()]
    with ddp.no_sync():
        params = list(model.parameters())
        hvp = distributed.hessian_vector_product(loss_of(compiled(x)), params,
                                                 hvp_vectors(params))
    return grad, hvp


def split_graph_new_lengths(rank):
    """DDP's split graph (nanoGPT, tokens) at three sequence lengths: the third compiles
    with dynamic shapes, where inductor fails on a piece that returns an int (torch 2.13;
    stock inductor as well) and flashbob runs that piece's rewritten graph eagerly;
    DDPOptimizer must accept the fallback. Each rank's own Hessian-vector product (under
    no_sync) against eager math attention; returns the largest error and the number of
    pieces that took the eager route for another reason than the compiler's failure
    (identical pieces must not hit AOTAutograd's cache, which skips the compilers that
    capture their graphs)."""
    torch.manual_seed(0)
    model = GPT().double()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.004)
    torch._dynamo.reset()
    compiled = torch.compile(ddp, backend=flashbob, options={"compiler": "inductor"})
    params = list(model.parameters())
    worst, eager_before = 0.0, counters["route_eager"] - counters["compiler_failed"]
    for seq in (8, 12, 16):
        batch = token_batch(100 * rank + seq, seq)

        def hvp(run):
            grads = torch.autograd.grad(run(*batch), params, create_graph=True)
            return torch.autograd.grad(grads, params, hvp_vectors(params))
        with ddp.no_sync():
            actual = hvp(compiled)
        with sdpa_kernel(SDPBackend.MATH):
            expected = hvp(model)
        worst = max(worst, max((a - e).abs().max().item() for a, e in zip(actual, expected)))
    return worst, counters["route_eager"] - counters["compiler_failed"] - eager_before


def rank_main(rank, world, out_dir, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = global_batch().chunk(world)[rank]
    result = {}

    model = make_model()
    result["ddp_grad"], result["ddp_hvp"] = ddp_grad_and_hvp(
        model, DistributedDataParallel(model), x)

    # DDP with tiny buckets: DDPOptimizer splits the graph at bucket boundaries, and each
    # piece is compiled (and differentiated twice) on its own. With inductor, DDPOptimizer
    # also runs each compiled piece on fake tensors, and compiles the next piece on fake
    # copies of its inputs: there the hand-written nanoGPT spelling (same weights, causal
    # mask buffer) checks that the mask's values are still read and the site replaced.
    # DDPOptimizer wants the first bucket no larger than the others; its default (1 MiB)
    # exceeds this tiny model, so both caps are made small (test-only)
    dist._DEFAULT_FIRST_BUCKET_BYTES = 4096
    for compiler, block in (("aot_eager", SDPABlock), ("inductor", NanoGPTBlock)):
        split_model = make_model(block)
        split = DistributedDataParallel(split_model, bucket_cap_mb=0.004)
        torch._dynamo.reset()                # else the previous DDP's graph is reused as it is
        before = dict(counters)
        failures_before = backend_failures()
        result[f"split_{compiler}"] = ddp_grad_and_hvp(split_model, split, x,
                                                       dict(OPTIONS, compiler=compiler))
        result[f"split_graphs_{compiler}"] = counters["graphs"] - before.get("graphs", 0)
        result[f"split_sites_{compiler}"] = sum(
            counters[k] - before.get(k, 0) for k in ("sdpa_replaced", "handwritten_replaced"))
        result[f"split_failures_{compiler}"] = backend_failures() - failures_before

    result["split_new_lengths_error"], result["split_new_lengths_eager"] = \
        split_graph_new_lengths(rank)

    # MAML: each rank adapts to its own task (its slice) and the meta-gradients are averaged
    def run(weights, inputs):
        return functional_call(model, weights, (inputs,))
    run = torch.compile(run, backend=flashbob, options=OPTIONS)
    support, query = x[:1], x[1:]
    outer, params = maml_meta_gradient(model, run, support, query)
    result["maml"] = distributed.gradient(outer, params)

    # FSDP2, first order
    from torch.distributed.fsdp import fully_shard
    sharded = make_model()
    fully_shard(sharded)
    loss_of(torch.compile(sharded, backend=flashbob, options=OPTIONS)(x)).backward()
    result["fsdp2_grad"] = [p.grad.full_tensor() for p in sharded.parameters()]
    # second order with respect to the sharded parameters is refused (autograd.grad with
    # allow_unused, as gradient_and_hvp calls it, would return zeros)
    params = list(sharded.parameters())
    try:
        distributed.gradient_and_hvp(loss_of(torch.compile(sharded, backend=flashbob,
                                                           options=OPTIONS)(x)),
                                     params, hvp_vectors(params))
        result["fsdp2_hvp_refusal"] = None
    except ValueError as e:
        result["fsdp2_hvp_refusal"] = str(e)

    result["sites_replaced"] = counters["sdpa_replaced"]
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    out_dir, port, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    mp.spawn(rank_main, args=(world, out_dir, port), nprocs=world)
