"""Erase the nodes a rewrite made dead, and nothing else.

Never graph-wide dead-code elimination: Dynamo graphs hold calls that matter only for
their side effects and have no users (functorch's `_grad_increment_nesting`,
`_set_tensor_requires_grad`, saved-tensor hooks, ...); `graph.eliminate_dead_code()`
deletes them and breaks torch.func inside compiled code (docs/torch-behaviour.md).
"""


def erase_unused(graph, nodes):
    """Erase those of `nodes` left without users, then those of their inputs in `nodes`
    that this leaves without users, and so on. Placeholders and outputs are kept."""
    pending = {n for n in nodes if n.op not in ("placeholder", "output")}
    progress = True
    while progress:
        progress = False
        for node in [n for n in pending if not n.users]:
            graph.erase_node(node)
            pending.discard(node)
            progress = True
