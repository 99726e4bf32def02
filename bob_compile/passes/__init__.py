"""FX passes over Dynamo graphs: find softmax attention, replace it, say what was skipped.

    report = rewrite_attention(gm, example_inputs)

rewrites `gm` in place (SDPA calls first, then hand-written attention, then the bodies of
higher-order ops such as activation checkpointing), recompiles it, and returns a
GraphReport: one Site per attention site, and the run-time guards that the rewritten graph
needs (causal masks read from graph inputs, see causal_mask.py).

Modules: sdpa.py, handwritten.py and multi_head_forward.py and flex_attention.py (the
rewrites: SDPA calls, attention written by hand, nn.MultiheadAttention's
F.multi_head_attention_forward, FlexAttention's higher-order op),
sdpa_math.py (sites left as written, run as SDPA's math where differentiated twice),
autograd_functions.py (user Functions' backwards), inference.py (which inference graphs
keep PyTorch's fused SDPA), einsum.py (einsum spellings), inplace.py (in-place arithmetic on
temporaries made out of place first), subgraphs.py (higher-order op bodies), causal_mask.py
(proofs that a mask is causal), nodes.py (node spellings and queries), erase.py (targeted
dead-node removal), report.py (reports, counters).
"""
from .causal_mask import CausalTensorGuard, MaskProver
from .flex_attention import rewrite_flex
from .handwritten import rewrite_handwritten
from .inplace import functionalize_temporaries
from .multi_head_forward import rewrite_multihead
from .report import GraphReport, Site, counters
from .sdpa import rewrite_sdpa
from .subgraphs import rewrite_bodies


def rewrite_attention(gm, example_inputs, report=None):
    """Replace every supported attention site of `gm` by bob_compile.attention, in place."""
    report = report if report is not None else GraphReport()
    _rewrite_graph(gm, MaskProver(gm, example_inputs), report)
    return report


def _rewrite_graph(gm, prover, report):
    functionalize_temporaries(gm)
    rewrite_sdpa(gm, prover, report)
    rewrite_multihead(gm, prover, report)
    rewrite_handwritten(gm, prover, report)
    rewrite_flex(gm, report)
    rewrite_bodies(gm, prover, report, _rewrite_graph,
                   lambda body, outer: MaskProver(body, (), outer))
    gm.graph.lint()
    gm.recompile()


__all__ = ["rewrite_attention", "GraphReport", "Site", "CausalTensorGuard", "counters"]
