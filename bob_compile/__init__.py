"""bob_compile: exact, fused second-order softmax attention for torch.compile.

    torch.compile(model, backend="flashbob")     # found through the package's entry point
    bob_compile.attention(q, k, v, is_causal=True)
    bob_compile.flex_attention(q, k, v, score_mod=..., block_mask=...)   # FlexAttention's call

Importing this package registers the custom ops (namespace `bob_compile`) but never the
backend name: torch discovers "flashbob" through the `torch_dynamo_backends` entry point,
and registering it twice would fail the first compile. `register()` is for source
checkouts without installed metadata.
"""
from . import ops  # noqa: F401  (registers torch.ops.bob_compile.*)
from .attention import attention
from .backend import counters, flashbob, register
from .flex import flex_attention
from . import torch_context_parallel

torch_context_parallel.install()    # flashbob under PyTorch's context_parallel (inert elsewhere)

__all__ = ["attention", "counters", "flashbob", "flex_attention", "register"]
