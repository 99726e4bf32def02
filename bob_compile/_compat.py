"""Everything that differs between the torch versions we support (2.11 to 2.14).

Keep it here, small and explicit, so that a new torch release means reading one file.
Differences found so far (docs/torch-behaviour.md lists them with the rest):
- Dynamo records Python comparison operators on tensors as `call_method "__eq__"` on 2.11
  and as `call_function operator.eq` on 2.13 (arithmetic operators are `operator.*` on
  both; the dunder method spellings are accepted for them too, in case a version flips).
- `aot_module_simplified` grew keyword arguments on 2.13 that 2.11 lacks: we only use the
  common ones, through `torch._dynamo.backends.common.aot_autograd` or registered backends.
- AOTAutograd's OutputAliasInfo says which outputs get a tangent in `requires_grad_for_backward`
  on 2.13; 2.11 has only `requires_grad` (the same except for views made under no_grad).
  Optional metadata fields (RNG states, opaque objects) are read with defaults.
- Dynamo records the tensor attributes `.T` and `.mT` as `getattr` on 2.11-2.13 and as
  calls of `aten.numpy_T` / `aten.mT` on 2.14.
- `F.scaled_dot_product_attention` accepts `attn_mask` with `is_causal=True` up to 2.13 (the
  fused kernels combine them, the math path refuses); 2.14 refuses the pair everywhere.
- `torch.autograd.Function.apply` binds the call's arguments to `forward`'s signature in
  Python up to 2.13, and in C (`_C._FunctionBase.apply`) on 2.14.
"""
import functools
import inspect

import torch

# call_method names under which Dynamo may record `a <op> b` for tensors, by operator name.
# 2.11 records comparisons this way ("__eq__"); the others are listed defensively.
OPERATOR_METHOD_SPELLINGS = {
    "eq": ("eq", "__eq__"),
    "ne": ("ne", "__ne__"),
    "lt": ("lt", "__lt__"),
    "le": ("le", "__le__"),
    "gt": ("gt", "__gt__"),
    "ge": ("ge", "__ge__"),
    "add": ("add", "__add__", "__radd__"),
    "sub": ("sub", "__sub__"),
    "rsub": ("__rsub__",),
    "mul": ("mul", "__mul__", "__rmul__"),
    "truediv": ("div", "divide", "true_divide", "__truediv__"),
    "matmul": ("matmul", "__matmul__"),
    "neg": ("neg", "__neg__"),
    "invert": ("bitwise_not", "__invert__"),
    "and_": ("bitwise_and", "__and__"),
    "or_": ("bitwise_or", "__or__"),
}


def _aten_calls(name):
    packet = getattr(torch.ops.aten, name, None)
    return () if packet is None else (packet, packet.default)


# call_function targets under which Dynamo may record a tensor attribute, by attribute.
ATTRIBUTE_CALLS = {"T": _aten_calls("numpy_T"), "mT": _aten_calls("mT")}


@functools.cache
def sdpa_takes_mask_with_is_causal():
    """Whether this torch's SDPA takes attn_mask with is_causal=True (see above); asked once."""
    q = torch.zeros(1, 1, 2, 1)
    try:
        torch.nn.functional.scaled_dot_product_attention(
            q, q, q, attn_mask=torch.ones(2, 2, dtype=torch.bool), is_causal=True)
    except RuntimeError:
        return False
    return True


# Whether Function.apply's C part binds the signature itself (see the module docstring).
FUNCTION_APPLY_BINDS_IN_C = (torch.autograd.Function.__dict__.get("apply")
                             is torch._C._FunctionBase.__dict__["apply"])


def current_compile_id():
    """Dynamo's id of the frame being compiled ("0/0", "1/2", ...), or None outside Dynamo."""
    try:
        from torch._guards import CompileContext
        compile_id = CompileContext.current_compile_id()
    except (ImportError, AttributeError, RuntimeError):
        return None
    return None if compile_id is None else str(compile_id)


def trace_artifact(name, text):
    """Emit `text` as a string artifact of the structured trace (TORCH_TRACE, tlparse)."""
    from torch._logging import trace_structured
    trace_structured("artifact",
                     metadata_fn=lambda: {"name": name, "encoding": "string"},
                     payload_fn=lambda: text)


def inductor_mode_options(mode):
    """Inductor config patches for a torch.compile `mode`, or ValueError listing the modes."""
    from torch._inductor import list_mode_options
    modes = list_mode_options()
    if mode not in modes:
        raise ValueError(f"flashbob: unknown mode={mode!r}; torch.compile modes on torch "
                         f"{torch.__version__} are {sorted(modes)}")
    return dict(list_mode_options(mode))


def ignoring_shape_env(compile_function, ignore):
    """The keyword that tells compile_fx / aot_module_simplified to trace static shapes
    although the tracing context's fake mode has a shape environment ({} where not asked,
    or where this torch's function has no such argument)."""
    if not ignore or "ignore_shape_env" not in inspect.signature(compile_function).parameters:
        return {}
    return {"ignore_shape_env": True}


def compile_with_inductor(gm, example_inputs, config_patches):
    """Stock inductor (AOTAutograd inside) on a Dynamo graph."""
    from torch._inductor.compile_fx import compile_fx
    return compile_fx(gm, example_inputs, config_patches=config_patches or None)


def compile_with_aot_eager(gm, example_inputs):
    """AOTAutograd with no code generation: the traced graphs run as they are."""
    return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


def effect_tokens(meta):
    """(forward, backward) effect tokens AOTAutograd threads through a pair's graphs for
    ops with side effects (aten._linalg_check_errors, in linalg.solve): the forward takes
    its tokens first and returns them first; the backward takes its own last and returns
    them last (AOTAutograd's runtime wrappers pass None for each, torch 2.11-2.14)."""
    return len(getattr(meta, "tokens", None) or ()), getattr(meta, "num_backward_tokens", 0) or 0


def output_gets_tangent(info):
    """Whether AOTAutograd traced a tangent for this output (OutputAliasInfo)."""
    from torch._functorch._aot_autograd.schemas import OutputType
    flag = getattr(info, "requires_grad_for_backward", None)
    if flag is not None:
        return flag
    return info.requires_grad and issubclass(info.raw_type, torch.Tensor) and info.output_type in (
        OutputType.non_alias, OutputType.unsafe_view_alias, OutputType.custom_function_view)


def saved_tensor_hooks_active():
    """Whether saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks: save_on_cpu,
    non-reentrant checkpointing) would see what a Function saves now. Private API; where it
    is missing, answer yes, so that the caller keeps save_for_backward's behaviour."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True
    try:
        return top(False) is not None
    except TypeError:           # an older signature without ignore_is_tracing
        return top() is not None
