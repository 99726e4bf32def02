"""Prove that a mask in a Dynamo graph is exactly the causal mask, or say why it is not.

The op's causal mask is PyTorch's: aligned top-left, query i sees keys j <= i. A site is
rewritten with is_causal=True only with a proof, which comes in two kinds:

- The mask is built in the graph from shapes alone (`torch.ones(T, T).tril()`,
  `torch.triu(torch.full((T, T), min), 1)`, `arange(T)[None, :] <= arange(T)[:, None]`, ...),
  through elementwise ops, casts, indexing and broadcasting. We evaluate that subgraph
  abstractly: every value is one of
      Uniform(v)                  every entry is v;
      Band(d, lower, upper)       entry (..., i, j) is `lower` where j - i <= d, else `upper`;
      Index(axis, offset)         an arange: i + offset along dim -2 ("row") or
                                  j + offset along dim -1 ("col");
  and the causal mask is Band(0, visible, masked). This holds for every sequence length,
  so it is also a proof under dynamic shapes.
- The mask is read from a tensor the graph receives (nanoGPT's `bias` buffer, a mask passed
  in): its value is checked when compiling, and `CausalTensorGuard` checks its contents
  again on every call. If it no longer holds, the backend runs the untouched graph
  instead: a changed buffer is never silently wrong, however it was changed.

A masked score must vanish from the softmax: we accept -inf and any value at or below
float16's lowest (-65504), which covers `torch.finfo(dtype).min` of every float dtype
(Hugging Face's mask value); exp(s + that - max) is 0 unless unmasked logits sit ~65000
below masked ones. Old-style -10000.0 masks are not provably -inf and are left alone.
"""
import dataclasses
import math
import operator

import torch
from torch import fx

from .nodes import (arg, describe, example_tensor, is_op, is_one, same_sizes, storage_key,
                    written_operands)

MASKED_SCORE_LIMIT = torch.finfo(torch.float16).min


class NotProven(Exception):
    """The mask is not provably causal; the message says why."""


@dataclasses.dataclass(frozen=True)
class Uniform:
    value: object


@dataclasses.dataclass(frozen=True)
class Band:
    diagonal: int
    lower: object
    upper: object


@dataclasses.dataclass(frozen=True)
class Index:
    axis: str  # "row" (varies along dim -2) or "col" (along dim -1)
    offset: int


def _band(diagonal, lower, upper):
    return Uniform(lower) if lower == upper else Band(diagonal, lower, upper)


def band_pattern(like, lower, upper):
    """A tensor shaped and typed like `like`: `lower` on and below the main diagonal of
    every (..., R, C) matrix, `upper` above it."""
    rows, cols = like.shape[-2:]
    below = torch.ones(rows, cols, dtype=torch.bool, device=like.device).tril()
    pattern = torch.where(below, torch.tensor(lower, dtype=like.dtype, device=like.device),
                          torch.tensor(upper, dtype=like.dtype, device=like.device))
    return pattern.expand(like.shape)


def band_matches(t, lower, upper):
    """Whether `t` holds exactly band_pattern(t, lower, upper)."""
    with torch.no_grad():
        return torch.equal(t.detach(), band_pattern(t, lower, upper))


class CausalTensorGuard:
    """The run-time half of a proof that reads a mask from a graph input (e.g. a buffer).

    The input's contents are compared with the causal pattern on every call (`holds(args)`,
    or `failing_guards` for all the guards of a graph at once). Cheaper signals (tensor
    identity, version counter, data pointer) can all be bypassed: `buf.data[...] = x` or
    `buf.data.fill_(x)` writes through a tensor with its own version counter and changes
    no pointer. The comparison is one elementwise kernel per mask; on CUDA reading its
    result synchronizes the host, once per call for all the graph's masks. The pattern it
    compares with is cached per shape, dtype and device."""

    def __init__(self, arg_index, name, lower, upper):
        self.arg_index, self.name, self.lower, self.upper = arg_index, name, lower, upper
        self._pattern = None

    def matches(self, args):
        """False, or a 0-d bool tensor on the mask's device (not yet read back)."""
        t = args[self.arg_index]
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            return False
        pattern = self._pattern
        if pattern is None or (pattern.shape, pattern.dtype, pattern.device) != (t.shape, t.dtype, t.device):
            pattern = self._pattern = band_pattern(t, self.lower, self.upper)
        with torch.no_grad():
            return torch.eq(t.detach(), pattern).all()

    def holds(self, args):
        return not failing_guards([self], args)

    def __repr__(self):
        return f"CausalTensorGuard({self.name}: lower-triangular {self.lower!r}/{self.upper!r})"


def failing_guards(guards, args):
    """The guards that do not hold for `args`. Each mask is compared on its device and the
    results are read back together: on an accelerator one host synchronization per call,
    whatever the number of masks (a 12-layer model with a mask buffer per layer paid 12).
    A mask guarded twice (one buffer shared by layers) is compared once."""
    results, pending = [], {}
    seen = {}
    for guard in guards:
        t = args[guard.arg_index]
        key = (id(t), guard.lower, guard.upper)
        if key not in seen:
            seen[key] = guard.matches(args)
            if isinstance(seen[key], torch.Tensor):
                pending.setdefault(seen[key].device, []).append(key)
        results.append((guard, key))
    for keys in pending.values():
        for key, value in zip(keys, torch.stack([seen[k] for k in keys]).tolist()):
            seen[key] = value
    return [guard for guard, key in results if not seen[key]]


@dataclasses.dataclass
class MaskProof:
    nodes: list      # the mask's subgraph, to erase once no longer used
    guards: tuple    # CausalTensorGuard, for masks read from graph inputs
    how: str         # for the report


_FLIPPED = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt", "eq": "eq", "ne": "ne"}
_COMPARE = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
            "gt": operator.gt, "ge": operator.ge}
_ARITHMETIC = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
               "truediv": operator.truediv}


def _cast(value, dtype):
    """`value` converted as torch converts it to `dtype` (float32 rounding, bool, ...)."""
    if dtype is None or isinstance(value, Index):
        return value
    if not dtype.is_floating_point and isinstance(value, float) and not math.isfinite(value):
        raise NotProven(f"{value} cast to {dtype}")
    return torch.tensor(value).to(dtype).item()


def _with_values(node, example):
    """`example`, or where it is a fake tensor, the real tensor Dynamo recorded for the same
    graph input. DDPOptimizer compiles each piece of a graph it split (at DDP's gradient
    buckets) on fake copies of its inputs; the pieces' placeholders keep Dynamo's record of
    the real ones (`grapharg`), which holds the mask buffers' values."""
    from torch._subclasses.fake_tensor import is_fake
    if not is_fake(example):
        return example
    grapharg = node.meta.get("grapharg")
    try:
        real = grapharg.example if grapharg is not None else None
    except AssertionError:       # its weak reference died
        real = None
    if not isinstance(real, torch.Tensor) or is_fake(real) or real.shape != example.shape:
        raise NotProven(f"graph input {node.name} is a fake tensor with no recorded values")
    return real


class MaskProver:
    """Abstract evaluation of mask subgraphs of one graph (memoised across sites).

    For the body of a higher-order op (an activation-checkpointed block, say), `outer`
    maps the body's placeholders to (prover of the enclosing graph, the value passed in
    there), so that a mask built or read outside the block is proven where it is made."""

    def __init__(self, gm, example_inputs, outer=None):
        self._graph = gm.graph
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._arg_index = {n: i for i, n in enumerate(placeholders)}
        self._example_inputs = list(example_inputs)
        self._outer = dict(outer or {})
        self._memo = {}
        self._guards = {}
        self._writes = None

    # ------------------------------------------------------------------ public
    def prove(self, mask, kind, scores_size):
        """MaskProof that `mask`, applied as `kind` to scores of trailing size
        `scores_size` = (L, S), is the causal mask.

        kind: "masked"   true entries are removed (masked_fill, where(mask, fill, s));
              "visible"  true entries are kept (where(mask, s, fill), SDPA bool masks);
              "additive" added to the scores (0 kept, <= MASKED_SCORE_LIMIT removed).
        Raises NotProven with the reason."""
        mask_value = example_tensor(mask)
        if mask_value is not None and mask_value.requires_grad:
            # whatever it holds now, is_causal would drop its gradient
            raise NotProven("it requires grad (a learned bias)")
        value = self.value(mask)
        if mask_value is None or mask_value.dim() < 2 or not same_sizes(
                mask_value.shape[-2:], scores_size):
            shape = "?" if mask_value is None else list(mask_value.shape)
            raise NotProven(f"the mask's shape {shape} does not end in the scores' "
                            f"{list(scores_size)}")
        if not isinstance(value, Band):
            raise NotProven(f"the mask is uniform ({value.value!r}): it is not causal")
        if value.diagonal != 0:
            raise NotProven(f"the mask keeps keys j <= i{value.diagonal:+d}: causal with an "
                            f"offset (e.g. bottom-right aligned), not top-left causal")
        keeps, removes = {
            "masked": (not value.lower, bool(value.upper)),
            "visible": (bool(value.lower), not value.upper),
            "additive": (value.lower == 0, value.upper <= MASKED_SCORE_LIMIT),
        }[kind]
        if not (keeps and removes):
            raise NotProven(f"the mask is {value.lower!r} on/below the diagonal and "
                            f"{value.upper!r} above it: as {kind} mask that is not causal"
                            + (" (masked value not <= -65504, so not provably -inf)"
                               if kind == "additive" and keeps else ""))
        nodes, guards = self._dependencies(mask)
        how = ("built in the graph" if not guards else
               "from " + ", ".join(g.name for g in guards) + ", checked at run time")
        return MaskProof([n for n in nodes if n.op != "placeholder"], tuple(guards), how)

    def masking_value(self, fill):
        """Raise NotProven unless `fill` (a number or a graph value) removes a score."""
        value = fill if not isinstance(fill, fx.Node) else self.value(fill)
        if isinstance(value, Uniform):
            value = value.value
        if not isinstance(value, (int, float)) or value > MASKED_SCORE_LIMIT:
            raise NotProven(f"the fill value {describe(fill)} is not -inf (nor <= -65504)")
        if isinstance(fill, fx.Node):
            self._dependencies(fill)

    def value(self, x):
        if not isinstance(x, fx.Node):
            if isinstance(x, (bool, int, float)):
                return x
            raise NotProven(f"{describe(x)} is not a number")
        if x not in self._memo:
            try:
                self._memo[x] = self._evaluate(x)
            except NotProven as e:
                self._memo[x] = e
        result = self._memo[x]
        if isinstance(result, NotProven):
            raise result
        return result

    # ------------------------------------------------------------------ evaluation
    def _dependencies(self, x):
        """(the nodes of this graph that x's proven value rests on, the run-time guards
        it needs, from enclosing graphs too). NotProven if the graph writes any of
        them in place: the proof reads the code that builds a mask, so a later
        `mask[i] = v`, `mask.fill_(v)`, `out=mask` (or a write through a view) would
        make it wrong."""
        nodes = self._subgraph(x)
        self._check_not_written(nodes)
        guards = [self._guards[n] for n in nodes if n in self._guards]
        for n in nodes:
            if n in self._outer:
                prover, outer_node = self._outer[n]
                guards += [g for g in prover._dependencies(outer_node)[1] if g not in guards]
        return nodes, guards

    def _check_not_written(self, nodes):
        if self._writes is None:
            self._writes = [(n, w) for n in self._graph.nodes for w in written_operands(n)]
        storages = {storage_key(n) for n in nodes} - {None}
        for writer, written in self._writes:
            if written in nodes or storage_key(written) in storages:
                raise NotProven(f"{describe(writer)} writes in place to {written.name}, "
                                f"which the mask is made from")

    def _subgraph(self, mask):
        seen, stack = [], [mask]
        while stack:
            n = stack.pop()
            if isinstance(n, fx.Node) and n not in seen and n in self._memo:
                seen.append(n)
                stack.extend(n.all_input_nodes)
        return seen

    def _evaluate(self, node):
        if node.op == "placeholder":
            return self._graph_input(node)
        for kind, handler in self._HANDLERS:
            if is_op(node, *kind):
                value = handler(self, node)
                return self._cast_to_node_dtype(node, value)
        raise NotProven(f"{describe(node)} is not something the causal-mask proof understands")

    def _cast_to_node_dtype(self, node, value):
        out = example_tensor(node)
        if out is None:
            raise NotProven(f"{describe(node)} has no recorded tensor value")
        if isinstance(value, Index):
            if out.dtype == torch.bool:
                raise NotProven(f"{describe(node)} casts an index to bool")
            return value
        if isinstance(value, Uniform):
            return Uniform(_cast(value.value, out.dtype))
        if isinstance(value, Band):
            return _band(value.diagonal, _cast(value.lower, out.dtype), _cast(value.upper, out.dtype))
        return Uniform(_cast(value, out.dtype))

    def _graph_input(self, node):
        if node in self._outer:
            prover, outer_node = self._outer[node]
            return prover.value(outer_node)
        index = self._arg_index[node]
        t = self._example_inputs[index] if index < len(self._example_inputs) else None
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.numel() == 0:
            raise NotProven(f"graph input {node.name} is not a mask tensor")
        t = _with_values(node, t)
        rows, cols = t.shape[-2:]
        corner = t.reshape(-1, rows, cols)[0]
        lower, upper = corner[0, 0].item(), corner[0, cols - 1].item()
        if lower == upper or not band_matches(t, lower, upper):
            raise NotProven(f"graph input {node.name} is not a lower-triangular mask")
        self._guards[node] = CausalTensorGuard(index, node.name, lower, upper)
        return Band(0, lower, upper)

    # factories -----------------------------------------------------------
    def _factory(self, node):
        if is_op(node, "ones", "ones_like", "new_ones"):
            return Uniform(1)
        if is_op(node, "zeros", "zeros_like", "new_zeros"):
            return Uniform(0)
        if is_op(node, "full", "full_like", "new_full"):
            fill = arg(node, 2 if node.op == "call_method" else 1, "fill_value")
        else:  # torch.tensor(v) / torch.scalar_tensor(v)
            fill = node.args[0] if node.args else None
        if not isinstance(fill, (bool, int, float)):
            raise NotProven(f"{describe(node)} is filled with {describe(fill)}, not a constant")
        return Uniform(fill)

    def _arange(self, node):
        start = node.args[0] if len(node.args) >= 2 else node.kwargs.get("start", 0)
        step = node.args[2] if len(node.args) >= 3 else node.kwargs.get("step", 1)
        if not isinstance(start, int) or step != 1:
            raise NotProven(f"{describe(node)} is not arange(n) or arange(start, end) with a constant start")
        return Index("col", start)

    def _triangle(self, node):
        x = self.value(node.args[0])
        d = arg(node, 1, "diagonal", 0)
        if not isinstance(d, int):
            raise NotProven(f"{describe(node)} has a computed diagonal")
        keep_lower = is_op(node, "tril")
        if isinstance(x, Uniform):
            zero = _cast(0, example_tensor(node).dtype)
            return _band(d, x.value, zero) if keep_lower else _band(d - 1, zero, x.value)
        if isinstance(x, Band) and keep_lower and (d == x.diagonal or (x.upper == 0 and d >= x.diagonal)):
            return _band(min(d, x.diagonal), x.lower, 0)
        if isinstance(x, Band) and not keep_lower and (d - 1 == x.diagonal or (x.lower == 0 and d - 1 <= x.diagonal)):
            return _band(max(d - 1, x.diagonal), 0, x.upper)
        raise NotProven(f"{describe(node)} of {x} is not a single band")

    # same values, other dtype or shape -------------------------------------
    def _same_values(self, node):
        return self.value(node.args[0])

    def _reshaped(self, node):
        x = self.value(node.args[0])
        if isinstance(x, Uniform):
            return x
        before, after = example_tensor(node.args[0]), example_tensor(node)
        if before is None or after is None:
            raise NotProven(f"{describe(node)} has no recorded tensor value")
        if isinstance(x, Index):
            return Index(self._index_axis(node, after), x.offset)
        if is_op(node, "getitem"):
            return self._sliced_band(node, x, before)
        if before.dim() >= 2 and after.dim() >= 2 and same_sizes(before.shape[-2:], after.shape[-2:]):
            return x
        raise NotProven(f"{describe(node)} changes the mask's last two dims")

    def _index_axis(self, node, after):
        if is_op(node, "getitem"):
            items = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
            for item in items:
                if isinstance(item, slice) and item.start not in (None, 0) or \
                        isinstance(item, slice) and item.step not in (None, 1) or \
                        not isinstance(item, (slice, type(None), type(Ellipsis))):
                    raise NotProven(f"{describe(node)} indexes an arange other than by [:, None]")
        varying = [d for d, size in enumerate(after.shape) if not is_one(size)]
        if len(varying) != 1 or varying[0] < after.dim() - 2:
            raise NotProven(f"{describe(node)} puts an arange elsewhere than a row or column")
        return "col" if varying[0] == after.dim() - 1 else "row"

    def _sliced_band(self, node, x, before):
        """x[..., r0:, c0:] of a band shifts its diagonal by r0 - c0."""
        items = list(node.args[1]) if isinstance(node.args[1], tuple) else [node.args[1]]
        consumed = sum(1 for item in items if item is not None and item is not Ellipsis)
        fill = [slice(None)] * (before.dim() - consumed)
        if Ellipsis in items:
            i = items.index(Ellipsis)
            items = items[:i] + fill + items[i + 1:]
        else:
            items = items + fill
        if not all(isinstance(item, (int, slice)) or item is None for item in items):
            raise NotProven(f"{describe(node)} indexes the mask with a tensor")
        rows, cols = items[-2:]
        if not all(isinstance(s, slice) and s.step in (None, 1) for s in (rows, cols)):
            raise NotProven(f"{describe(node)} does not keep the mask's last two dims")
        starts = [0 if s.start is None else s.start for s in (rows, cols)]
        if not all(isinstance(s, int) and s >= 0 for s in starts):
            raise NotProven(f"{describe(node)} slices the mask from a computed offset")
        return Band(x.diagonal + starts[0] - starts[1], x.lower, x.upper)

    # elementwise ----------------------------------------------------------
    def _compare(self, node):
        name = next(n for n in _COMPARE if is_op(node, n))
        a, b = self.value(node.args[0]), self.value(node.args[1])
        if isinstance(a, Index) or isinstance(b, Index):
            return self._compare_indices(node, name, a, b)
        return self._elementwise(node, _COMPARE[name], node.args[0], node.args[1])

    def _compare_indices(self, node, name, a, b):
        if not (isinstance(a, Index) and isinstance(b, Index)) or a.axis == b.axis \
                or name in ("eq", "ne"):
            raise NotProven(f"{describe(node)} is not a comparison of a row and a column index")
        if a.axis == "row":
            a, b, name = b, a, _FLIPPED[name]
        # (j + a.offset) <name> (i + b.offset)  <=>  j - i <name> k
        k = b.offset - a.offset
        return {"le": Band(k, True, False), "lt": Band(k - 1, True, False),
                "gt": Band(k, False, True), "ge": Band(k - 1, False, True)}[name]

    def _arithmetic(self, node):
        if node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("rounding_mode") is not None:
            raise NotProven(f"{describe(node)} has alpha or rounding_mode")
        if is_op(node, "rsub"):
            name, operands = "sub", (node.args[1], node.args[0])
        else:
            name, operands = next(n for n in _ARITHMETIC if is_op(node, n)), node.args[:2]
        a, b = (self.value(o) for o in operands)
        if isinstance(a, Index) or isinstance(b, Index):
            if name in ("add", "sub") and isinstance(a, Index) and isinstance(b, int):
                return Index(a.axis, a.offset + (b if name == "add" else -b))
            if name == "add" and isinstance(b, Index) and isinstance(a, int):
                return Index(b.axis, b.offset + a)
            raise NotProven(f"{describe(node)} is arithmetic on an index other than a constant shift")
        if any(isinstance(scalar, bool) for v in (a, b) for scalar in _scalars(v)):
            raise NotProven(f"{describe(node)} is arithmetic on bools")
        return self._elementwise(node, _ARITHMETIC[name], *operands)

    def _unary(self, node):
        if is_op(node, "neg"):
            return self._elementwise(node, operator.neg, node.args[0])
        if is_op(node, "logical_not"):
            return self._elementwise(node, lambda v: not v, node.args[0])
        return self._elementwise(node, _invert, node.args[0])

    def _logical(self, node):
        operands = node.args[:2]
        if is_op(node, "logical_and"):
            return self._elementwise(node, lambda u, v: bool(u) and bool(v), *operands)
        if is_op(node, "logical_or"):
            return self._elementwise(node, lambda u, v: bool(u) or bool(v), *operands)
        fn = operator.and_ if is_op(node, "and_") else operator.or_
        return self._elementwise(node, lambda u, v: fn(_as_bool(u), _as_bool(v)), *operands)

    def _where(self, node):
        if is_op(node, "masked_fill"):
            x, condition, fill = node.args[0], arg(node, 1, "mask"), arg(node, 2, "value")
            a, b = fill, x
        else:
            if len(node.args) != 3:
                raise NotProven(f"{describe(node)} is not where(condition, a, b)")
            condition, a, b = node.args
        return self._elementwise(node, lambda c, u, v: u if c else v, condition, a, b)

    def _elementwise(self, node, fn, *operands):
        """fn applied entrywise; operands are graph values or constants."""
        values = [self.value(o) for o in operands]
        if any(isinstance(v, Index) for v in values):
            raise NotProven(f"{describe(node)} combines an arange with other values")
        out = example_tensor(node)
        for operand, v in zip(operands, values):
            if isinstance(v, Band) and not same_sizes(example_tensor(operand).shape[-2:], out.shape[-2:]):
                raise NotProven(f"{describe(node)} broadcasts a band-shaped mask")
        diagonals = {v.diagonal for v in values if isinstance(v, Band)}
        if len(diagonals) > 1:
            raise NotProven(f"{describe(node)} combines masks with different diagonals")

        def side(name):
            return [getattr(v, name) if isinstance(v, Band) else
                    v.value if isinstance(v, Uniform) else v for v in values]
        try:
            if not diagonals:
                return Uniform(fn(*side("value")))
            return _band(diagonals.pop(), fn(*side("lower")), fn(*side("upper")))
        except (ArithmeticError, TypeError) as e:
            raise NotProven(f"{describe(node)}: {e}") from None

    _HANDLERS = (
        (("ones", "zeros", "full", "ones_like", "zeros_like", "full_like", "new_ones",
          "new_zeros", "new_full", "scalar_tensor"), _factory),
        (("arange",), _arange),
        (("tril", "triu"), _triangle),
        (("same_values", "cast"), _same_values),
        (("reshape", "unsqueeze", "broadcast_to", "getitem"), _reshaped),
        (tuple(_COMPARE), _compare),
        (("add", "sub", "rsub", "mul", "truediv"), _arithmetic),
        (("neg", "logical_not", "invert"), _unary),
        (("and_", "or_", "logical_and", "logical_or"), _logical),
        (("where", "masked_fill"), _where),
    )


def _scalars(v):
    if isinstance(v, Band):
        return [v.lower, v.upper]
    return [v.value] if isinstance(v, Uniform) else [v]


def _as_bool(v):
    if not isinstance(v, bool):
        raise TypeError("bitwise op on non-bool values")
    return v


def _invert(v):
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return ~v
    raise TypeError("~ of a float")

