"""Context parallelism with exact derivatives of every order: attention over a sequence
that is sharded across ranks.

Each rank holds a shard of the sequence of every head: contiguous (rank i the positions
[i n, (i + 1) n), n = N / ranks) or head-tail (PyTorch's load balancing). `attention`
exchanges heads for positions with one all-to-all per input: each rank then holds the whole
sequence of H / ranks of the heads, runs the op on them (fused kernels, every order), and a
last all-to-all hands each rank its own positions of every head back (a head-tail shard is
put in the sequence's order between the two). Every tensor a rank holds is 1 / ranks of
the whole (O(N / ranks) per head), and the causal work is balanced in either order: every
rank computes every position of its heads. PyTorch's `context_parallel` reaches this module
through torch_context_parallel.py.

The exchanges are linear permutations across ranks, and each one's derivative is the
other: an autograd Function whose backward is the other exchange (and whose forward-mode
tangent is the same exchange of the tangent), each differentiable again. So autograd
differentiates through them to any order, as through the op: first order, Hessian-vector
products (reverse over reverse, or forward over reverse with torch.autograd.forward_ad),
MAML's outer gradient. Every rank must run the same
derivatives in the same order (they are collectives, as DDP's are).

A loss spread over ranks is the sum of each rank's loss on its positions; each rank's
`torch.autograd.grad` gives its share of a derivative, `sum_over_ranks` the whole (it is
differentiable: a MAML inner step's summed gradient can be differentiated again).

In a model compiled with `torch.compile(..., backend="flashbob")` these calls run between
the compiled graphs (a graph break each), the op inside them fused as in eager code.

Where the ranks do not divide the query heads, every rank gathers the whole sequence's keys
and values instead (all-gather; its adjoint sums each rank's rows over the ranks) and
attends from its own queries: memory O(N) per head for the keys and values, O(N / ranks)
for everything else. Causal, each contiguous chunk of a rank's queries attends to the keys
before it (no mask) and to its own chunk (causal); the two are merged by their
log-sum-exps, which the op differentiates to any order as it does its output.

Limits: key/value heads the ranks do not divide are repeated, one per query head, before
the exchange (their memory grows by the group size); every rank holds the same shard
length. A mask is given for the whole sequence, the same on every rank (key padding
(B, 1, 1, N), or (B, H or 1, N, N)). With dropout, each rank draws the keep mask of its
own heads (or queries), so the draws differ from a single process's.
"""
import torch
import torch.distributed as dist

from .attention import attention as _attention
from .attention import attention_with_lse


def _world(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("bob_compile.context_parallel: torch.distributed is not initialized;"
                           " call torch.distributed.init_process_group first (or launch with "
                           "torchrun)")
    return dist.get_world_size(group)


def _all_to_all(chunks, group):
    """chunks: (ranks, ...) contiguous; chunk j goes to rank j; returns (ranks, ...) where
    entry i came from rank i."""
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received, chunks, group=group)
    return received


def _sequence_to_heads(x, group):
    """(B, H, n, d) this rank's positions of every head -> (B, H / ranks, N, d) every
    position of this rank's heads."""
    ranks = _world(group)
    B, H, n, d = x.shape
    chunks = x.reshape(B, ranks, H // ranks, n, d).permute(1, 0, 2, 3, 4).contiguous()
    received = _all_to_all(chunks, group)            # entry i: rank i's positions
    return received.permute(1, 2, 0, 3, 4).reshape(B, H // ranks, ranks * n, d)


def _heads_to_sequence(x, group):
    """The inverse: (B, H / ranks, N, d) -> (B, H, n, d)."""
    ranks = _world(group)
    B, h, N, d = x.shape
    chunks = x.reshape(B, h, ranks, N // ranks, d).permute(2, 0, 1, 3, 4).contiguous()
    received = _all_to_all(chunks, group)            # entry i: rank i's heads
    return received.permute(1, 0, 2, 3, 4).reshape(B, ranks * h, N // ranks, d)


def _sum_over_ranks(x, group):
    y = x.clone()
    dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
    return y


def _gather_sequence(x, group):
    """(B, H, n, d) this rank's positions -> (B, H, ranks n, d) every rank's, rank by rank."""
    parts = [torch.empty_like(x) for _ in range(_world(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=2)


def _sum_own_positions(x, group):
    """The adjoint of _gather_sequence: (B, H, ranks n, d) -> this rank's n rows of the sum
    over ranks (an all-reduce: gloo has no reduce-scatter)."""
    n = x.shape[2] // _world(group)
    return _sum_over_ranks(x, group).narrow(2, dist.get_rank(group) * n, n)


# Each exchange is linear; the derivative of one is its adjoint: the inverse permutation
# for the all-to-alls, itself for the sum over ranks, the sum of the rank's own rows for the
# all-gather (and the all-gather for that).
_EXCHANGES = {"sequence to heads": _sequence_to_heads, "heads to sequence": _heads_to_sequence,
              "sum over ranks": _sum_over_ranks, "gather sequence": _gather_sequence,
              "sum own positions": _sum_own_positions}
_ADJOINT = {"sequence to heads": "heads to sequence", "heads to sequence": "sequence to heads",
            "sum over ranks": "sum over ranks", "gather sequence": "sum own positions",
            "sum own positions": "gather sequence"}


class _Exchange(torch.autograd.Function):
    """One of _EXCHANGES. Its backward is the adjoint exchange and its forward-mode tangent
    the same exchange, each an _Exchange again: differentiable to any order."""
    @staticmethod
    def forward(ctx, x, group, kind):
        ctx.group, ctx.kind = group, kind
        return _EXCHANGES[kind](x, group)

    @staticmethod
    def backward(ctx, grad):
        return _Exchange.apply(grad, ctx.group, _ADJOINT[ctx.kind]), None, None

    @staticmethod
    def jvp(ctx, tangent, _group, _kind):
        return _Exchange.apply(tangent, ctx.group, ctx.kind)


@torch.compiler.disable     # collectives inside autograd Functions: run between graphs
def sum_over_ranks(tensors, group=None):
    """Each tensor summed over the ranks of `group`, differentiably (None entries stay
    None): the whole of a derivative whose shares the ranks computed."""
    _world(group)
    return [None if t is None else _Exchange.apply(t, group, "sum over ranks") for t in tensors]


@torch.compiler.disable     # between compiled graphs (the op inside still runs fused)
def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              group=None, order="contiguous"):
    """`bob_compile.attention` over a sequence sharded across the ranks of `group`.

    Args:
        query: (B, Hq, n, E), this rank's n positions (rank i: [i n, (i + 1) n) of the
            sequence); key: (B, Hkv, n, E); value: (B, Hkv, n, Ev), the same positions.
        attn_mask: None, or a mask for the whole sequence as `bob_compile.attention` takes
            it, broadcastable to (B, Hq, N, N), the same on every rank.
        dropout_p, is_causal, scale: as `bob_compile.attention` (is_causal over the whole
            sequence).
        order: which positions each rank holds. "contiguous": rank i the i-th of `ranks`
            equal slices. "head-tail": the sequence cut into 2 ranks equal chunks, rank i
            holding chunks i and 2 ranks - 1 - i, in that order (PyTorch's context-parallel
            load balancing for causal attention).

    Returns (B, Hq, n, Ev): this rank's positions of the attention over the whole sequence,
    differentiable to any order (collectives: every rank must differentiate alike).
    """
    ranks = _world(group)
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError("bob_compile.context_parallel.attention takes (B, H, n, E) shards")
    Hq, Hkv = query.shape[1], key.shape[1]
    if Hq % Hkv:
        raise ValueError(f"bob_compile.context_parallel.attention: the key/value heads "
                         f"({Hkv}) must divide the query heads ({Hq})")
    if not query.shape[2] == key.shape[2] == value.shape[2]:
        raise ValueError("bob_compile.context_parallel.attention: query, key and value must "
                         "hold the same positions of the sequence")
    if order not in _ORDERS:
        raise ValueError(f"bob_compile.context_parallel.attention: order must be one of "
                         f"{sorted(_ORDERS)}, got {order!r}")
    if scale is None:
        scale = query.shape[-1] ** -0.5
    n = query.shape[2]
    gathered = _ORDERS[order](ranks, n)     # whole-sequence position of each gathered row
    mask = attn_mask
    if mask is not None:
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
    if Hq % ranks:
        return _keys_gathered(query, key, value, mask, dropout_p, is_causal, scale, group,
                              order, gathered)
    if Hkv % ranks:     # fewer key/value heads than ranks can split: one per query head
        key, value = (t.repeat_interleave(Hq // Hkv, dim=1) for t in (key, value))
        Hkv = Hq
    q, k, v = _in_sequence_order(
        [_Exchange.apply(t, group, "sequence to heads") for t in (query, key, value)], gathered)
    if mask is not None:
        mask = _heads_of_this_rank(mask, Hq, ranks, group)
    out = _attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                     scale=scale, enable_gqa=Hq != Hkv)
    if gathered is not None:
        out = out.index_select(2, gathered.to(out.device))
    return _Exchange.apply(out, group, "heads to sequence")


def _keys_gathered(query, key, value, mask, dropout_p, is_causal, scale, group, order,
                   gathered):
    """More ranks than the heads split into: every rank gathers the whole sequence's keys
    and values and attends from its own queries. Causal: each contiguous chunk of its
    queries attends to the keys before the chunk (no mask) and to its own chunk (causal),
    the two merged by their log-sum-exps (differentiable, as the op's lse is)."""
    rank = dist.get_rank(group)
    n = query.shape[2]
    k, v = _in_sequence_order(
        [_Exchange.apply(t, group, "gather sequence") for t in (key, value)], gathered)
    own = torch.arange(rank * n, (rank + 1) * n) if gathered is None \
        else gathered[rank * n:(rank + 1) * n]
    gqa = query.shape[1] != key.shape[1]
    if not is_causal:
        rows = None if mask is None or mask.shape[2] == 1 else own.to(mask.device)
        part = None if mask is None else (mask if rows is None else mask.index_select(2, rows))
        return _attention(query, k, v, attn_mask=part, dropout_p=dropout_p, scale=scale,
                          enable_gqa=gqa)
    outs = []
    for local, length in _chunks(own):
        start = int(own[local])
        q = query.narrow(2, local, length)
        # its own chunk (causal), then the keys before it (all visible)
        parts = [attention_with_lse(q, k.narrow(2, start, length), v.narrow(2, start, length),
                                    _mask_part(mask, start, length, start, length), dropout_p,
                                    True, scale, gqa)]
        if start:
            parts.append(attention_with_lse(q, k.narrow(2, 0, start), v.narrow(2, 0, start),
                                            _mask_part(mask, start, length, 0, start),
                                            dropout_p, False, scale, gqa))
        outs.append(_merged(parts))
    return torch.cat(outs, dim=2)


def _in_sequence_order(tensors, gathered):
    """Rows gathered rank by rank (dim 2), put in the sequence's order."""
    if gathered is None:
        return tensors
    in_sequence = torch.argsort(gathered).to(tensors[0].device)
    return [t.index_select(2, in_sequence) for t in tensors]


def _chunks(positions):
    """(local offset, length) of each run of consecutive positions."""
    breaks = [0] + [i for i in range(1, len(positions))
                    if positions[i] != positions[i - 1] + 1] + [len(positions)]
    return [(a, b - a) for a, b in zip(breaks, breaks[1:])]


def _mask_part(mask, row, rows, col, cols):
    if mask is None:
        return None
    if mask.shape[2] != 1:
        mask = mask.narrow(2, row, rows)
    return mask.narrow(3, col, cols)


def _merged(parts):
    """Attention over the union of disjoint key sets from each set's (o, lse): the outputs
    weighted by exp(lse - m) and normalized. The shift m cancels, so it is not
    differentiated; rows that see no key in any set stay zero."""
    if len(parts) == 1:
        return parts[0][0]
    (o1, l1), (o2, l2) = parts
    shift = torch.maximum(l1, l2).detach()
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    w1, w2 = torch.exp(l1 - shift), torch.exp(l2 - shift)
    total = w1 + w2
    total = torch.where(total > 0, total, torch.ones_like(total))
    out = (w1.unsqueeze(-1) * o1.to(w1.dtype) + w2.unsqueeze(-1) * o2.to(w2.dtype)) \
        / total.unsqueeze(-1)
    return out.to(o1.dtype)


def _head_tail(ranks, n):
    """Rank i's positions are chunks i and 2 ranks - 1 - i of 2 ranks chunks of n / 2."""
    if n % 2:
        raise ValueError(f"bob_compile.context_parallel.attention: order 'head-tail' needs an "
                         f"even shard length, got {n}")
    chunks = torch.arange(ranks * n).view(2 * ranks, n // 2)
    return torch.cat([torch.cat([chunks[i], chunks[2 * ranks - 1 - i]]) for i in range(ranks)])


# Position in the whole sequence of each row the exchange gathers (rank 0's rows, then rank
# 1's, ...), None where that is already the sequence's order.
_ORDERS = {"contiguous": lambda ranks, n: None, "head-tail": _head_tail}


def _heads_of_this_rank(mask, heads, ranks, group):
    """The whole sequence's (4-D) mask, cut to this rank's heads where it has a head dim."""
    if mask.shape[1] == 1:
        return mask
    if mask.shape[1] != heads:
        raise ValueError(f"bob_compile.context_parallel.attention: a mask's head dim must be 1"
                         f" or {heads}, got {mask.shape[1]}")
    per_rank = heads // ranks
    rank = dist.get_rank(group)
    return mask[:, rank * per_rank:(rank + 1) * per_rank]
