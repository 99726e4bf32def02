"""Which cases of a matrix run in the default tier: every value of every axis at least once.

A full matrix (every model × every scenario, every architecture × implementation) runs in
the slow tier; the default tier runs its diagonal, so that each model, each scenario and
each implementation is still exercised there, at a fraction of the time.
"""
import itertools

import pytest


def diagonal(*axes, ids=None):
    """pytest params for the product of `axes` (each a list of values, or of tuples for a
    multi-argument axis): the k-th case takes the (k mod len)-th value of each axis and runs
    in the default tier; every other combination is marked slow. `ids`: a function of a
    value giving its id (default: pytest's)."""
    longest = max(len(axis) for axis in axes)
    chosen = {tuple(k % len(axis) for axis in axes) for k in range(longest)}
    params = []
    for combination in itertools.product(*(range(len(axis)) for axis in axes)):
        values = []
        for axis, i in zip(axes, combination):
            value = axis[i]
            values.extend(value if isinstance(value, tuple) else (value,))
        marks = () if combination in chosen else (pytest.mark.slow,)
        case_id = None if ids is None else "-".join(ids(v) for v in values)
        params.append(pytest.param(*values, marks=marks, id=case_id))
    return params
