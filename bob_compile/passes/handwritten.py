"""Replace attention written by hand by `bob_compile.attention`.

The matcher starts at each softmax and walks the graph both ways:

    q ─[* s]─┐
             matmul ─[* s | / s]*─[tanh ─[* c]*]─[causal mask]─[* s]*─[upcast]─ softmax(dim=-1) ─[cast]─[dropout]─ matmul ─> out
    k ─[* s]─ transpose(-2, -1) ┘                                                                                 v ┘

- scales: constants, numbers computed in the graph (1/sqrt(head_dim) under dynamic shapes)
  or 0-d constant tensors (GPT-2), on the scores or on q/k; several multiply;
- soft-capping (Gemma 2's eager attention: scores / c, tanh, * c): the constant factors
  after the tanh are the cap c, and those before it times c the op's scale; the mask must
  come after the cap (a mask under tanh would be capped too: not the op's order);
- mask: masked_fill(mask, -inf), `+ additive_mask` or where(mask, scores, min); a mask
  proven causal by causal_mask.py makes the site causal, any other mask that does not
  require grad (HF eager's padding and sliding-window masks) is passed on as attention's
  attn_mask (an additive one only when no scale multiplies it, and not through einsum
  layouts);
- the transpose of k in any spelling (transpose/swapaxes/permute/.mT); without one, the
  op gets `k_transposed.transpose(-2, -1)`;
- the products as matmul/bmm, `torch.baddbmm(_, q, kᵀ, beta=0, alpha=scale)` (Megatron,
  BLOOM-style; beta=1 adds a mask), or einsum in any layout that einsum.py accepts;
- every node of the chain has a single user: if the scores or probabilities are used
  elsewhere (returned, logged, a second matmul), the site is left alone.

A site is every softmax over a product of two activations (`attention_like_softmaxes`):
each one is either replaced or reported with the reason, so that a model with attention
never reports "0 attention sites".

The model spellings this was written against are in tests/attention_patterns.py. Anything
else keeps its nodes, and the report says which link of the chain failed and why.
"""
import operator

import torch

from ..attention import attention
from . import einsum
from .causal_mask import NotProven
from .erase import erase_unused
from .nodes import (arg, describe, dim_index, dropout_problem, example, example_tensor, is_number,
                    is_one, is_op,
                    is_positive, is_symbolic_number, is_zero, mask_problem, same_sizes,
                    shape_text, swaps_last_two_dims, user_code)
from .report import Site


class _Skip(Exception):
    """This softmax is not attention we can replace; the message says why."""


class _Chain:
    """What a match collected: operands, scale factors, mask proof, the matched nodes."""

    def __init__(self):
        self.nodes = []          # matched nodes, erased when the rewrite leaves them unused
        self.factors = []        # (number or SymFloat node, divides: bool)
        self.proof = None
        self.mask = None         # a general mask: (node, negate it, report text)
        self.q = self.k = self.k_transposed = self.v = self.output = None
        # einsum layouts: permutations to the op's (batch..., N, E) and back, None = as is
        self.q_perm = self.k_perm = self.v_perm = self.out_perm = None
        self.shared_kv_head = False   # k and v have one head that the matmuls broadcast
        self.dropout_p = 0.0          # an active dropout of the probabilities
        self.softcap = 0.0            # the cap c of soft-capped scores (c tanh(u / c))


def rewrite_handwritten(gm, prover, report):
    """Rewrite every supported hand-written attention of `gm` in place; one Site per
    softmax that sits next to a matmul."""
    for softmax in attention_like_softmaxes(gm.graph):
        site = Site("handwritten", softmax.name, user_code(softmax))
        try:
            chain = _match(softmax, prover)
        except _Skip as e:
            site.reason = str(e)
        else:
            _replace(gm, chain, site)
            report.guards.extend(g for g in (chain.proof.guards if chain.proof else ())
                                 if g not in report.guards)
        report.add(site)


# ---------------------------------------------------------------------------- matching
def _match(softmax, prover):
    chain = _Chain()
    scores = _match_softmax(softmax, chain)
    _match_probabilities_to_output(softmax, chain)
    qk = _match_scores(scores, chain, prover)
    _match_operands(qk, chain, prover)
    _check_operands(chain)
    if chain.mask is not None and (chain.q_perm or chain.k_perm or chain.v_perm or chain.out_perm):
        raise _Skip(f"the mask is {chain.mask[2]}, and the einsum layouts would need it permuted")
    return chain


def _match_softmax(softmax, chain):
    if softmax.target is torch.nn.functional.softmax:  # F.softmax(input, dim, _stacklevel, dtype)
        x, dim, dtype = softmax.args[0], arg(softmax, 1, "dim"), arg(softmax, 3, "dtype")
    else:  # torch.softmax(x, dim, dtype), torch.special.softmax, x.softmax(dim, dtype)
        x, dim, dtype = softmax.args[0], arg(softmax, 1, "dim"), arg(softmax, 2, "dtype")
    value = example_tensor(x)
    if value is None:
        raise _Skip(f"the softmax input {describe(x)} has no recorded tensor value")
    if dim_index(dim, value.dim()) != value.dim() - 1:
        raise _Skip(f"softmax over dim {dim}, not over the keys (the last dim)")
    if dtype is not None and dtype not in (torch.float32, torch.float64):
        raise _Skip(f"softmax computes in {dtype}; the op accumulates in float32 or wider")
    chain.nodes.append(softmax)
    return x


def _match_probabilities_to_output(softmax, chain):
    """softmax -> [casts] -> [dropout] -> [casts] -> matmul(P, v)."""
    node = softmax
    while True:
        user = _single_user(node, "attention probabilities")
        if is_op(user, "cast") and user.args[0] is node:
            pass
        elif is_op(user, "dropout") and user.args[0] is node and not chain.dropout_p:
            chain.dropout_p = _dropout_probability(user, softmax.args[0])
        elif is_op(user, "matmul") and len(user.args) == 2 and user.args[0] is node:
            chain.output, chain.v = user, user.args[1]
            return
        elif is_op(user, "einsum"):
            _match_output_einsum(user, node, chain)
            return
        else:
            raise _Skip(f"the probabilities go to {describe(user)}, not to a matmul with the values")
        chain.nodes.append(user)
        node = user


def _dropout_probability(node, scores):
    """The probability of a dropout of the attention probabilities (0.0 when inactive), which
    the op draws itself (nodes.dropout_problem says when it cannot)."""
    p = arg(node, 1, "p", 0.5)
    training = arg(node, 2, "train" if node.target is torch.dropout else "training", True)
    if training is False or is_zero(p):
        return 0.0
    if arg(node, 3, "inplace", False) is not False:
        raise _Skip("dropout of the probabilities in place")
    problem = dropout_problem(p, training)
    if problem is not None:
        raise _Skip(problem)
    return p


def _match_scores(x, chain, prover):
    """Walk up from the softmax input to the q @ k^T matmul, collecting scales and the mask."""
    node, masked = x, False
    scales_after_mask = []  # met before the mask on the way up: applied after it
    factors_above_mask = 0  # how many of chain.factors were met before the mask
    while True:
        _single_user(node, "attention scores")
        factor = _scale_factor(node, prover)
        if is_op(node, "cast") and _keeps_softmax_precision(node):
            node_next = node.args[0]
        elif factor is not None:
            operand, value, divides, constant_nodes = factor
            if not masked:
                scales_after_mask.append((node, value))
            chain.factors.append((value, divides))
            chain.nodes.extend(constant_nodes)
            node_next = operand
        elif not masked and is_op(node, "masked_fill", "add", "where"):
            if chain.softcap:
                raise _Skip(f"{describe(node)} masks the scores before they are soft-capped: "
                            f"the op caps first, then masks")
            node_next = _match_mask(node, chain, prover, scaled_after=bool(scales_after_mask))
            masked = True
            factors_above_mask = len(chain.factors)
            _check_positive(scales_after_mask)
        elif is_op(node, "tanh") and not chain.softcap:
            _take_softcap(node, chain, factors_above_mask if masked else 0,
                          scales_after_mask if masked else [])
            scales_after_mask = []      # the cap's factors: none scales the mask
            node_next = node.args[0]
        elif is_op(node, "matmul") and len(node.args) == 2 or is_op(node, "einsum"):
            chain.nodes.append(node)
            return node
        elif is_op(node, "baddbmm"):
            if _match_baddbmm(node, chain, prover, masked):
                _check_positive(scales_after_mask)
            chain.nodes.append(node)
            return node
        else:
            raise _Skip(f"the softmax input comes from {describe(node)}, "
                        f"not from q @ k^T with scales and a causal mask")
        chain.nodes.append(node)
        node = node_next


def _take_softcap(tanh, chain, first, scales_after_mask):
    """The factors met since `first` (on the way up: between the tanh and the softmax or
    the mask) are the cap c of c * tanh(u / c); they leave chain.factors, and c becomes one
    more factor of the scale (u / c = the factors under the tanh times q kᵀ)."""
    if scales_after_mask:
        raise _Skip(f"the soft-capped scores are scaled after the mask "
                    f"({describe(scales_after_mask[0][0])})")
    outer = chain.factors[first:]
    if not all(is_number(value) for value, _ in outer):
        raise _Skip(f"{describe(tanh)} is multiplied by a factor computed in the graph; the "
                    f"op takes a constant soft-cap c (c * tanh(scores / c))")
    cap = 1.0       # (a bare tanh is the cap c = 1)
    for value, divides in outer:
        cap = cap / value if divides else cap * value
    if not cap > 0:
        raise _Skip(f"{describe(tanh)} is multiplied by {cap:g}: a soft-cap must be positive")
    del chain.factors[first:]
    chain.softcap = cap
    chain.factors.append((cap, False))
    chain.nodes.append(tanh)


def _check_positive(scales_after_mask):
    for scale_node, value in scales_after_mask:  # -inf * c must stay -inf
        if not is_positive(value):
            raise _Skip(f"{describe(scale_node)} scales the masked scores by "
                        f"{describe(value)}, which is not positive")


def _match_mask(node, chain, prover, scaled_after):
    """The scores operand of a masking node, after proving its mask causal, or else taking
    it as a general mask (chain.mask)."""
    if is_op(node, "masked_fill"):
        scores, mask, fill, kind = node.args[0], arg(node, 1, "mask"), arg(node, 2, "value"), "masked"
    elif is_op(node, "add"):
        if node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
            raise _Skip(f"{describe(node)} is not scores + mask")
        scores, mask = _scores_and_other(node, node.args[0], node.args[1])
        fill, kind = None, "additive"
    else:
        condition, a, b = (list(node.args) + [None, None, None])[:3]
        if _reaches_matmul(a):
            scores, fill, kind = a, b, "visible"
        elif _reaches_matmul(b):
            scores, fill, kind = b, a, "masked"
        else:
            raise _Skip(f"{describe(node)}: neither branch of the where() is the scores")
        mask = condition
    scores_value, out_value = example_tensor(scores), example_tensor(node)
    if scores_value is None or out_value is None or not same_sizes(scores_value.shape, out_value.shape) \
            or scores_value.dtype != out_value.dtype:
        raise _Skip(f"{describe(node)} changes the scores' shape or dtype (broadcasting mask)")
    try:
        if fill is not None:
            prover.masking_value(fill)
            if isinstance(fill, torch.fx.Node):
                chain.nodes.append(fill)
    except NotProven as e:
        raise _Skip(f"the mask is not provably causal: {e}") from None
    try:
        chain.proof = prover.prove(mask, kind, scores_value.shape[-2:])
    except NotProven as e:
        chain.mask = _general_mask(mask, kind, scaled_after, f"not causal: {e}")
        return scores
    chain.nodes.extend(chain.proof.nodes)
    return scores


def _general_mask(mask, kind, scaled_after, why):
    """(mask node, whether it must be negated, report text) for a mask passed on as
    attn_mask, or _Skip with the reason it cannot be."""
    problem = mask_problem(mask, bool_ok=kind != "additive", floating_ok=kind == "additive")
    if problem:
        raise _Skip(f"the mask {problem} ({why})")
    if kind == "additive" and scaled_after:
        raise _Skip(f"the additive mask {describe(mask)} is scaled with the scores after "
                    f"it is added ({why})")
    # masked_fill(m, fill) and where(m, fill, scores) hide where m is True: attn_mask = ~m
    return mask, kind == "masked", f"{kind} {describe(mask)} ({why})"


def _scores_and_other(node, a, b):
    if _reaches_matmul(a) and not _reaches_matmul(b):
        return a, b
    if _reaches_matmul(b) and not _reaches_matmul(a):
        return b, a
    raise _Skip(f"{describe(node)}: cannot tell the scores from the mask")


def _match_output_einsum(node, probs, chain):
    operands = _einsum_operands(node)
    if len(operands) != 2 or probs not in operands:
        raise _Skip(f"the probabilities go to {describe(node)}, not to a product with the values")
    probs_first = operands[0] is probs
    v = operands[1] if probs_first else operands[0]
    p_value, v_value = example_tensor(probs), example_tensor(v)
    if p_value is None or v_value is None:
        raise _Skip(f"{describe(node)} has operands without recorded tensor values")
    try:
        chain.v_perm, chain.out_perm = einsum.output_layout(
            node.args[0], p_value.dim(), v_value.dim(), probs_first)
    except einsum.NotAttention as e:
        raise _Skip(str(e)) from None
    chain.output, chain.v = node, v


def _einsum_operands(node):
    """The operand nodes of einsum(equation, a, b) or einsum(equation, [a, b])."""
    operands = node.args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = operands[0]
    return list(operands)


def _match_baddbmm(node, chain, prover, masked):
    """baddbmm(input, q, kᵀ, beta=β, alpha=α) = β·input + α·q kᵀ: β = 0 ignores input (even
    NaN in it, as torch documents); β = 1 with masked=False adds a causal mask. Returns
    whether it did."""
    beta, alpha = arg(node, None, "beta", 1), arg(node, None, "alpha", 1)
    if not (is_number(alpha) or is_symbolic_number(alpha)):
        raise _Skip(f"{describe(node)} has alpha={describe(alpha)}, not a number")
    if is_zero(beta):
        chain.nodes.append(node.args[0])  # the ignored buffer: erased if nothing else reads it
    else:
        if masked or beta != 1:
            raise _Skip(f"{describe(node)} adds beta={describe(beta)} times its input to the "
                        f"scores: a bias, not a causal mask")
        try:
            chain.proof = prover.prove(node.args[0], "additive", example_tensor(node).shape[-2:])
        except NotProven as e:
            raise _Skip(f"the mask is not provably causal: {e}") from None
        chain.nodes.extend(chain.proof.nodes)
    if not (is_number(alpha) and alpha == 1):
        chain.factors.append((alpha, False))
    return not is_zero(beta)


def _match_operands(qk, chain, prover):
    """q and k from matmul(q, k^T) (or baddbmm), absorbing scales applied to q or k; or
    from einsum(q, k) in a layout einsum.py accepts."""
    if is_op(qk, "einsum"):
        return _match_einsum_operands(qk, chain, prover)
    q, kt = qk.args[1:3] if is_op(qk, "baddbmm") else qk.args
    q = _absorb_scales(q, chain, prover)
    kt = _absorb_scales(kt, chain, prover)
    k = swaps_last_two_dims(kt)
    if k is not None:
        chain.nodes.append(kt)
        chain.k = _absorb_scales(k, chain, prover)
    else:
        chain.k_transposed = kt
    chain.q = q


def _match_einsum_operands(qk, chain, prover):
    operands = _einsum_operands(qk)
    values = [example_tensor(o) for o in operands]
    if len(operands) != 2 or any(v is None for v in values):
        raise _Skip(f"{describe(qk)} is not an einsum of two recorded tensors")
    try:
        chain.q_perm, chain.k_perm, _ = einsum.scores_layout(qk.args[0], *(v.dim() for v in values))
    except einsum.NotAttention as e:
        raise _Skip(str(e)) from None
    chain.q, chain.k = (_absorb_scales(o, chain, prover) for o in operands)


def _absorb_scales(x, chain, prover):
    while len(getattr(x, "users", ())) == 1:
        factor = _scale_factor(x, prover)
        if factor is None:
            break
        operand, value, divides, constant_nodes = factor
        chain.factors.append((value, divides))
        chain.nodes.extend([x, *constant_nodes])
        x = operand
    return x


def _check_operands(chain):
    # Only shapes and dtypes: inside torch.func transforms the recorded values are
    # functorch-wrapped tensors that no op may touch outside their transform.
    q, v, out = example_tensor(chain.q), example_tensor(chain.v), example_tensor(chain.output)
    kt = example_tensor(chain.k_transposed if chain.k is None else chain.k)
    if any(t is None for t in (q, kt, v, out)):
        raise _Skip("q, k or v has no recorded tensor value")
    q, kt, v = (t if perm is None else t.permute(perm)
                for t, perm in ((q, chain.q_perm), (kt, chain.k_perm), (v, chain.v_perm)))
    if not (q.dim() == kt.dim() == v.dim() >= 2):
        raise _Skip(f"q, k and v have ranks {q.dim()}, {kt.dim()}, {v.dim()} (broadcasting matmul)")
    if _one_shared_kv_head(q, kt, v):
        # multi-query attention written with broadcasting (Falcon): k and v's single head
        # is every query head's, which is the op's enable_gqa with one kv head
        chain.shared_kv_head = True
    elif not (same_sizes(q.shape[:-2], kt.shape[:-2]) and same_sizes(q.shape[:-2], v.shape[:-2])):
        raise _Skip(f"q, k and v have different batch dims {shape_text(chain.q)} "
                    f"{list(kt.shape)} {shape_text(chain.v)} (broadcasting matmul)")
    if not (q.dtype == kt.dtype == v.dtype == out.dtype) or not q.dtype.is_floating_point:
        raise _Skip(f"q, k, v and output dtypes differ ({q.dtype}, {kt.dtype}, {v.dtype}, {out.dtype})")


def _one_shared_kv_head(q, kt, v):
    """q (..., H, L, E), k and v (..., 1, S, *) with equal leading dims and H > 1."""
    return (q.dim() >= 3 and same_sizes(q.shape[:-3], kt.shape[:-3])
            and same_sizes(q.shape[:-3], v.shape[:-3]) and is_one(kt.shape[-3])
            and is_one(v.shape[-3]) and not is_one(q.shape[-3]))


# ---------------------------------------------------------------------------- pieces
def _single_user(node, purpose):
    users = list(node.users)
    if len(users) != 1:
        others = ", ".join(u.name for u in users)
        raise _Skip(f"the {purpose} {node.name} are used {len(users)} times ({others}), "
                    f"not only by the attention")
    return users[0]


def _keeps_softmax_precision(node):
    """A cast before the softmax that the op may drop: to float32 or wider (the op
    accumulates in float32 or wider anyway), like Llama's `F.softmax(scores.float())`."""
    before, after = example_tensor(node.args[0]), example_tensor(node)
    return (before is not None and after is not None and after.dtype.is_floating_point
            and (after.dtype in (torch.float32, torch.float64)
                 or torch.promote_types(before.dtype, after.dtype) == after.dtype))


def _scale_factor(node, prover):
    """(tensor operand, factor, divides, constant nodes) if `node` is tensor * factor,
    factor * tensor or tensor / factor with a scalar factor; else None.

    A factor is a number, a number computed in the graph, or a 0-d tensor built from
    constants, like GPT-2's `torch.full([], value.size(-1) ** 0.5)`: the prover evaluates it;
    with prover=None its value is None (enough to find the scores operand)."""
    if is_op(node, "mul") and len(node.args) == 2:
        candidates = [(node.args[0], node.args[1]), (node.args[1], node.args[0])]
        divides = False
    elif is_op(node, "truediv") and len(node.args) == 2 and node.kwargs.get("rounding_mode") is None:
        candidates, divides = [(node.args[0], node.args[1])], True
    else:
        return None
    for operand, factor in candidates:
        operand_value = example_tensor(operand)
        if operand_value is None or operand_value.dim() < 2:
            continue
        if is_number(factor) or is_symbolic_number(factor):
            return operand, factor, divides, []
        factor_value = example_tensor(factor)
        if factor_value is not None and factor_value.dim() == 0:
            if prover is None:
                return operand, None, divides, [factor]
            try:
                constant = prover.value(factor)
            except NotProven:
                continue
            if hasattr(constant, "value") and is_number(constant.value):
                return operand, float(constant.value), divides, [factor]
    return None


def _reaches_matmul(x, depth=8):
    """Whether x is computed from a matmul through casts, scales and soft-capping (the
    scores side)."""
    for _ in range(depth):
        if not isinstance(x, torch.fx.Node):
            return False
        if is_op(x, "matmul", "einsum", "baddbmm"):
            return True
        factor = _scale_factor(x, None)
        if factor is not None:
            x = factor[0]
        elif is_op(x, "cast", "tanh"):
            x = x.args[0]
        else:
            return False
    return False


# The ops a score may pass through between the product q·kᵀ and the softmax: scales,
# masks, biases, casts, soft-capping (Gemma's tanh), views. Not linear layers or norms: a
# classifier's softmax over logits that an earlier attention fed is not attention.
_SCORE_OPS = ("add", "sub", "mul", "truediv", "neg", "masked_fill", "where", "cast",
              "same_values", "reshape", "unsqueeze", "broadcast_to", "getitem", "dropout")
_SCORE_METHODS = ("tanh", "clamp", "clip", "softcap")
_SCORE_FUNCTIONS = (torch.tanh, torch.clamp, torch.clip)


def attention_like_softmaxes(graph, depth=10):
    """Softmaxes of `graph` over a product of two activations (tensors computed from the
    inputs, not parameters), found within `depth` score ops of the softmax's input."""
    activations = _activations(graph)
    found = []
    for softmax in (n for n in graph.nodes if is_op(n, "softmax")):
        frontier, seen = [softmax.args[0]], set()
        for _ in range(depth):
            frontier = [n for n in frontier if isinstance(n, torch.fx.Node) and n not in seen]
            seen.update(frontier)
            if any(_is_activation_product(n, activations) for n in frontier):
                found.append(softmax)
                break
            frontier = [i for n in frontier if _is_score_op(n) for i in n.all_input_nodes]
    return found


def _is_score_op(node):
    return is_op(node, *_SCORE_OPS) or (node.op == "call_method" and node.target in _SCORE_METHODS) \
        or (node.op == "call_function" and node.target in _SCORE_FUNCTIONS)


def _is_activation_product(node, activations):
    if is_op(node, "matmul"):
        operands = node.args[:2]
    elif is_op(node, "baddbmm"):
        operands = node.args[1:3]
    elif is_op(node, "einsum"):
        operands = _einsum_operands(node)
    else:
        return False
    return len(operands) == 2 and all(o in activations for o in operands)


def _activations(graph):
    """Nodes computed from a graph input that is not a parameter."""
    activations = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if not isinstance(example(node), torch.nn.Parameter):
                activations.add(node)
        elif any(i in activations for i in node.all_input_nodes):
            activations.add(node)
    return activations


# ---------------------------------------------------------------------------- rewriting
def _replace(gm, chain, site):
    graph = gm.graph
    with graph.inserting_before(chain.output):
        k = chain.k
        if k is None:  # no recorded value: inside transforms it could not be computed here
            k = graph.call_method("transpose", (chain.k_transposed, -2, -1))
        q, k, v = (_permuted(graph, x, perm) for x, perm in
                   ((chain.q, chain.q_perm), (k, chain.k_perm), (chain.v, chain.v_perm)))
        scale, scale_text = _scale(graph, chain.factors)
        causal = chain.proof is not None
        kwargs = {"is_causal": causal, "scale": scale, "enable_gqa": chain.shared_kv_head}
        if chain.mask is not None:
            mask, negate, site.mask = chain.mask
            kwargs["attn_mask"] = graph.call_function(torch.logical_not, (mask,)) if negate else mask
        if chain.dropout_p:
            kwargs["dropout_p"] = site.dropout = chain.dropout_p
        if chain.softcap:
            kwargs["softcap"] = site.softcap = chain.softcap
        replacement = graph.call_function(attention, (q, k, v), kwargs)
        result = _permuted(graph, replacement, chain.out_perm)
    replacement.meta = dict(chain.output.meta)
    if result is not replacement:
        replacement.meta.pop("example_value", None)
        result.meta = dict(chain.output.meta)
    chain.output.replace_all_uses_with(result)
    name = chain.output.name
    erase_unused(graph, chain.nodes + [chain.output])
    result.name = name  # the user's variable (y = att @ v): a smaller, readable diff
    site.replaced, site.is_causal, site.scale = True, causal, scale_text
    k_shape = shape_text(chain.k) if chain.k is not None else f"{shape_text(chain.k_transposed)}^T"
    site.shapes = f"q{shape_text(chain.q)} k{k_shape} v{shape_text(chain.v)}"
    if chain.q_perm or chain.k_perm or chain.v_perm or chain.out_perm:
        site.shapes += f" (einsum layouts: q{chain.q_perm or ''} k{chain.k_perm or ''} " \
                       f"v{chain.v_perm or ''} out{chain.out_perm or ''})"
    if chain.proof:
        site.causal_proof = f"mask {chain.proof.how}"


def _permuted(graph, x, perm):
    """x.permute(perm) as a new node (x itself for None), with its recorded value where
    one can be computed (not for functorch-wrapped values inside transforms)."""
    if perm is None:
        return x
    node = graph.call_method("permute", (x, *perm))
    value = example_tensor(x)
    if value is not None and not torch._C._functorch.is_functorch_wrapped_tensor(value):
        node.meta["example_value"] = value.permute(perm)
    return node


def _scale(graph, factors):
    """The product of the factors: a float, or a node computing it if some are symbolic.
    Returns (scale, text for the report)."""
    constant, symbolic = 1.0, []
    for value, divides in factors:
        if is_number(value):
            constant = constant / value if divides else constant * value
        else:
            symbolic.append((value, divides))
    scale, text = constant, f"{constant:.6g}"
    for value, divides in symbolic:
        if scale == 1.0 and not divides:
            scale, text = value, f"{value.name} (computed)"
            continue
        op = operator.truediv if divides else operator.mul
        node = graph.call_function(op, (scale, value))
        node.meta["example_value"] = op(example(scale) if isinstance(scale, torch.fx.Node) else scale,
                                        example(value))
        scale, text = node, f"{text} {'/' if divides else '*'} {value.name} (computed)"
    return scale, text
