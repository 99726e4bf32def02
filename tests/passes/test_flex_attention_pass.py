"""The passes on torch.nn.attention.flex_attention calls (Dynamo's flex_attention
higher-order op), in float64 on the CPU: additive score_mods replaced by the op, others run
as math where the graph is differentiated, every order against an eager reference that
applies the same mask_mod and score_mod by broadcasting over index tensors (no vmap, no
BlockMask, no code under test).

On the CPU PyTorch's flex_attention refuses inputs that require grad (`_validate_device`),
so the fixture below lets it through; the backend then replaces the op. AOTAutograd runs
with aot_eager (test_inductor_compiles_a_replaced_site covers inductor)."""
import pytest
import torch
from torch.nn.attention import flex_attention as flex_module
from torch.nn.attention.flex_attention import flex_attention

from bob_compile.backend import flashbob, recent_reports
from bob_compile.passes import counters
from flex_models import CASES, E, REPLACED, make, reference
from scenarios import (first_order, grad_of_grad, hutchinson_hvp, jvp_of_grad, maml_step,
                       max_error, vmap_of_grad)
from tiers import diagonal

OPTIONS = {"compiler": "aot_eager", "fallback": False}

# the tile-by-tile and relative-bias routes at these small sizes (conftest.py)
pytestmark = pytest.mark.usefixtures("tiles_at_any_size")
TOLERANCE = 1e-9


@pytest.fixture(autouse=True)
def flex_on_the_cpu(monkeypatch, fresh_dynamo):
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args, **kwargs: None)


def assert_report(name):
    assert recent_reports, "flashbob compiled nothing"
    sites = [s for r in recent_reports for s in r.sites]
    assert sites and all(s.kind == "flex_attention" for s in sites)
    if REPLACED[name]:
        assert all(s.replaced for s in sites), [s.line() for s in sites]
    else:
        assert all(not s.replaced and "plus a term without the score" in s.reason
                   and "runs as math" in s.reason for s in sites), [s.line() for s in sites]


# ---------------------------------------------------------------------------- every order
@pytest.mark.parametrize("name,scenario", diagonal(
    list(CASES), [first_order, hutchinson_hvp, maml_step],
    ids=lambda v: v if isinstance(v, str) else v.__name__))
def test_differentiated_from_outside(name, scenario):
    model, batches = make(name)
    inputs = (tuple(batches[:1]), tuple(batches[1:])) if scenario is maml_step else batches[:1]
    expected = scenario(reference(model), inputs)
    actual = scenario(torch.compile(model, backend=flashbob, options=OPTIONS), inputs)
    assert max_error(actual, expected) <= TOLERANCE
    assert_report(name)


@pytest.mark.parametrize("name,scenario", diagonal(
    ["sliding window + ALiBi", "soft-capping 30 + sliding window", "documents",
     "a bias inside the cap + causal"],
    [jvp_of_grad, grad_of_grad, vmap_of_grad],
    ids=lambda v: v if isinstance(v, str) else v.__name__))
def test_transforms_compiled(name, scenario):
    """torch.func inside the compiled function (the "aot" route): replaced sites run the
    op; the others PyTorch's op, whose torch.func rules bob_compile gives (its math:
    PyTorch has none, and Dynamo fails tracing the op under a transform without them)."""
    model, batches = make(name)
    params = {n: p.detach() for n, p in model.named_parameters()}
    expected = scenario(reference(model), params, batches[:1])
    compiled = torch.compile(lambda p: scenario(model, p, batches[:1]), backend=flashbob,
                             options=OPTIONS)
    assert max_error(compiled(params), expected) <= TOLERANCE
    assert all(r.route == "aot" for r in recent_reports)
    sites = [s for r in recent_reports for s in r.sites]
    assert sites and all(s.replaced == REPLACED[name] for s in sites)
    if name == "documents":     # no packed mask under the graph's own transforms
        assert all("materialized per call: the graph runs torch.func" in s.mask
                   for s in sites), [s.mask for s in sites]


def test_inductor_compiles_a_replaced_site():
    model, batches = make("sliding window + ALiBi")
    expected = hutchinson_hvp(reference(model), batches[:1])
    actual = hutchinson_hvp(torch.compile(model, backend=flashbob, options={"fallback": False}),
                            batches[:1])
    assert max_error(actual, expected) <= TOLERANCE
    assert_report("sliding window + ALiBi")


# ---------------------------------------------------------------------------- routes
def test_inference_keeps_pytorchs_op():
    """Nothing differentiates an inference graph: the call goes back to PyTorch's op
    (block-sparse, no mask materialized), the report still naming the site."""
    model, batches = make("sliding window + ALiBi")
    with torch.no_grad():
        expected = reference(model)(batches[0])
        actual = torch.compile(model, backend=flashbob, options=OPTIONS)(batches[0])
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-9)
    report, = recent_reports
    assert report.route == "inference" and counters["inference_native_sdpa"] == 1
    assert "FlexAttention" in report.route_reason and report.sites[0].replaced


def test_a_read_logsumexp_keeps_the_call_and_its_second_order_is_math():
    """return_lse: the op gives the output only, so the call stays PyTorch's (first order),
    and runs as math where the graph is differentiated twice: the HVP through the
    logsumexp is exact."""
    model, batches = make("causal")

    def with_lse(model, x):
        q, k, v = model.heads(x)
        if model.reference:
            L = q.shape[-2]
            visible = torch.ones(L, L, dtype=torch.bool).tril()
            scores = (q @ k.transpose(-1, -2) / E ** 0.5).masked_fill(~visible, float("-inf"))
            out, lse = scores.softmax(-1) @ v, scores.logsumexp(-1)
        else:
            out, lse = flex_attention(q, k, v, block_mask=model.block_mask, return_lse=True)
        return out.sin().sum() + lse.square().sum()

    def hvp(function, params):
        grads = torch.autograd.grad(function(batches[0]), params, create_graph=True)
        return torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params])
    twin = reference(model)
    expected = hvp(lambda x: with_lse(twin, x), list(twin.qkv.parameters()))
    compiled = torch.compile(lambda x: with_lse(model, x), backend=flashbob, options=OPTIONS)
    actual = hvp(compiled, list(model.qkv.parameters()))
    assert max_error(actual, expected) <= TOLERANCE
    site, = [s for r in recent_reports for s in r.sites]
    assert not site.replaced and "logsumexp" in site.reason and "runs as math" in site.reason



def test_a_logsumexp_computed_and_dropped_is_not_read():
    """Hugging Face asks for the logsumexp, converts it to the value's dtype and drops it:
    the call is replaced, the dead conversion erased."""
    model, batches = make("causal")

    def drops_lse(x):
        q, k, v = model.heads(x)
        out, lse = flex_attention(q, k, v, block_mask=model.block_mask, return_lse=True)
        lse.to(torch.float32)
        return out.sin().sum()

    def hvp(function, module):
        params = list(module.qkv.parameters())
        grads = torch.autograd.grad(function(batches[0]), params, create_graph=True)
        return torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params])
    twin = reference(model)
    expected = hvp(lambda x: twin.math(*twin.heads(x)).sin().sum(), twin)
    actual = hvp(torch.compile(drops_lse, backend=flashbob, options=OPTIONS), model)
    assert max_error(actual, expected) <= TOLERANCE
    site, = [s for r in recent_reports for s in r.sites]
    assert site.replaced


def test_a_mask_mod_reading_the_batch_entry_through_the_pass():
    """The pass finds, on the mask_mod's graph (its captured document ids a graph input),
    that it reads b: the mask is evaluated per batch entry although the BlockMask was
    built once for all (B=None), as FlexAttention evaluates it."""
    from torch.nn.attention.flex_attention import create_block_mask
    L = 37
    ids = torch.stack([torch.arange(L) // 9, torch.arange(L) // 5])

    def per_sequence_documents(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)
    block_mask = create_block_mask(per_sequence_documents, None, None, L, L, device="cpu",
                                   BLOCK_SIZE=64)
    visible = (ids[:, None, :, None] == ids[:, None, None, :]) & \
        torch.ones(L, L, dtype=torch.bool).tril()
    assert_compiled_hvp_equals_math(block_mask, visible, (2, 2, L, E), seed=7)
    site, = [s for r in recent_reports for s in r.sites]
    assert site.replaced


def assert_compiled_hvp_equals_math(block_mask, visible, shape, seed):
    """A compiled flex_attention call with `block_mask`: its Hessian-vector product in
    q, k, v equals eager math's with the boolean mask `visible`."""
    g = torch.Generator().manual_seed(seed)
    q0, k0, v0 = (torch.randn(*shape, dtype=torch.float64, generator=g) for _ in range(3))

    def hvp(attend):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        grads = torch.autograd.grad(attend(q, k, v).sin().sum(), (q, k, v), create_graph=True)
        return torch.autograd.grad(grads, (q, k, v), [torch.ones_like(t) for t in grads])

    def math(q, k, v):
        scores = (q @ k.transpose(-1, -2) / E ** 0.5).masked_fill(~visible, float("-inf"))
        return scores.softmax(-1) @ v
    compiled = torch.compile(lambda q, k, v: flex_attention(q, k, v, block_mask=block_mask),
                             backend=flashbob, options=OPTIONS)
    assert max_error(hvp(compiled), hvp(math)) <= TOLERANCE


@pytest.mark.parametrize("name", ["prefix-LM + relative buffer", "soft-capping 50 + causal"])
def test_dynamic_shapes(name):
    """torch.compile(dynamic=True): the mods may capture sizes (SymInts) beside tensors;
    the pass reads them at their hints, and every order stays exact."""
    model, batches = make(name)
    expected = hutchinson_hvp(reference(model), batches[:1])
    actual = hutchinson_hvp(torch.compile(model, backend=flashbob, dynamic=True,
                                          options=OPTIONS), batches[:1])
    assert max_error(actual, expected) <= TOLERANCE
    assert_report(name)


def test_a_call_without_a_block_mask_materializes_no_mask(monkeypatch):
    """flex_attention without a BlockMask passes the one it makes itself (lengths (1, 1), one
    block of 2^30, noop_mask): the pass recognizes it, and only the bias goes to the op;
    ALiBi's reads q_idx - kv_idx alone, so as one row of L + S - 1 per head, every pair's
    blocks full (nothing L x S)."""
    from bob_compile.kernels.block_sparse_masks import BlockSparseMask
    resolved = _resolved(monkeypatch)
    model, batches = make("ALiBi alone, GQA")
    hutchinson_hvp(torch.compile(model, backend=flashbob, options=OPTIONS), batches[:1])
    site, = [s for r in recent_reports for s in r.sites]
    assert site.replaced and site.mask == \
        "score_mod's relative bias (L + S - 1 values per head, in the kernels)"
    L = batches[0].shape[1]
    assert resolved and all(isinstance(m, BlockSparseMask) and m.tiles.shape[0] == 0 and
                            m.relative_bias.shape[-1] == 2 * L - 1 for m in resolved)


# ---------------------------------------------------------------------------- fallbacks
NONLINEAR = "a bias inside the cap + causal"


def test_a_compiler_failure_runs_the_rewritten_graph_eagerly_and_exactly():
    """Inductor cannot lower PyTorch's FlexAttention in float64 on the CPU (the site with a
    nonlinear score_mod keeps PyTorch's op for its first order). Running the untouched graph
    would give a silently wrong Hessian-vector product: PyTorch's FlexAttention backward is not
    differentiated again. The rewritten graph runs eagerly instead: exact, with a warning."""
    model, batches = make(NONLINEAR)
    expected = hutchinson_hvp(reference(model), batches[:1])
    with pytest.warns(UserWarning, match="with inductor .*running its rewritten graph eagerly"):
        actual = hutchinson_hvp(torch.compile(model, backend=flashbob), batches[:1])
    assert max_error(actual, expected) <= TOLERANCE
    assert recent_reports[-1].route == "eager"
    assert "inductor failed" in recent_reports[-1].route_reason


def test_a_failure_of_the_passes_runs_the_untouched_graph_with_its_attention_as_math(
        monkeypatch):
    """Where the passes themselves fail, the untouched graph runs, its FlexAttention call as
    math where gradients are on: PyTorch's own op would drop its second-order terms."""
    from bob_compile import backend

    def failing(*args, **kwargs):
        raise RuntimeError("a pass failed")
    monkeypatch.setattr(backend, "rewrite_attention", failing)
    model, batches = make(NONLINEAR)
    expected = hutchinson_hvp(reference(model), batches[:1])
    with pytest.warns(UserWarning, match="running it untouched"):
        actual = hutchinson_hvp(torch.compile(model, backend=flashbob,
                                              options={"compiler": "aot_eager"}), batches[:1])
    assert max_error(actual, expected) <= TOLERANCE
    assert recent_reports[-1].route == "untouched"
    assert "its attention runs as math" in recent_reports[-1].route_reason


# ---------------------------------------------------------------------------- the mask's form
def _resolved(monkeypatch):
    """What the ops resolve packed BlockMasks to, call by call."""
    from bob_compile import block_masks
    resolved, resolve = [], block_masks.resolve

    def spy(*args):
        resolved.append(resolve(*args))
        return resolved[-1]
    monkeypatch.setattr(block_masks, "resolve", spy)
    return resolved


@pytest.mark.parametrize("name", ["documents", "prefix-LM + relative buffer"])
def test_a_compiled_block_mask_reaches_the_ops_packed(monkeypatch, name):
    """In a compiled graph a BlockMask is packed (its block lists and captured tensors:
    nothing L x S in the graph or saved between its ops); each op resolves it when it runs,
    to key intervals for causal packed documents; with a relative bias (a buffer read at
    q - k) to tiles carrying the bias's L + S - 1 values per head."""
    from bob_compile.kernels.block_sparse_masks import BlockSparseMask
    from bob_compile.kernels.interval_masks import KeyIntervals
    resolved = _resolved(monkeypatch)
    model, batches = make(name)
    expected = hutchinson_hvp(reference(model), batches[:1])
    actual = hutchinson_hvp(torch.compile(model, backend=flashbob, options=OPTIONS), batches[:1])
    assert max_error(actual, expected) <= TOLERANCE
    site, = [s for r in recent_reports for s in r.sites]
    if name == "documents":
        assert "resolved by the op" in site.mask
        # the forward, the create_graph backward, the double backward's ops
        assert len(resolved) >= 3 and all(isinstance(m, KeyIntervals) for m in resolved)
    else:
        assert "relative bias" in site.mask and "materialized" not in site.mask
        assert resolved and all(isinstance(m, BlockSparseMask) and m.relative_bias is not None
                                for m in resolved)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_a_block_mask_kept_across_steps_is_read_once(monkeypatch, compiler):
    """A model holding its BlockMask (made once, as training code does) packs it in every
    compiled call, and the second order's VJP pair packs it once more: its bytes are read
    (on a GPU a host synchronization) at the first step only; the later resolves find its
    form by the tensors it was packed from, exact at every step."""
    import collections
    from bob_compile import block_masks
    for kept in ("_by_content", "_by_sources", "_by_packed"):
        monkeypatch.setattr(block_masks, kept, collections.OrderedDict())
    reads, blake2b = [], block_masks.hashlib.blake2b
    monkeypatch.setattr(block_masks.hashlib, "blake2b",
                        lambda *a, **k: reads.append(1) or blake2b(*a, **k))
    resolved = _resolved(monkeypatch)
    model, batches = make("documents")
    expected = hutchinson_hvp(reference(model), batches[:1])
    compiled = torch.compile(model, backend=flashbob, options={**OPTIONS, "compiler": compiler})
    for step in range(3):
        assert max_error(hutchinson_hvp(compiled, batches[:1]), expected) <= TOLERANCE
        assert len(reads) == 1, f"step {step}: the packed mask was read {len(reads)} times"
    assert len(resolved) >= 9


def test_a_block_mask_of_more_than_intervals_resolves_tile_by_tile(monkeypatch):
    """A dilated causal mask (every other key) is no interval per row: the ops resolve the
    packed BlockMask tile by tile (nothing L x S), exact at every order."""
    from bob_compile.kernels.block_sparse_masks import BlockSparseMask
    from torch.nn.attention.flex_attention import create_block_mask
    resolved = _resolved(monkeypatch)
    L = 41

    def dilated(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((q_idx - kv_idx) % 2 == 0)
    block_mask = create_block_mask(dilated, None, None, L, L, device="cpu", BLOCK_SIZE=16)
    rows, keys = torch.arange(L)[:, None], torch.arange(L)[None, :]
    visible = (rows >= keys) & ((rows - keys) % 2 == 0)
    assert_compiled_hvp_equals_math(block_mask, visible, (1, 2, L, E), seed=3)
    assert resolved and all(isinstance(m, BlockSparseMask) for m in resolved)


def test_graphs_under_cuda_graphs_materialize_their_block_masks():
    """A graph compiled with CUDA graphs cannot have its ops list a mask's blocks on the
    host (a capture allows no synchronization): its flex_calls materialize the mask."""
    from bob_compile.flex import flex_call
    from bob_compile.passes import rewrite_attention
    from bob_compile.passes.flex_attention import materialize_block_masks
    model, batches = make("documents")
    graphs = []
    torch.compile(model, backend=lambda gm, inputs: graphs.append(gm) or gm)(batches[0])
    gm, = graphs
    rewrite_attention(gm, [batches[0]])
    calls = [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
             for n in m.graph.find_nodes(op="call_function", target=flex_call)]
    assert calls and all(n.kwargs["mask_mod_key"] is not None for n in calls)
    materialize_block_masks(gm)
    assert all(n.kwargs["mask_mod_key"] is None for n in calls)
