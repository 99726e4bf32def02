"""Recorded Triton stages as the C++ node replays them: programs (native_node.cpp;
why: docs/host-overhead.md).

A Triton stage (a masked call's forward with the mask's summary and its first backward; any
call's folded BoB) is recorded once per call signature (bob_compile/kernels/launching.py
`recording`): each launch with its runtime arguments and the compiled kernel it went
through. The node replays the same compiled kernels, grids and launch configs with the
tensors of a later call, so each tensor argument must be named by its role in the call: a
*slot*. Every runtime argument becomes a slot's address or one of its strides, or a
constant of the call's signature (lengths, head counts, the scale), with how Triton
specialized it when it compiled the kernel (launching.py, "Launching"), which the node
checks on every replay.

A stage also makes tensors: its outputs and scratch. `recorded_stage` watches the stage's
ATen ops with a dispatch mode: each fresh allocation (`empty`, `empty_like`,
`empty_strided`) and each view of a tensor already known becomes a slot after the inputs,
described by sizes, strides and dtype (a view: by its base slot and storage offset), which
the node makes again for a later call of the same signature. Any other op (a copy, a fill,
a sum: work the node would not redo) means the stage cannot be replayed.
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..kernels import launching

aten = torch.ops.aten

# ATen ops that make a fresh tensor whose contents the stage's kernels write
_ALLOCATIONS = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
                aten.new_empty.default, aten.new_empty_strided.default}
# ATen ops that make a view of their first argument
_VIEWS = {aten.expand.default, aten.as_strided.default, aten.view.default,
          aten._unsafe_view.default, aten.permute.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.slice.Tensor,
          aten.select.int, aten.t.default, aten.transpose.int, aten.alias.default,
          aten.detach.default}


def launch_arguments(module, record, slot_of):
    """The recorded launches as the node takes them (native_node.cpp parse_launches), with
    slot_of mapping id(tensor) to its slot; None where one cannot be replayed: a launch not
    through a DirectLaunch or by a provisional launch config, a cluster or cooperative launch,
    or an argument that is none of the slots' tensors."""
    if not replays_complete(record):
        return None
    kind = {name: i for i, name in enumerate(module.ARG_KINDS)}
    launches = []
    for kernel, grid, args, direct, _ in record.launches:
        if direct.cooperative or direct.pdl:
            return None
        num_warps, num_ctas, shared_bytes = direct.metadata
        if num_ctas != 1:
            return None
        signature = direct.compiled.src.signature
        names, stride_owners = launching.runtime_parameters(kernel)
        by_name = dict(zip(names, args))
        plan_args = []
        for name, value in zip(names, args):
            ty = signature[name]
            if name in stride_owners:
                tensor_name, dim = stride_owners[name]
                slot = slot_of.get(id(by_name[tensor_name]))
                if slot is None:
                    return None
                if ty == "constexpr":           # a stride of 1, compiled in
                    plan_args.append((kind["stride_one"], slot, dim, 0, 0, 0, 0, 0.0))
                else:
                    plan_args.append((kind["stride"], slot, dim, int(value % 16 == 0),
                                      int(ty == "i64"), 0, 0, 0.0))
            elif isinstance(value, torch.Tensor):
                slot = slot_of.get(id(value))
                if slot is None:
                    return None
                plan_args.append((kind["pointer"], slot, 0, int(value.data_ptr() % 16 == 0), 0,
                                  module.scalar_type_code(value), 0, 0.0))
            elif ty == "constexpr":             # an int of 1 or None, compiled in
                continue
            elif ty in ("i32", "i64") and type(value) is int:
                plan_args.append((kind["int32" if ty == "i32" else "int64"], 0, 0, 0, 0, 0, value,
                                  0.0))
            elif ty == "fp32" and type(value) is float:
                plan_args.append((kind["float32"], 0, 0, 0, 0, 0, 0, value))
            else:
                return None
        launches.append((direct.function, grid[0], grid[1], 32 * num_warps, shared_bytes,
                         plan_args))
    return launches or None


def replays_complete(record):
    """Whether every recorded launch took the path a replay can take (a DirectLaunch of a
    remembered launch config): if not (a first compile, tuning), a later run may."""
    return all(direct is not None and kept for _, _, _, direct, kept in record.launches)


class _MadeTensors(TorchDispatchMode):
    """Logs the tensors a stage makes (see the module docstring); `refused`: the first op
    that is neither an allocation nor a view."""

    def __init__(self):
        super().__init__()
        self.made = []          # (tensor, the tensor it is a view of, or None)
        self.refused = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.made.append((out, None))
        elif func in _VIEWS:
            self.made.append((out, args[0]))
        elif self.refused is None:
            self.refused = func
        return out


class recorded_stage:
    """Context manager: records a stage's launches and the tensors it makes; `program(...)`
    afterwards describes it for the node."""

    def __enter__(self):
        self._recording = launching.recording()
        self.record = self._recording.__enter__()
        self.made = _MadeTensors()
        self.made.__enter__()
        return self

    def __exit__(self, *exc):
        self.made.__exit__(*exc)
        self._recording.__exit__(*exc)

    def program(self, module, inputs, outputs):
        """(made, launches, outputs) as native_node.cpp register_program takes them, or None
        where the stage cannot be replayed. inputs: the stage's input tensors (None where
        absent), in slot order; outputs: (tensor, index of the input it is laid out like, or
        None) per output, before that layout."""
        if self.made.refused is not None:
            return None
        slot_of = {}
        for slot, tensor in enumerate(inputs):
            if tensor is not None:
                if id(tensor) in slot_of:       # one tensor in two roles: ambiguous later
                    return None
                slot_of[id(tensor)] = slot
        made, tensors = [], list(inputs)
        for tensor, base in self.made.made:
            if id(tensor) in slot_of:
                continue
            if base is None:
                spec = (-1, list(tensor.shape), list(tensor.stride()), 0,
                        module.scalar_type_code(tensor))
            else:
                base_slot = slot_of.get(id(base))
                if base_slot is None or \
                        tensor.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
                    return None
                if (tensor.shape, tensor.stride(), tensor.storage_offset()) == \
                        (base.shape, base.stride(), base.storage_offset()):
                    slot_of[id(tensor)] = base_slot     # the same geometry (detach, alias)
                    continue
                spec = (base_slot, list(tensor.shape), list(tensor.stride()),
                        tensor.storage_offset() - base.storage_offset(), 0)
            slot_of[id(tensor)] = len(tensors)
            tensors.append(tensor)
            made.append(spec)
        launches = launch_arguments(module, self.record, slot_of)
        if launches is None:
            return None
        placed = []
        for tensor, like in outputs:
            slot = slot_of.get(id(tensor))
            if slot is None:
                return None
            placed.append((slot, -1 if like is None else like))
        return made, launches, placed
