"""The "training" route: compiled graphs whose derivatives of every order are exact.

pairs.py (AOTAutograd pairs, compiled and called by us), draws.py (random draws and their
replay), second_order.py (the graph's VJP by autograd's own formulas), runtime.py (the
autograd Functions that run them: TrainingGraph).
"""
from . import regions
from .pairs import CompiledPair, NotSupported, compile_pair, without_inductor_attention_fusion
from .runtime import TrainingGraph, is_symbolic, under_fake_mode

__all__ = ["CompiledPair", "NotSupported", "TrainingGraph", "is_symbolic", "compile_pair", "regions", "under_fake_mode",
           "without_inductor_attention_fusion"]
