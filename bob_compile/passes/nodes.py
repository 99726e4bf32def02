"""How Dynamo spells the operations the passes look for, and small queries on FX nodes.

One operation reaches a Dynamo graph under several spellings: `q @ k` is `operator.matmul`,
`torch.matmul(q, k)` is `torch.matmul`, `q.matmul(k)` is `call_method "matmul"`, and torch
2.11 records `mask == 0` as `call_method "__eq__"` where 2.13 records `operator.eq`
(bob_compile/_compat.py). `is_op(node, "matmul")` accepts them all.
"""
import inspect
import math
import operator

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

from .._compat import ATTRIBUTE_CALLS, OPERATOR_METHOD_SPELLINGS

# call_function targets, by operation name.
_FUNCTIONS = {
    "eq": (operator.eq, torch.eq),
    "ne": (operator.ne, torch.ne),
    "lt": (operator.lt, torch.lt),
    "le": (operator.le, torch.le),
    "gt": (operator.gt, torch.gt),
    "ge": (operator.ge, torch.ge),
    "add": (operator.add, torch.add),
    "sub": (operator.sub, torch.sub),
    "rsub": (torch.rsub,),
    "mul": (operator.mul, torch.mul),
    "truediv": (operator.truediv, torch.div, torch.true_divide),
    "matmul": (operator.matmul, torch.matmul, torch.bmm),
    "einsum": (torch.einsum, torch.functional.einsum),
    "baddbmm": (torch.baddbmm,),
    "neg": (operator.neg, torch.neg),
    "invert": (operator.invert, torch.bitwise_not),
    "and_": (operator.and_, torch.bitwise_and),
    "or_": (operator.or_, torch.bitwise_or),
    "logical_not": (torch.logical_not,),
    "logical_and": (torch.logical_and,),
    "logical_or": (torch.logical_or,),
    "softmax": (F.softmax, torch.softmax, torch.special.softmax),
    "tanh": (torch.tanh, F.tanh),
    "dropout": (F.dropout, torch.dropout),
    "masked_fill": (torch.masked_fill,),
    "where": (torch.where,),
    "tril": (torch.tril,),
    "triu": (torch.triu,),
    "transpose": (torch.transpose, torch.swapaxes, torch.swapdims),
    "permute": (torch.permute,),
    "arange": (torch.arange,),
    "full": (torch.full,),
    "ones": (torch.ones,),
    "zeros": (torch.zeros,),
    "full_like": (torch.full_like,),
    "ones_like": (torch.ones_like,),
    "zeros_like": (torch.zeros_like,),
    "scalar_tensor": (torch.tensor, torch.scalar_tensor),
    "reshape": (torch.reshape,),
    "unsqueeze": (torch.unsqueeze,),
    "broadcast_to": (torch.broadcast_to,),
    "getitem": (operator.getitem,),
    "getattr": (getattr,),
}

# call_method names, by operation name (operators add their dunder spellings from _compat).
_METHODS = {
    **OPERATOR_METHOD_SPELLINGS,
    "matmul": (*OPERATOR_METHOD_SPELLINGS["matmul"], "bmm"),
    "baddbmm": ("baddbmm",),
    "logical_not": ("logical_not",),
    "logical_and": ("logical_and",),
    "logical_or": ("logical_or",),
    "softmax": ("softmax",),
    "tanh": ("tanh",),
    "masked_fill": ("masked_fill",),
    "where": ("where",),
    "tril": ("tril",),
    "triu": ("triu",),
    "transpose": ("transpose", "swapaxes", "swapdims"),
    "permute": ("permute",),
    "new_full": ("new_full",),
    "new_ones": ("new_ones",),
    "new_zeros": ("new_zeros",),
    "reshape": ("view", "reshape"),
    "unsqueeze": ("unsqueeze",),
    "broadcast_to": ("expand", "expand_as", "broadcast_to"),
    "same_values": ("contiguous", "clone", "detach"),
    "cast": ("to", "type", "type_as", "float", "double", "half", "bfloat16", "bool", "int", "long"),
}


def is_op(node, *names):
    """Whether `node` is a call of one of the named operations, in any spelling."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return any(node.target in _FUNCTIONS.get(name, ()) for name in names)
    if node.op == "call_method":
        return any(node.target in _METHODS.get(name, ()) for name in names)
    return False


def arg(node, position, name, default=None):
    """Argument `name` of a call, given positionally at `position` (counting self for
    methods, i.e. the same position as in the function form) or by keyword."""
    if position is not None and len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def example(node):
    """The value Dynamo recorded for a node (a FakeTensor or SymInt/SymFloat), or None."""
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def example_tensor(node):
    value = example(node)
    return value if isinstance(value, torch.Tensor) else None


def is_number(x):
    """A Python int or float constant (bool excluded: it is never a scale)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_symbolic_number(x):
    """A graph node computing a Python number (SymInt/SymFloat), e.g. 1 / sqrt(head_dim)
    under dynamic shapes."""
    return isinstance(x, fx.Node) and isinstance(
        example(x), (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(example(x), bool)


def dropout_problem(p, training):
    """Why an attention dropout of probability p cannot go to bob_compile.attention (the op
    draws it itself, with SDPA's semantics), or None: p must be a constant and training a
    Python bool."""
    if not isinstance(training, bool):
        return f"dropout with training={describe(training)} computed at run time"
    if not is_number(p):
        return f"dropout_p={describe(p)} is computed at run time"
    return None


def is_zero(x):
    """Whether x is 0: a constant, or a number computed in the graph. For the latter, Dynamo
    has a hint; relying on it adds a guard (x == 0) to the compiled frame, so that Dynamo
    recompiles if x changes (e.g. nn.Dropout's p, unspecialised after a recompile)."""
    if is_number(x):
        return x == 0
    if is_symbolic_number(x):
        value = example(x)
        return value == 0 if isinstance(value, (int, float)) else guard_or_false(value == 0)
    return False


def is_positive(x):
    """Whether x > 0, like is_zero (a guard for numbers computed in the graph)."""
    if is_number(x):
        return x > 0
    if is_symbolic_number(x):
        value = example(x)
        return value > 0 if isinstance(value, (int, float)) else guard_or_false(value > 0)
    return False


def same_size(a, b):
    """Whether two sizes (ints or SymInts) are equal for every shape this graph accepts."""
    return a is b or statically_known_true(a == b)


def same_sizes(a, b):
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def is_one(size):
    return statically_known_true(size == 1)


def dim_index(dim, ndim):
    """A dim argument normalised to 0..ndim-1, or None if it is not a plain int in range."""
    if not isinstance(dim, int) or isinstance(dim, bool) or not -ndim <= dim < ndim:
        return None
    return dim % ndim


def swaps_last_two_dims(node):
    """If `node` is x.transpose(-2, -1) in any spelling (transpose/swapaxes/permute/.mT,
    and .T/.t() of a matrix), the x; else None."""
    source = example_tensor(node.args[0]) if isinstance(node, fx.Node) and node.args else None
    if source is None or source.dim() < 2:
        return None
    ndim = source.dim()
    if is_op(node, "getattr") and (node.args[1] == "mT" or (node.args[1] == "T" and ndim == 2)):
        return node.args[0]
    if node.op == "call_function" and (node.target in ATTRIBUTE_CALLS["mT"] or (
            node.target in (torch.t, *ATTRIBUTE_CALLS["T"]) and ndim == 2)):
        return node.args[0]
    if node.op == "call_method" and node.target == "t" and ndim == 2:
        return node.args[0]
    if is_op(node, "transpose"):
        dims = {dim_index(arg(node, 1, "dim0"), ndim), dim_index(arg(node, 2, "dim1"), ndim)}
        return node.args[0] if dims == {ndim - 2, ndim - 1} else None
    if is_op(node, "permute"):
        dims = node.args[1:] if node.op == "call_method" else arg(node, 1, "dims")
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = dims[0]
        expected = [*range(ndim - 2), ndim - 1, ndim - 2]
        return node.args[0] if [dim_index(d, ndim) for d in dims] == expected else None
    return None


def shape_text(node):
    value = example_tensor(node)
    return "?" if value is None else "[" + ", ".join(str(s) for s in value.shape) + "]"


def describe(x):
    """Short text for a node or a constant, for reports."""
    if isinstance(x, fx.Node):
        if x.op in ("call_function", "call_method"):
            target = x.target if isinstance(x.target, str) else getattr(x.target, "__name__", str(x.target))
            return f"{x.name} ({target})"
        return f"{x.name} ({x.op})"
    if isinstance(x, float) and math.isinf(x):
        return "-inf" if x < 0 else "inf"
    return repr(x)


def mask_problem(mask, bool_ok=True, floating_ok=True):
    """Why the graph value `mask` cannot be passed on as attention's attn_mask, or None: no
    recorded value, or a dtype other than those accepted. A floating mask that requires
    grad (a learned bias) is passed on: the op returns its cotangents."""
    value = example_tensor(mask)
    if value is None:
        return f"{describe(mask)} has no recorded tensor value"
    dtype = value.dtype
    if not ((bool_ok and dtype == torch.bool) or (floating_ok and dtype.is_floating_point)):
        accepted = " or ".join(kind for kind, ok in (("bool", bool_ok), ("floating", floating_ok))
                               if ok)
        return f"{describe(mask)} is {dtype}, not {accepted}"
    return None


def user_code(node):
    """'file.py:LINE: code' of the user's line that produced `node`, or ''."""
    trace = node.meta.get("stack_trace") if isinstance(node, fx.Node) else None
    if not trace:
        return ""
    lines = [line.strip() for line in trace.strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            parts = lines[i].split('"')
            where = parts[1].rsplit("/", 1)[-1] if len(parts) > 1 else "?"
            line_no = lines[i].split("line ")[-1].split(",")[0]
            code = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{where}:{line_no}: {code}"
    return ""


# ---------------------------------------------------------------------------- mutation
# In-place operator functions: `x += y` is recorded as operator.iadd(x, y).
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul,
                      operator.iand, operator.ior, operator.ixor, operator.ilshift,
                      operator.irshift, operator.setitem}
# Trailing-underscore methods that change no values.
_METADATA_ONLY_METHODS = {"requires_grad_", "share_memory_"}


def written_operands(node):
    """The graph values that `node` writes in place: `x[i] = v`, `x.add_(y)`, `x += y`,
    `torch.relu_(x)`, aten in-place/out overloads, `F.relu(x, inplace=True)`, `out=` ...
    Writes through views count as writes of the view; callers compare storages."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return []
    written = []
    out = node.kwargs.get("out")
    written += [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, fx.Node)]
    first = node.args[0] if node.args else None
    if node.op == "call_method":
        name = node.target
        in_place = (name.endswith("_") and not name.startswith("__") and name not in _METADATA_ONLY_METHODS) \
            or name in ("__setitem__",) or (name.startswith("__i") and name[3:-2] in _IN_PLACE_DUNDERS)
        return written + ([first] if in_place and isinstance(first, fx.Node) else [])
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is not None:      # an aten or custom op overload: its schema says what it writes
        for i, argument in enumerate(schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
                written += [value] if isinstance(value, fx.Node) else []
        return written
    name = getattr(target, "__name__", "")
    if target in _INPLACE_OPERATORS or (name.endswith("_") and not name.startswith("__")
                                        and name not in _METADATA_ONLY_METHODS):
        return written + ([first] if isinstance(first, fx.Node) else [])
    if _inplace_flag(node):
        written += [first] if isinstance(first, fx.Node) else []
    return written


_IN_PLACE_DUNDERS = {"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul",
                     "and", "or", "xor", "lshift", "rshift"}


def _inplace_flag(node):
    """Whether a Python function with an `inplace` parameter (F.relu, F.dropout, ...) is
    called with inplace=True, by keyword or position."""
    if "inplace" in node.kwargs:
        return node.kwargs["inplace"] is True
    try:
        parameters = list(inspect.signature(node.target).parameters)
    except (TypeError, ValueError):
        return False
    if "inplace" not in parameters:
        return False
    position = parameters.index("inplace")
    return len(node.args) > position and node.args[position] is True


def storage_key(node):
    """An identity for the memory behind a node's recorded tensor (views share it), or
    None where it cannot be read (functorch-wrapped values inside transforms)."""
    value = example_tensor(node)
    if value is None:
        return None
    try:
        return value.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
