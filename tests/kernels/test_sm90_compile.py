"""Kernel variants compiled for sm_90a (the H100 and H200) on the CPU, with Triton's own
ptxas: what the interpreter runs but does not check as the compiler does. It accepted a
non-constexpr global read by a jitted function and a helper returning from both arms of a
constexpr branch, both of which the compiler refuses. Each case is a variant no other CPU
test compiles: a relative bias added in every loop on both mask paths, soft-capping with
tanh's reciprocal by Newton's iterations. Slow: tens of seconds a kernel."""
import os

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bob_compile.kernels.triton_softcap import RECIPROCAL_NEWTON  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1",
    reason="the interpreter's kernels are not compiled (tests/kernels/test_triton_interpret.py)")]

FLOAT_ARGS = ("qk_scale_log2", "scale", "keep_scale", "softcap")
FLOAT_TENSORS = ("LSE", "D", "E", "ALPHA", "DLSE")    # row statistics: float32
KERNELS = [  # module, kernel, (BLOCK_M, BLOCK_N, warps, stages): each one's first candidate
    ("triton_forward", "_forward_kernel", (128, 64, 8, 3)),
    ("triton_backward", "_column_kernel", (32, 128, 4, 3)),
    ("triton_backward", "_dq_kernel", (64, 64, 4, 2)),
    ("triton_bob", "_row_kernel", (128, 32, 8, 3)),
    ("triton_bob", "_column_kernel", (64, 64, 4, 2)),
]
CASES = {  # the constexprs that make each variant
    "relative bias, from indices": dict(MASK_KIND=3, MASK_PATH=1, RELATIVE=True),
    "relative bias, read": dict(MASK_KIND=3, MASK_PATH=2, RELATIVE=True),
    "soft cap, Newton's reciprocal": dict(SOFTCAP=RECIPROCAL_NEWTON),
}


def signature(fn, constexprs):
    types = {}
    for name in fn.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name == "SEED":
            types[name] = "*i64"
        elif name == "MASK":
            types[name] = "*u8"
        elif name == "KEY_RANGE":
            types[name] = "*i32"
        elif name.isupper() and name not in ("L", "S"):
            types[name] = "*fp32" if name in FLOAT_TENSORS or name.endswith("_ACC") else "*bf16"
        else:
            types[name] = "fp32" if name in FLOAT_ARGS else "i32"
    return types


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("module,kernel,config", KERNELS,
                         ids=[f"{m.removeprefix('triton_')}.{k}" for m, k, _ in KERNELS])
def test_compiles_for_sm90(module, kernel, config, case):
    import importlib
    fn = getattr(importlib.import_module(f"bob_compile.kernels.{module}"), kernel)
    block_m, block_n, warps, stages = config
    constexprs = dict(
        HEAD_DIM=64, HEAD_DIM_V=64, BLOCK_E=64, BLOCK_EV=64, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=False, MASK_KIND=0, MASK_PATH=0, DOT_PRECISION="ieee", DROPOUT=False,
        SOFTCAP=0, RELATIVE=False, HAS_DM=False, HAS_GDM=False, HAS_GM=False,
        DQ_ATOMICS=False, HAS_GDQ=True, HAS_GDK=True, HAS_GDV=True, FOLD=True, HAS_DLSE=False,
        HAS_DQ=True, HAS_B=False, SPLIT_SBAR=False, SPLIT_EDGES=True)
    constexprs.update(CASES[case])
    constexprs = {name: value for name, value in constexprs.items() if name in fn.arg_names}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature(fn, constexprs),
                                        constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    assert compiled.asm["cubin"]
