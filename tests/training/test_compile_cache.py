"""Compiles a new process need not repeat: inductor's FX graph cache serves every graph of a
second-order step, the VJP pair's too, and pair_cache.py serves AOTAutograd's traced halves
(a warm start traces no pair again).

The second order's VJP pair is compiled at the step's first create_graph backward, from real
tensors. Without a shape environment in its tracing context, inductor bypassed its cache
("No shape env"): a warm process still compiled that pair from scratch (GPT-2 small on an
H200: 90 s to the first step with every cache on disk). A warm start must now hit the
cache for every graph and give the same derivatives; a changed model must miss.
A fresh Dynamo stands in for a new process: the FX graph cache has no in-memory layer, each
lookup reads the cache directory, which the test owns.
"""
import os
import pathlib

import pytest
import torch

from bob_compile.backend import flashbob
from models import WIDTH, NanoGPTBlock
from scenarios import hutchinson_hvp, max_error

pytestmark = [pytest.mark.usefixtures("fresh_dynamo"), pytest.mark.slow]   # ~60 s of compiling
OPTIONS = {"compiler": "inductor", "fallback": False}


def cache_counts():
    counts = torch._dynamo.utils.counters["inductor"]
    pairs = torch._dynamo.utils.counters["bob_compile"]
    return {**{k: counts[k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss",
                                      "fxgraph_cache_bypass")},
            **{k: pairs[k] for k in ("pair_cache_hit", "pair_cache_miss",
                                     "pair_cache_uncacheable")}}


def compiled_hvp(model, x):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    hvp = hutchinson_hvp(torch.compile(model, backend=flashbob, options=OPTIONS), [x])
    return hvp, cache_counts()


def test_a_warm_start_hits_the_cache_for_every_order_and_is_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    # the config module's own patch (monkeypatch's undo would hide the setting from every
    # later test of this process)
    with torch._inductor.config.patch(fx_graph_cache=True):
        check_warm_start(monkeypatch)


def check_warm_start(monkeypatch):
    torch.manual_seed(0)
    model = NanoGPTBlock().double()
    x = torch.randn(2, 12, WIDTH, dtype=torch.float64)
    expected = hutchinson_hvp(model, [x])

    cold, counts = compiled_hvp(model, x)
    # the first-order pair and the VJP pair: two graphs each, none from the cache, and
    # neither pair's trace
    assert counts == {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 4,
                      "fxgraph_cache_bypass": 0, "pair_cache_hit": 0, "pair_cache_miss": 2,
                      "pair_cache_uncacheable": 0}, counts
    traces = count_traces(monkeypatch)
    warm, counts = compiled_hvp(model, x)
    assert counts == {"fxgraph_cache_hit": 4, "fxgraph_cache_miss": 0,
                      "fxgraph_cache_bypass": 0, "pair_cache_hit": 2, "pair_cache_miss": 0,
                      "pair_cache_uncacheable": 0}, counts
    assert traces == [], "a warm start traced a pair with AOTAutograd again"
    assert max_error(cold, expected) <= 1e-10
    assert max_error(warm, expected) <= 1e-10

    # an entry that no longer compiles is dropped and traced again, exactly
    import torch._inductor.compile_fx as compile_fx_module
    from bob_compile.training import pair_cache
    load, compile_fx_inner = pair_cache.load, compile_fx_module.compile_fx_inner

    def refusing(graph, inputs, an_argument_inductor_lacks=False, **kwargs):
        if an_argument_inductor_lacks:
            raise TypeError("an argument inductor lacks")
        return compile_fx_inner(graph, inputs, **kwargs)
    monkeypatch.setattr(compile_fx_module, "compile_fx_inner", refusing)

    def stale(digest, fake_mode):
        halves, metadata, random = load(digest, fake_mode)
        return ({half: (graph, inputs, {**kwargs, "an_argument_inductor_lacks": True})
                 for half, (graph, inputs, kwargs) in halves.items()}, metadata, random)
    monkeypatch.setattr(pair_cache, "load", stale)
    again, counts = compiled_hvp(model, x)
    assert counts["pair_cache_miss"] == 2 and counts["pair_cache_hit"] == 0, counts
    assert max_error(again, expected) <= 1e-10
    monkeypatch.setattr(pair_cache, "load", load)
    monkeypatch.setattr(compile_fx_module, "compile_fx_inner", compile_fx_inner)
    _, counts = compiled_hvp(model, x)
    assert counts["pair_cache_hit"] == 2, counts       # written again

    # an entry that cannot be read is traced again, exactly
    for entry in (pathlib.Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) /
                  "bob_compile_pairs").glob("*.pkl"):
        entry.write_bytes(b"not a pickle")
    again, counts = compiled_hvp(model, x)
    assert counts["pair_cache_miss"] == 2 and counts["pair_cache_hit"] == 0, counts
    assert max_error(again, expected) <= 1e-10

    # another model (a wider MLP) is another graph: it misses
    other = NanoGPTBlock(dim=WIDTH * 2).double()
    _, counts = compiled_hvp(other, torch.randn(2, 12, WIDTH * 2, dtype=torch.float64))
    assert counts["fxgraph_cache_miss"] > 0 and counts["fxgraph_cache_bypass"] == 0, counts
    assert counts["pair_cache_miss"] == 2 and counts["pair_cache_hit"] == 0, counts


def count_traces(monkeypatch):
    """A list to which each later compile_fx call (AOTAutograd tracing a pair) appends."""
    import torch._inductor.compile_fx as compile_fx_module
    calls, original = [], compile_fx_module.compile_fx

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    monkeypatch.setattr(compile_fx_module, "compile_fx", counting)
    return calls
