"""What the passes did to one graph, in words, and process-wide counters.

Every attention site gets one line: replaced (with shapes, scale, causal and how causality
was proven) or skipped (with the reason). A softmax counts as a site when it is over a
product of two activations (handwritten.attention_like_softmaxes), so that a classifier's
softmax does not clutter the report while no attention goes unreported; sites inside the
bodies of higher-order ops (activation checkpointing, cond, ...) count too.

`counters` (also mirrored into torch._dynamo.utils.counters["flashbob"]) counts, over the
process: sdpa_replaced, sdpa_skipped, handwritten_replaced, handwritten_skipped,
multihead_replaced, multihead_skipped, flex_attention_skipped, graphs, route_<name> and
fallback. Clear it with `counters.clear()`.
"""
import collections
import dataclasses
from typing import Optional

from torch._dynamo.utils import counters as dynamo_counters

counters = collections.Counter()


def count(key, n=1):
    counters[key] += n
    dynamo_counters["flashbob"][key] += n


def snapshot():
    """The counters now, for restore(): a graph whose compile Dynamo restarts counts once."""
    return collections.Counter(counters), collections.Counter(dynamo_counters["flashbob"])


def restore(saved):
    ours, dynamo = saved
    counters.clear()
    counters.update(ours)
    dynamo_counters["flashbob"].clear()
    dynamo_counters["flashbob"].update(dynamo)


@dataclasses.dataclass
class Site:
    kind: str                    # "sdpa", "handwritten", "multihead" or "flex_attention"
    node: str                    # the SDPA or multi-head call, or hand-written attention's softmax
    code: str = ""               # the user's line, "file.py:LINE: code"
    replaced: bool = False
    reason: str = ""             # why it stays untouched
    shapes: str = ""             # q/k/v shapes
    scale: str = ""
    is_causal: bool = False
    enable_gqa: bool = False
    causal_proof: str = ""       # how the mask was proven causal, when there was one
    mask: str = ""               # the mask tensor passed on to attention, when there is one
    dropout: float = 0.0         # the attention dropout's probability, drawn by the op
    softcap: float = 0.0         # the cap c of soft-capped scores, applied by the op

    def line(self):
        where = f"{self.kind} at {self.node}" + (f" ({self.code})" if self.code else "")
        if not self.replaced:
            return f"skipped  {where}: {self.reason}"
        causal = f"causal=True ({self.causal_proof})" if self.causal_proof else f"causal={self.is_causal}"
        gqa = " enable_gqa=True" if self.enable_gqa else ""
        mask = f" mask={self.mask}" if self.mask else ""
        dropout = f" dropout_p={self.dropout:g}" if self.dropout else ""
        softcap = f" softcap={self.softcap:g}" if self.softcap else ""
        return (f"replaced {where}: {self.shapes} scale={self.scale} {causal}{gqa}{mask}"
                f"{dropout}{softcap}")


@dataclasses.dataclass
class GraphReport:
    compile_id: Optional[str] = None
    sites: list = dataclasses.field(default_factory=list)
    guards: list = dataclasses.field(default_factory=list)
    route: str = ""
    route_reason: str = ""
    error: str = ""              # set when the backend fell back to the untouched graph
    # one line per compiled AOTAutograd pair of the "training" route (compiled_text):
    # first order at compile time, the second order on first use (or why it runs eagerly)
    compiled: list = dataclasses.field(default_factory=list)
    dump_folder: Optional[str] = None
    notes: list = dataclasses.field(default_factory=list)   # other rewrites, one line each
    # a training graph's cut at its repeated blocks, or why it compiled whole
    # (bob_compile/training/regions.py); None where it has no repeated blocks
    regions: Optional[str] = None

    @property
    def replaced(self):
        return [s for s in self.sites if s.replaced]

    @property
    def skipped(self):
        return [s for s in self.sites if not s.replaced]

    def add(self, site):
        self.sites.append(site)
        count(f"{site.kind}_{'replaced' if site.replaced else 'skipped'}")

    def text(self):
        head = f"flashbob graph {self.compile_id or '?'}: {len(self.replaced)} attention site(s) " \
               f"replaced, {len(self.skipped)} skipped"
        lines = [head] + ["  " + s.line() for s in self.sites]
        lines += [f"  run-time check: {g}" for g in self.guards]
        lines += [f"  note: {n}" for n in self.notes]
        if self.error:
            lines.append(f"  error: {self.error}")
        lines.append(f"  route: {self.route}" + (f" ({self.route_reason})" if self.route_reason else ""))
        if self.regions:
            lines.append(f"  regions: {self.regions}")
        lines += [f"  compiled: {line}" for line in self.compiled]
        return "\n".join(lines) + "\n"


_ORDERS = {"first_order": "forward and backward",
           "second_order": "the VJP as a differentiable function (second order)",
           "region": "every order"}


def compiled_text_name(what):
    return _ORDERS.get(what, what)


def compiled_text(what, pair):
    """'<order>: forward half N ops, backward half M ops, keeping B for the backward,
    compiled in S s'. B: what the forward keeps beyond its inputs (CompiledPair.saved_bytes)."""
    def ops(graph):
        return sum(1 for n in graph.graph.nodes if n.op == "call_function")
    saved = pair.saved_bytes()
    kept = "? bytes (symbolic shapes)" if saved is None else byte_text(saved)
    return (f"{compiled_text_name(what)}: forward half {ops(pair.forward_graph)} ops, "
            f"backward half {ops(pair.backward_graph)} ops, keeping {kept} for the backward, "
            f"compiled in {pair.compile_seconds:.1f} s")


def byte_text(n):
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"
