"""Soft-capped scores in Triton: T = c tanh(U / c) of the natural-unit scores U = scale q·k,
and the transform's derivatives (docs/second-order.md, "Score transforms").

A kernel with SOFTCAP on takes `softcap` (c > 0) and forms its tile's scores as
capped_scores(scale * q kᵀ) before any mask applies (base2_scores). Where a derivative of the scores meets
q or k it is the cotangent of T, dT; the GEMMs want that of U: dU = φ'(U) dT. The BoB also
needs φ''(U) = -(2 / c) tanh(U / c) φ'(U) (curvature term of the scores' cotangent). Both are
functions of th = tanh(U / c), which capped_scores returns beside T: nothing else is kept.
"""
import triton
import triton.language as tl

from . import tiles

LOG2E = tl.constexpr(tiles.LOG2E)     # jitted code reads constexpr globals only


@triton.jit
def capped_scores(u, softcap):
    """(T, th): T = c tanh(u / c), th = tanh(u / c), for a tile u of natural-unit scores.
    tanh from one exp2: 1 - 2 / (exp(2 u / c) + 1) is exact at both ends (an infinite u gives
    ±1) and its absolute error near 0 is float32's, which is what a softmax sees."""
    e = tl.math.exp2(u * (2.0 * LOG2E / softcap))
    th = 1.0 - 2.0 / (e + 1.0)
    return softcap * th, th


@triton.jit
def base2_scores(qk, scale, qk_scale_log2, softcap, SOFTCAP: tl.constexpr):
    """(scores in base 2, th) of a tile qk = q·k, as every kernel's loop forms them before
    its masks: capped in natural units with SOFTCAP (th = tanh(U / c), for φ' and φ''),
    else qk times scale·log2(e) (th is then qk, never read)."""
    if SOFTCAP:
        t, th = capped_scores(qk * scale, softcap)
        return t * LOG2E, th
    return qk * qk_scale_log2, qk


@triton.jit
def capped_slope(th):
    """φ'(U) = 1 - tanh²(U / c)."""
    return 1.0 - th * th


@triton.jit
def capped_curvature(th, softcap):
    """φ''(U) = -(2 / c) tanh(U / c) (1 - tanh²(U / c))."""
    return (-2.0 / softcap) * th * (1.0 - th * th)


def softcap_arguments(params):
    """(SOFTCAP, softcap) of a launch: the constexpr switch and the cap (1.0 where off, never
    read)."""
    return (True, float(params.softcap)) if params.softcap else (False, 1.0)


def softcap_flags(softcap):
    """The part of a launch plan's flags (its tuning key) that soft-capping adds."""
    return ("softcap",) if softcap else ()
