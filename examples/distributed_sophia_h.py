"""Sophia-H across processes: DDP around a flashbob-compiled nanoGPT-style GPT.

Launch one process per device with torchrun (gloo on CPU, NCCL on CUDA):

    torchrun --nproc-per-node=2 examples/distributed_sophia_h.py                 # CPU
    torchrun --nproc-per-node=2 examples/distributed_sophia_h.py --device cuda --dtype bfloat16 \\
        --block-size 1024 --n-layer 12 --n-head 12 --n-embd 768 --batch-size 8 --steps 50

The model, the optimizer and the data are examples/sophia_h.py's. Each rank trains on its
own batches (batch-size per rank). Plain steps are ordinary DDP steps: `loss.backward()`,
whose gradients DDP averages. Every --hess-interval steps the Hessian step runs under
`ddp.no_sync()`: each rank differentiates its own loss twice with torch.autograd.grad
(which DDP's reducer never sees) and bob_compile.distributed.gradient_and_hvp averages the
gradient and the Hessian-vector product over the ranks in one all-reduce; the Rademacher
vectors come from a generator seeded alike on every rank.

Before and after training every rank checks the distributed gradient and Hessian-vector
product against one process on the concatenated batch (eager PyTorch, math attention);
a mismatch exits with status 1. Rank 0 prints the steps and the samples per second.
"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel

import _common
import sophia_h
from bob_compile import distributed


def batches_of_all_ranks(data, args, device, step, world):
    """Every rank's batch of this step (each rank can cut all of them: seeded per rank)."""
    out = []
    for rank in range(world):
        generator = torch.Generator().manual_seed(args.seed + 1000 * step + rank)
        out.append(sophia_h.get_batch(data, args.batch_size, args.block_size, device, generator))
    return out


def check(ddp, compiled, params, data, args, device, rank, world, when, tol):
    """Distributed gradient and HVP on one set of batches vs one process on all of them."""
    batches = batches_of_all_ranks(data, args, device, -1, world)
    zs = sophia_h.rademacher_like(params, torch.Generator(device=device).manual_seed(args.seed))
    with ddp.no_sync():
        loss = compiled(*batches[rank])
        grads, hvps = distributed.gradient_and_hvp(loss, params, zs)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    with sdpa_kernel(SDPBackend.MATH):
        _, ref_grads, _, ref_hvps = sophia_h.hutchinson_step(ddp.module, params, x, y, zs)
    ok = _common.check(f"rank {rank} gradient ({when})", grads, ref_grads, tol)
    ok &= _common.check(f"rank {rank} Hessian-vector product ({when})", hvps, ref_hvps, tol)
    return ok


def main(argv=None):
    p = _common.parser(__doc__.split("\n\n")[0], steps=10, text=str(sophia_h.REPO / "README.md"),
                       block_size=32, batch_size=2, n_layer=2, n_head=2, n_embd=32, lr=3e-3,
                       hess_interval=2, weight_decay=0.1)
    p.add_argument("--attention", choices=["handwritten", "sdpa"], default="handwritten")
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        sys.exit("launch with torchrun, e.g. torchrun --nproc-per-node=2 "
                 "examples/distributed_sophia_h.py")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = _common.device_of(args)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(args.seed)     # the same initial weights on every rank
    data = sophia_h.load_bytes(args.text, args.block_size)
    model = sophia_h.GPT(256, args.block_size, args.n_layer, args.n_head, args.n_embd,
                         sdpa=args.attention == "sdpa").to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    compiled = torch.compile(ddp, backend=args.backend)
    params = list(model.parameters())
    optimizer = sophia_h.SophiaH(params, lr=args.lr, weight_decay=args.weight_decay)
    z_generator = torch.Generator(device=device).manual_seed(args.seed)   # alike on all ranks
    tol = 1e-4 if device.type == "cpu" else 1e-2

    ok = check(ddp, compiled, params, data, args, device, rank, world, "initial weights", tol)
    if rank == 0:
        print(f"\nSophia-H on {world} ranks, {args.batch_size} sequences each, "
              f"torch.compile(DDP(model), backend={args.backend!r}), {args.dtype}:")
    samples = 0.0
    step_times = {True: [], False: []}   # seconds, by with_hessian
    warm = set()      # the kinds of step already run once: a kind's first step compiles
    for step in range(args.steps):
        x, y = batches_of_all_ranks(data, args, device, step, world)[rank]
        with_hessian = step % args.hess_interval == 0
        _common.sync(device)
        start = time.perf_counter()
        with _common.autocast(args, device):
            if with_hessian:
                zs = sophia_h.rademacher_like(params, z_generator)
                with ddp.no_sync():
                    loss = compiled(x, y)
                    grads, hvps = distributed.gradient_and_hvp(loss, params, zs)
                optimizer.update_hessian(torch._foreach_mul(zs, hvps))
                for p, g in zip(params, grads):
                    p.grad = g
            else:
                for p in params:
                    p.grad = None
                loss = compiled(x, y)
                loss.backward()              # DDP averages the gradients
        optimizer.step()
        _common.sync(device)
        elapsed = time.perf_counter() - start
        if with_hessian in warm:
            samples += args.batch_size * world
            step_times[with_hessian].append(elapsed)
        warm.add(with_hessian)
        if rank == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}  {1000 * elapsed:8.1f} ms"
                  + ("  (with Hessian estimate)" if with_hessian else ""))
    total = sum(step_times[True]) + sum(step_times[False])
    if rank == 0 and total > 0:
        print(f"samples/s over the steps after each kind's first: {samples / total:.1f} "
              f"({world} ranks)")
        # Medians too: one slow step (a rank stalled, all wait at the next all-reduce) moves
        # the mean, and a comparison between runs should see it apart from the steady state.
        medians = {kind: 1000 * statistics.median(times) for kind, times in step_times.items() if times}
        print("median step: " + ", ".join(f"{'with Hessian' if kind else 'plain'} {ms:.1f} ms"
                                           for kind, ms in medians.items()))
    ok &= check(ddp, compiled, params, data, args, device, rank, world, "trained weights", tol)
    ok &= _common.attention_replaced(args.backend)
    dist.destroy_process_group()
    return _common.finish(ok)


if __name__ == "__main__":
    sys.exit(main())
