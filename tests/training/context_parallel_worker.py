"""The ranks of test_context_parallel.py: `python context_parallel_worker.py OUT PORT WORLD`
spawns WORLD gloo ranks; each runs an attention layer on its shard of the sequence through
bob_compile.context_parallel, or through F.scaled_dot_product_attention inside PyTorch's
`context_parallel` with the layer compiled by flashbob (float64, CPU), and saves what it
computed to OUT/rank<r>.pt: its positions of the output, and its shares of the gradient,
the Hessian-vector product and the MAML meta-gradient, for each case (causal or not, with
key padding or not)."""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.func import functional_call

B, N, WIDTH, HEADS, KV_HEADS = 2, 24, 24, 4, 4
CASES = {"causal": dict(is_causal=True), "not causal": dict(is_causal=False),
         "key padding, causal": dict(is_causal=True, padding=True),
         "grouped key/value heads": dict(is_causal=True, kv_heads=2),
         "refusals": dict(is_causal=True),
         # 3 heads: neither 2 nor 4 ranks divide them (the keys are gathered instead)
         "ranks do not divide the heads": dict(is_causal=True, heads=3, kv_heads=3),
         "ranks do not divide the heads, not causal, key padding": dict(
             is_causal=False, heads=3, kv_heads=1, padding=True),
         "ranks do not divide the heads, head-tail, key padding": dict(
             is_causal=True, heads=3, kv_heads=1, padding=True, order="head-tail"),
         "compiled with flashbob": dict(is_causal=True, compiled=True),
         "head-tail order": dict(is_causal=True, order="head-tail"),
         # PyTorch's context_parallel shards the buffers (head-tail where the length allows)
         # and patches F.scaled_dot_product_attention; the layer calls SDPA
         "torch context_parallel, causal": dict(is_causal=True, torch_cp=True),
         "torch context_parallel, not causal": dict(is_causal=False, torch_cp=True),
         "torch context_parallel, grouped heads": dict(is_causal=True, torch_cp=True,
                                                       kv_heads=2),
         "torch context_parallel, mask": dict(is_causal=False, torch_cp=True, padding=True),
         "torch context_parallel, ranks do not divide the heads": dict(
             is_causal=True, torch_cp=True, heads=3, kv_heads=3),
         "torch context_parallel, eager or other backends": dict(is_causal=True,
                                                                 torch_cp=True)}


def positions(case, rank, world):
    """The sequence positions rank `rank` holds in `case`."""
    n = N // world
    if CASES[case].get("order") == "head-tail" or CASES[case].get("torch_cp"):
        half = n // 2
        return torch.cat([torch.arange(rank * half, (rank + 1) * half),
                          torch.arange(N - (rank + 1) * half, N - rank * half)])
    return torch.arange(rank * n, (rank + 1) * n)


class Layer(torch.nn.Module):
    """Projections, attention over the sequence (`attend`), an output projection."""

    def __init__(self, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        head_dim = WIDTH // heads
        self.q = torch.nn.Linear(WIDTH, WIDTH)
        self.kv = torch.nn.Linear(WIDTH, 2 * kv_heads * head_dim)
        self.out = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x, attend):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, -1).permute(2, 0, 3, 1, 4)
        y = attend(q, k, v).transpose(1, 2).reshape(b, n, WIDTH)
        return self.out(torch.tanh(y))


def make(case):
    torch.manual_seed(0)
    model = Layer(CASES[case].get("heads", HEADS), CASES[case].get("kv_heads", KV_HEADS)).double()
    g = torch.Generator().manual_seed(1)
    support = torch.randn(B, N, WIDTH, dtype=torch.float64, generator=g)
    query = torch.randn(B, N, WIDTH, dtype=torch.float64, generator=g)
    mask = None
    if CASES[case].get("padding"):
        lengths = torch.tensor([N, N - 7])
        mask = (torch.arange(N)[None, :] < lengths[:, None])[:, None, None, :]
    vectors = [torch.randn(p.shape, dtype=torch.float64, generator=g)
               for p in model.parameters()]
    return model, support, query, mask, vectors


def loss_of(y):
    """A mean over the whole sequence's outputs: a rank's share is its positions' sum over
    the same count, so that the shares add up to the one-process loss."""
    return (y ** 2).sum() / (B * N * WIDTH)


def derivatives(model, support, query, attend, total, inner_lr=0.1):
    """The output on `support`, and the gradient, Hessian-vector product (vectors `total`'s
    third entry) and MAML meta-gradient of the loss; `total` sums a derivative's shares
    (over ranks, or the identity in one process)."""
    sum_shares, vectors = total
    params = dict(model.named_parameters())
    names = list(params)
    out = model(support, attend)
    grads = torch.autograd.grad(loss_of(out), list(params.values()), create_graph=True)
    hvp = torch.autograd.grad(grads, list(params.values()), vectors, retain_graph=True)
    inner = sum_shares(list(grads))
    fast = {n: params[n] - inner_lr * g for n, g in zip(names, inner)}
    meta = torch.autograd.grad(loss_of(functional_call(model, fast, (query, attend))),
                               list(params.values()))
    results = dict(out=out.detach(), grad=[g.detach() for g in grads], hvp=list(hvp),
                   meta=list(meta))
    if not isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        # (a compiled graph's autograd Function has no forward-mode rule: torch.func.jvp
        # is how forward over reverse runs compiled)
        results["forward_over_reverse"] = forward_over_reverse(model, support, attend, vectors)
    return results


def forward_over_reverse(model, support, attend, vectors):
    """The Hessian-vector product again, as the tangent of the gradient (forward-mode AD
    over the backward)."""
    import torch.autograd.forward_ad as fwAD
    params = dict(model.named_parameters())
    with fwAD.dual_level():
        duals = {n: fwAD.make_dual(p, z) for (n, p), z in zip(params.items(), vectors)}
        grads = torch.autograd.grad(loss_of(functional_call(model, duals, (support, attend))),
                                    list(duals.values()), create_graph=True)
        return [fwAD.unpack_dual(g).tangent.detach() for g in grads]


def rank_main(rank, world, out_dir, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    import bob_compile  # noqa: F401  (registers the flashbob backend)
    from bob_compile import context_parallel
    results = {}
    for case in CASES:
        model, support, query, mask, vectors = make(case)
        causal = CASES[case]["is_causal"]
        total = (context_parallel.sum_over_ranks, vectors)
        if case == "refusals":
            results[case] = refusals(context_parallel)
            continue
        if CASES[case].get("torch_cp"):
            results[case] = under_torch_context_parallel(case, model, support, query, mask,
                                                         total)
            continue

        def attend(q, k, v):
            return context_parallel.attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              order=CASES[case].get("order", "contiguous"))
        shard = positions(case, rank, world)
        if CASES[case].get("compiled"):
            torch._dynamo.reset()
            model = torch.compile(model, backend="flashbob")
        results[case] = derivatives(model, support[:, shard], query[:, shard], attend, total)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def refusals(context_parallel):
    """The messages of the calls context_parallel.attention must refuse."""
    shard = torch.zeros(B, HEADS, 3, 4, dtype=torch.float64)
    calls = {"unknown order": dict(query=shard, key=shard, value=shard, order="zigzag"),
             "odd head-tail shard": dict(query=shard, key=shard, value=shard,
                                         order="head-tail"),
             "key heads not dividing": dict(query=shard, key=shard[:, :3], value=shard[:, :3]),
             "lengths differ": dict(query=shard, key=shard[:, :, :2], value=shard[:, :, :2])}
    said = {}
    for name, kwargs in calls.items():
        try:
            context_parallel.attention(**kwargs)
            said[name] = None
        except ValueError as e:
            said[name] = str(e)
    return said


def under_torch_context_parallel(case, model, support, query, mask, total):
    """The case inside PyTorch's context_parallel, the layer calling SDPA: compiled with
    flashbob, its derivatives; the eager and aot_eager case, what PyTorch's own context
    parallelism does (on the CPU: refuses, it has no CPU kernel)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    causal = CASES[case]["is_causal"]

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              enable_gqa=q.shape[1] != k.shape[1])
    support, query = support.clone(), query.clone()    # context_parallel shards them in place
    torch._dynamo.reset()
    if case.endswith("eager or other backends"):
        outcome = {}
        for backend in ("eager code", "aot_eager"):
            run = model if backend == "eager code" else torch.compile(model, backend=backend)
            with context_parallel(mesh, buffers=[support], buffer_seq_dims=[1]):
                try:
                    outcome[backend] = run(support, attend).detach()
                except Exception as e:      # PyTorch's own refusal, whatever its type
                    outcome[backend] = f"{type(e).__name__}: {e}"
        outcome["restored"] = F.scaled_dot_product_attention \
            is torch._C._nn.scaled_dot_product_attention
        return outcome
    compiled = torch.compile(model, backend="flashbob")
    with context_parallel(mesh, buffers=[support, query], buffer_seq_dims=[1, 1]):
        try:
            return derivatives(compiled, support, query, attend, total)
        except NotImplementedError as e:
            return dict(refused=str(e))


if __name__ == "__main__":
    out_dir, port, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    mp.spawn(rank_main, args=(world, out_dir, port), nprocs=world)
