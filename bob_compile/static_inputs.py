"""Which graph inputs CUDA graphs may treat as fixed in memory (static), under
`mode="reduce-overhead"` or any mode that turns inductor's CUDA graphs on.

Dynamo marks every tensor it reads from a module's `_parameters` or `_buffers` slot as a
static input (`_dynamo_static_input_type` in the placeholder's `tensor_dict`, "unguarded":
without a guard on its identity). CUDA graph trees then record the graph with that
tensor's address baked in, and when a later call brings another tensor in that slot they
re-record the whole graph: by design, and without counting it against the re-record limit.

`torch.func.functional_call` puts plain tensors into the parameter slots, and in MAML
they are new every call: the fast weights `w - lr * grad` of the inner step. Each call then
re-records every graph that reads them (measured on the H200: 496 re-recordings per MAML
meta-gradient at T=128 with 32 tasks, 1.9 s instead of 0.2 s per meta-gradient at T=256
with 8; docs/measurements.md). A tensor in a parameter slot that is not an
`nn.Parameter` is such a stand-in: we drop its static mark, so CUDA graph trees copy it
into the graph's own input buffer on each call (one device copy of the fast weights)
and replay. Real parameters and buffers keep their mark (fixed addresses, and buffers
that the graph mutates, like BatchNorm's running statistics, need it to stay in the graph).
"""
import logging

import torch

log = logging.getLogger(__name__)

_MARK = "_dynamo_static_input_type"


def uses_cuda_graphs(inductor_config):
    """Whether these inductor config patches (a torch.compile mode's) turn CUDA graphs on."""
    return bool(dict(inductor_config).get("triton.cudagraphs", False))


def unmark_parameter_stand_ins(gm, example_inputs):
    """Drop the static mark of inputs that sit in a module's parameter slot but are not
    nn.Parameters (see the module docstring). Returns the names of the inputs unmarked."""
    unmarked = []
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        tensor_dict = node.meta.get("tensor_dict")
        if not tensor_dict or not tensor_dict.get(_MARK):
            continue
        source = getattr(node, "_dynamo_source", None)
        in_parameter_slot = source is not None and "._parameters[" in source.name
        if in_parameter_slot and isinstance(value, torch.Tensor) \
                and not isinstance(value, torch.nn.Parameter):
            node.meta["tensor_dict"] = {k: v for k, v in tensor_dict.items() if k != _MARK}
            unmarked.append(node.name)
    if unmarked:
        log.debug("CUDA graphs: %d tensor(s) standing in for parameters (functional_call) "
                  "are copied in per call instead of re-recording: %s", len(unmarked),
                  ", ".join(unmarked))
    return unmarked
