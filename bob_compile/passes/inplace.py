"""In-place arithmetic on a graph's own temporaries, rewritten out of place.

Hand-written attention often scales or masks its scores in place:

    scores = query @ key.transpose(-1, -2)
    scores /= math.sqrt(head_dim)                  # Falcon (transformers' eager attention)
    scores.masked_fill_(mask == 0, float("-inf"))  # many tutorials; the result is discarded

Dynamo records these as operator.itruediv / call_method "masked_fill_" writing the matmul's
result, so the softmax's input is the matmul node itself, with the write beside it, and
the attention patterns (which never look through a write) leave such sites untouched.

Where the written tensor is a temporary of the graph that nothing else aliases (no view of
it, not a graph input or attribute), `x.op_(y)` at position t equals `x' = x.op(y)` with
every later reader of x reading x' instead: the readers before t saw the old value, and
no other name can observe the write. That is what this pass rewrites, before the attention
passes run; any other in-place op on the same memory, or a view of it, leaves the whole
group as written.
"""
import operator

from torch import fx

from .nodes import example_tensor, storage_key

# call_function targets and call_method names with their out-of-place spellings
_FUNCTIONS = {operator.iadd: operator.add, operator.isub: operator.sub,
              operator.imul: operator.mul, operator.itruediv: operator.truediv}
_METHODS = {"add_": "add", "sub_": "sub", "mul_": "mul", "div_": "div",
            "masked_fill_": "masked_fill", "__iadd__": "__add__", "__isub__": "__sub__",
            "__imul__": "__mul__", "__itruediv__": "__truediv__"}


def _out_of_place(node):
    """The out-of-place target of an in-place op this pass rewrites, else None."""
    if node.op == "call_function" and node.target in _FUNCTIONS:
        return _FUNCTIONS[node.target]
    if node.op == "call_method" and node.target in _METHODS:
        return _METHODS[node.target]
    return None


def _writes_in_group(node, group):
    return _out_of_place(node) is not None and bool(node.args) and node.args[0] in group


def _private_groups(graph):
    """Storage groups (nodes sharing one tensor's memory) made of a temporary and in-place
    ops of the kinds above on it, and nothing else."""
    groups = {}
    for node in graph.nodes:
        key = storage_key(node)
        if key is None and example_tensor(node) is not None:
            return []       # a tensor whose memory cannot be read could alias any group
        if key is not None:
            groups.setdefault(key, []).append(node)
    private = []
    for members in groups.values():
        root, rest = members[0], members[1:]
        if not rest or root.op not in ("call_function", "call_method"):
            continue
        if _out_of_place(root) is not None:
            continue
        group = {root}
        for node in rest:
            if not _writes_in_group(node, group):
                break
            group.add(node)
        else:
            private.append(members)
    return private


def functionalize_temporaries(gm: fx.GraphModule):
    """Rewrite in place (on the graph) the in-place arithmetic on private temporaries as
    out-of-place ops; returns how many were rewritten."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    rewritten = 0
    for members in _private_groups(gm.graph):
        for node in members[1:]:
            written = node.args[0]
            for user in list(written.users):
                if user is not node and order[user] > order[node]:
                    user.replace_input_with(written, node)
            node.target = _out_of_place(node)
            rewritten += 1
    return rewritten
