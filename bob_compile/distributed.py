"""Second-order steps across processes: each rank differentiates its own loss, then the
results are averaged over the ranks.

DDP's reducer averages gradients inside `.backward()` only (it runs from the parameters'
gradient-accumulation hooks). The second-order recipes — a Hessian-vector product for
Sophia-H, MAML's outer gradient through an inner step — differentiate with
`torch.autograd.grad`, which never runs it: through DDP, eager or compiled with flashbob,
they return each rank's own values. `.backward(create_graph=True)` through DDP leaves the
higher-order terms unsynchronized (PyTorch warns) and its `.grad` cannot be differentiated
again. So a distributed second-order step is: under `ddp.no_sync()` (DDP then expects no
reduction), each rank computes its own derivatives with `torch.autograd.grad`, and these
helpers average them (one all-reduce per call). With equal-sized local batches whose loss
is a mean, the average of the ranks' gradients and Hessian-vector products is the gradient
and Hessian-vector product of the loss on the concatenated batch: the Hessian of a mean is
the mean of the Hessians. The vectors of an HVP must be the same on every rank (seed their
generator identically).

FSDP2 (`fully_shard`) parameters are sharded DTensors that the forward gathers; PyTorch's
`torch.autograd.grad` with respect to them fails ("appears to not have been used in the
graph"), eager or compiled, and with allow_unused=True returns zeros; so FSDP2 runs
first-order steps only (its `.backward()` reduce-scatters as usual), and the helpers here
refuse sharded parameters.
"""
import torch
import torch.distributed as dist


def mean_over_ranks(tensors, group=None):
    """Each tensor averaged over the ranks of `group` (None: the default group), in one
    all-reduce of a flat buffer; returns new tensors (None entries stay None)."""
    present = [t for t in tensors if t is not None]
    if not present:
        return list(tensors)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("bob_compile.distributed: torch.distributed is not initialized; "
                           "call torch.distributed.init_process_group first (or launch "
                           "with torchrun)")
    flat = torch.cat([t.detach().reshape(-1) for t in present])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat /= dist.get_world_size(group)
    out, offset = [], 0
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        out.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


def _refuse_sharded(inputs, what):
    """FSDP2's sharded parameters (DTensors) are not what the forward reads: autograd.grad
    with respect to them has nothing to follow, and with allow_unused it returns zeros."""
    if not dist.is_available():
        return
    from torch.distributed.tensor import DTensor
    if any(isinstance(t, DTensor) for t in inputs):
        raise ValueError(f"bob_compile.distributed.{what}: these parameters are sharded "
                         f"DTensors (FSDP2's fully_shard); the forward reads the unsharded "
                         f"copies FSDP2 gathers, so derivatives with respect to the sharded "
                         f"ones do not exist (eager PyTorch alike). Take second-order steps "
                         f"with DDP (or one process); FSDP2 runs first-order steps "
                         f"(loss.backward())")


def gradient(loss, inputs, group=None, **grad_kwargs):
    """torch.autograd.grad(loss, inputs) on this rank, averaged over the ranks: the
    gradient of the mean loss (MAML's outer gradient through each rank's own inner steps).
    `grad_kwargs` go to torch.autograd.grad (allow_unused, materialize_grads, ...)."""
    inputs = list(inputs) if not isinstance(inputs, torch.Tensor) else [inputs]
    _refuse_sharded(inputs, "gradient")
    if grad_kwargs.get("create_graph"):
        raise ValueError("bob_compile.distributed.gradient: the average over ranks is not "
                         "differentiable (an all-reduce); take create_graph=True gradients "
                         "with torch.autograd.grad on each rank and average the final result")
    return mean_over_ranks(torch.autograd.grad(loss, inputs, **grad_kwargs), group)


def gradient_and_hvp(loss, params, vectors, group=None):
    """(∇L, (∇²L) v) for L the mean of the ranks' losses, in one all-reduce: this rank's
    own gradient (create_graph=True) and double backward along `vectors`, averaged over
    the ranks (Sophia-H's Hessian step also needs the gradient). `vectors` must be equal on
    every rank. Parameters the loss does not use get zeros."""
    params = list(params)
    _refuse_sharded(params, "gradient_and_hvp")
    grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True,
                                materialize_grads=True)
    used = [i for i, g in enumerate(grads) if g.requires_grad]
    hvp = [torch.zeros_like(p) for p in params]
    if used:
        parts = torch.autograd.grad([grads[i] for i in used], [params[i] for i in used],
                                    [vectors[i] for i in used], allow_unused=True,
                                    materialize_grads=True)
        for i, part in zip(used, parts):
            hvp[i] = part
    averaged = mean_over_ranks([g.detach() for g in grads] + hvp, group)
    return averaged[:len(params)], averaged[len(params):]


def hessian_vector_product(loss, params, vectors, group=None):
    """(∇²L) v for L the mean of the ranks' losses (gradient_and_hvp without the gradient)."""
    return gradient_and_hvp(loss, params, vectors, group)[1]
