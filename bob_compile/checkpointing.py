"""Activation checkpointing under flashbob: checkpointed layers traced, not run eagerly.

Dynamo traces torch.utils.checkpoint into a higher-order op (tag_activation_checkpoint)
whose body the backend rewrites like any graph (passes/subgraphs.py). By default it cannot
trace a body whose forward mutates Python state outside it: eager checkpointing replays
such a mutation when it recomputes the forward, which a traced graph cannot. Dynamo then
runs the whole checkpointed call eagerly, attention included (PyTorch's fused SDPA, which
has no double backward; HF's eager attention, whose softmax is float32). transformers 5
does this to every Llama-family layer: its hub-kernel decorator sets and resets a context
variable around each forward (`kernels`' CompileableContextVar), so with
`gradient_checkpointing_enable()` no attention site of Llama, Mistral, Qwen2, ... reached
the backend, and the second order failed ("derivative for
aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented").

Dynamo's `skip_fwd_side_effects_in_bwd_under_checkpoint` traces such bodies and leaves the
side effect out of the recomputation. The gradients are those of the traced forward either
way (the recomputation replays the traced graph, not the Python code); what differs from
eager is only that Python state the forward changes is not changed a second time during
the backward (here: a context variable set and reset, no net change). flashbob turns it on
when the backend is loaded, and logs that it did; BOB_COMPILE_CHECKPOINT_SIDE_EFFECTS=replay
keeps PyTorch's default.
"""
import logging
import os

import torch

log = logging.getLogger("bob_compile")

VARIABLE = "BOB_COMPILE_CHECKPOINT_SIDE_EFFECTS"
CHOICES = ("skip", "replay")
_CONFIG = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def trace_checkpointed_side_effects():
    """Turn Dynamo's config on unless the environment asks for PyTorch's default (see the
    module docstring). Returns whether it is on."""
    choice = os.environ.get(VARIABLE, "") or "skip"
    if choice not in CHOICES:
        raise ValueError(f"{VARIABLE}={choice!r}: use one of {', '.join(CHOICES)}")
    config = torch._dynamo.config
    if not hasattr(config, _CONFIG):        # a torch without it: checkpointing as it was
        return False
    if choice == "skip" and not getattr(config, _CONFIG):
        setattr(config, _CONFIG, True)
        log.info("bob_compile: torch._dynamo.config.%s = True, so that checkpointed layers "
                 "whose forward sets Python state (transformers' hub kernels) are traced and "
                 "their attention replaced; %s=replay keeps PyTorch's default", _CONFIG,
                 VARIABLE)
    return bool(getattr(config, _CONFIG))
