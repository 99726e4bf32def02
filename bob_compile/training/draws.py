"""Random draws of a training graph, and their replay in a second-order step.

A second-order step recomputes the forward (bob_compile/training/second_order.py): it must
see the numbers the first forward drew (dropout's mask, noise), or the Hessian would mix two
functions. The compiled forward therefore returns its draws (`find_draws`), and the
recomputation runs under `ReplayDraws`, which answers each random op with the next draw.

The two sides meet at the same level. AOTAutograd traces with the Python dispatcher on and
inductor's decompositions, with `fallback_random` (aten's random ops, not inductor's
seeds-and-offsets form): the forward graph holds one functional random op per draw, in the
order the program drew them. ReplayDraws sees the same ops above functionalization (the
in-place `bernoulli_` where the graph holds `bernoulli`), in the same order; an eager
recomputation turns the Python dispatcher on too, so that `F.dropout` reaches it as
`native_dropout` here as well. `draw_kind` names an op the same way on both sides, and a
draw that does not match raises DrawMismatch: never a replay of the wrong numbers.
"""
import operator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NATIVE_DROPOUT = torch.ops.aten.native_dropout.default


class DrawMismatch(RuntimeError):
    """A recomputation drew differently from the forward it replays."""


def draw_kind(op):
    """An op's name without namespace, overload, in-place or functional suffix:
    `bernoulli_.float` and `bernoulli.p` are both "bernoulli"."""
    name = op._schema.name.split("::")[-1]
    return name.removesuffix("_functional").rstrip("_")


def is_seeded(op):
    return isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags


def draws_nothing(op, args, kwargs):
    """Fused attention is tagged seeded for its dropout; with dropout_p 0 it draws nothing."""
    names = [a.name for a in op._schema.arguments]
    if "dropout_p" not in names:
        return False
    at = names.index("dropout_p")
    p = args[at] if at < len(args) else kwargs.get("dropout_p", 0.0)
    return p == 0


class UnreplayableDraw(Exception):
    """A random op whose draw cannot be handed to a replay (several outputs, say)."""


def find_draws(graph):
    """The graph values holding what each random op of an aten-level forward graph drew, in
    program order, and their kinds: the op's output, or dropout's mask (added to the graph
    where nothing reads it yet). Raises UnreplayableDraw."""
    values, kinds = [], []
    for node in list(graph.graph.nodes):
        if node.op != "call_function" or not is_seeded(node.target):
            continue
        if draws_nothing(node.target, node.args, node.kwargs):
            continue
        if node.target is NATIVE_DROPOUT:
            values.append(_dropout_mask(graph, node))
        elif isinstance(node.meta.get("val"), torch.Tensor):
            values.append(node)
        else:
            raise UnreplayableDraw(f"{node.target} draws random numbers that a second-order "
                                   f"step could not replay")
        kinds.append(draw_kind(node.target))
    return values, kinds


def _dropout_mask(graph, dropout):
    for user in dropout.users:
        if user.target is operator.getitem and user.args[1] == 1:
            return user
    with graph.graph.inserting_after(dropout):
        mask = graph.graph.call_function(operator.getitem, (dropout, 1))
    mask.meta["val"] = dropout.meta["val"][1]
    return mask


class ReplayDraws(TorchDispatchMode):
    """Answer the random ops run under it with `draws` (what `find_draws` found, in
    order), checked against `kinds`. Sits below autograd: each op still records its own
    derivative, now of the replayed values (dropout's of its mask, `normal`'s of its
    result). `finish()` checks that every draw was used."""

    def __init__(self, kinds, draws):
        super().__init__()
        self.kinds, self.draws, self.used = list(kinds), list(draws), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not is_seeded(func) or draws_nothing(func, args, kwargs):
            return func(*args, **kwargs)
        k = self.used
        if k >= len(self.draws) or self.kinds[k] != draw_kind(func):
            expected = self.kinds[k] if k < len(self.kinds) else "no more draws"
            raise DrawMismatch(f"the recomputed forward drew {draw_kind(func)} where the "
                               f"compiled forward drew {expected} (draw {k})")
        self.used += 1
        draw = self.draws[k]
        if func is NATIVE_DROPOUT:                 # native_dropout's own formula
            x, p = args[0], args[1]
            train = args[2] if len(args) > 2 else kwargs.get("train")
            if train is False:
                return x.clone(), draw
            return x * draw * (0.0 if p >= 1 else 1.0 / (1.0 - p)), draw
        if func._schema.is_mutable:                # bernoulli_, uniform_, exponential_, ...
            return args[0].copy_(draw)
        return draw.clone()                        # a fresh tensor, as the op would return

    def finish(self):
        if self.used != len(self.draws):
            raise DrawMismatch(f"the recomputed forward drew {self.used} times, the compiled "
                               f"forward {len(self.draws)} times")
