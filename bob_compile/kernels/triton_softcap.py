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

from . import settings, tiles

LOG2E = tl.constexpr(tiles.LOG2E)     # jitted code reads constexpr globals only


# SOFTCAP's values: off; on, tanh's reciprocal on the multifunction unit; on, that
# reciprocal by Newton's iterations on the FMA units (BOB_COMPILE_DEV_SOFTCAP_RECIPROCAL)
SOFTCAP_OFF, RECIPROCAL_MUFU, RECIPROCAL_NEWTON = 0, 1, 2
NEWTON = tl.constexpr(RECIPROCAL_NEWTON)     # jitted code reads constexpr globals only


@triton.jit
def capped_scores(u, softcap, SOFTCAP: tl.constexpr = 1):
    """(T, th): T = c tanh(u / c), th = tanh(u / c), for a tile u of natural-unit scores.
    tanh from one exp2: 1 - 2 / (exp(2 u / c) + 1) is exact at both ends (an infinite u gives
    ±1) and its absolute error near 0 is float32's, which is what a softmax sees.
    RECIPROCAL_NEWTON: each pair of a capped step needs the multifunction unit three times
    (this exp2, this reciprocal, the softmax's exp2), against once uncapped; the reciprocal
    then runs on the FMA units instead (its exponent clamped to ±64, where tanh is ±1 in
    float32 already, so that e + 1 stays finite; NaN kept): tanh within 2.4e-7 of float64
    against 1.8e-7 by division, ±1 at both ends."""
    y = u * (2.0 * LOG2E / softcap)
    if SOFTCAP == NEWTON:
        y = tl.minimum(tl.maximum(y, -64.0, propagate_nan=tl.PropagateNan.ALL), 64.0,
                       propagate_nan=tl.PropagateNan.ALL)
        x = tl.math.exp2(y) + 1.0
        # 1 / x to start from: the bits' magic difference is within 5.1 % of it for every
        # float32 x > 0, so that three iterations (each squares the error) reach float32's
        r = (0x7EF311C3 - x.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
        r = r + r * (1.0 - x * r)     # this form lands on 1 exactly at x = 1
        r = r + r * (1.0 - x * r)
        r = r + r * (1.0 - x * r)
        th = 1.0 - 2.0 * r
    else:
        th = 1.0 - 2.0 / (tl.math.exp2(y) + 1.0)
    return softcap * th, th


@triton.jit
def base2_scores(qk, scale, qk_scale_log2, softcap, SOFTCAP: tl.constexpr):
    """(scores in base 2, th) of a tile qk = q·k, as every kernel's loop forms them before
    its masks: capped in natural units with SOFTCAP (th = tanh(U / c), for φ' and φ''),
    else qk times scale·log2(e) (th is then qk, never read)."""
    if SOFTCAP:
        t, th = capped_scores(qk * scale, softcap, SOFTCAP)
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
    """(SOFTCAP, softcap) of a launch: the constexpr (SOFTCAP_OFF, or how tanh's reciprocal
    is taken: BOB_COMPILE_DEV_SOFTCAP_RECIPROCAL) and the cap (1.0 where off, never read)."""
    if not params.softcap:
        return SOFTCAP_OFF, 1.0
    newton = settings.current().softcap_reciprocal == "newton"
    return (RECIPROCAL_NEWTON if newton else RECIPROCAL_MUFU), float(params.softcap)


def softcap_flags(softcap):
    """The part of a launch plan's flags (its tuning key) that soft-capping adds."""
    return () if not softcap else ("softcap",) if softcap == RECIPROCAL_MUFU else \
        ("softcap", "newton")
