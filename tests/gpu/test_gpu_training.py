"""The "training" route on CUDA: inductor's Triton code and our Triton attention kernels in
every order, against eager math attention (float32; relative error of each gradient)."""
import pytest
import torch
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

from bob_compile.backend import flashbob, recent_reports
from models import GPT

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo")]
OPTIONS = {"compiler": "inductor", "fallback": False}


def relative_error(actual, expected):
    return max(((a - e).norm() / e.norm()).item() for a, e in zip(actual, expected, strict=True))


def model_and_batch():
    torch.manual_seed(0)
    model = GPT(n_layer=2, dim=64, vocab=128).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.randint(0, 128, (4, 16), device="cuda", generator=g)
    return model, (idx, torch.roll(idx, -1, dims=1))


def first_order(model, batch):
    return torch.autograd.grad(model(*batch), list(model.parameters()))


def hvp(model, batch):
    params = list(model.parameters())
    grads = torch.autograd.grad(model(*batch), params, create_graph=True)
    return torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params])


def maml(model, batch):
    params = dict(model.named_parameters())
    support = tuple(t[:2] for t in batch)
    query = tuple(t[2:] for t in batch)
    grads = torch.autograd.grad(functional_call(model, params, support), list(params.values()),
                                create_graph=True)
    fast = {n: p - 0.1 * g for (n, p), g in zip(params.items(), grads)}
    return torch.autograd.grad(functional_call(model, fast, query), list(params.values()))


@pytest.mark.parametrize("scenario", [hvp, maml], ids=lambda f: f.__name__)
def test_second_order_on_cuda(scenario):
    model, batch = model_and_batch()
    with sdpa_kernel(SDPBackend.MATH):
        expected = scenario(model, batch)
    actual = scenario(torch.compile(model, backend=flashbob, options=OPTIONS), batch)
    assert relative_error(actual, expected) <= 1e-4
    assert {r.route for r in recent_reports} == {"training"}
    assert all(len(r.replaced) == 2 for r in recent_reports)


@pytest.mark.parametrize("scenario", [first_order, hvp, maml], ids=lambda f: f.__name__)
def test_cuda_graphs_replay_every_order(scenario):
    """mode="reduce-overhead": inductor records the forward, backward and double-backward
    graphs as CUDA graphs (our ops inside them; tuning ran in the warm-up, never during a
    capture) and replays them, exactly."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees
    model, batch = model_and_batch()
    with sdpa_kernel(SDPBackend.MATH):
        expected = scenario(model, batch)
    compiled = torch.compile(model, backend=flashbob, mode="reduce-overhead")  # no options with a mode
    counters["inductor"].clear()
    for _ in range(3):              # warm-up, record, replay
        actual = [g.clone() for g in scenario(compiled, batch)]
    assert relative_error(actual, expected) <= 1e-4
    assert counters["inductor"]["cudagraph_skips"] == 0
    manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
    assert manager is not None and sum(len(nodes) for nodes in manager.roots.values()) > 0
    assert {r.route for r in recent_reports} == {"training"}


def recorded_graphs():
    from torch._inductor import cudagraph_trees
    manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
    return sum(1 + node.num_descendants() for nodes in manager.roots.values() for node in nodes)


@pytest.mark.parametrize("scenario", [first_order, hvp, maml], ids=lambda f: f.__name__)
def test_cuda_graphs_replay_for_new_batches_without_recording_again(scenario):
    """Batches (and MAML's fast weights) come in at new addresses on every step: CUDA graphs
    copy them in and replay. Only parameters are recorded in place; a backward that took the
    caller's batch for static (it reads the batch it was saved with) recorded itself again
    for each new address."""
    model, batch = model_and_batch()
    compiled = torch.compile(model, backend=flashbob, mode="reduce-overhead")
    for _ in range(3):              # warm-up, record, replay
        scenario(compiled, batch)
    recorded = recorded_graphs()
    batches = [tuple(t.clone() for t in batch) for _ in range(3)]   # all alive: new addresses
    with sdpa_kernel(SDPBackend.MATH):
        expected = scenario(model, batches[-1])
    for new_batch in batches:
        actual = [g.clone() for g in scenario(compiled, new_batch)]
    assert recorded_graphs() == recorded
    assert relative_error(actual, expected) <= 1e-4


class PaddedAttention(torch.nn.Module):
    """One attention block over a right-padded batch: SDPA with a key-padding mask (B, 1, 1,
    T), as Hugging Face passes `attention_mask`; the loss counts real tokens only."""

    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x, real):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                             attn_mask=real[:, None, None, :])
        y = self.proj(y.transpose(1, 2).reshape(B, T, C))
        return (y.tanh() * real[..., None]).square().sum()


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_padding_masks_that_change_every_step(mode):
    """A new padding mask every step, a Hessian-vector product each, exact every time. The
    compiled graphs' op calls summarize their mask each (keeping a summary for the backwards
    is for plain eager calls only, triton_masks.summary_of_forward): under CUDA graphs the
    summaries are made inside the recorded graphs from the mask copied in, and the graphs
    record (a summary kept across calls made CUDA-graph trees refuse to)."""
    torch.manual_seed(0)
    model = PaddedAttention().cuda()
    compiled = torch.compile(model, backend=flashbob, mode=mode)
    x = torch.randn(3, 40, 64, device="cuda")
    for lengths in ((40, 17, 5), (9, 40, 33), (40, 17, 5), (2, 3, 40)):
        real = torch.arange(40, device="cuda")[None, :] < torch.tensor(lengths, device="cuda")[:, None]
        params = list(model.parameters())

        def step(fn):
            grads = torch.autograd.grad(fn(x, real), params, create_graph=True)
            return torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params])
        with sdpa_kernel(SDPBackend.MATH):
            expected = step(model)
        actual = [g.clone() for g in step(compiled)]
        assert relative_error(actual, expected) <= 1e-4, lengths
    assert all(len(r.replaced) == 1 for r in recent_reports)


@pytest.mark.parametrize("scenario", ["hvp", "maml"])
def test_attention_dropout_on_cuda(scenario):
    """Attention dropout on CUDA: both sites (SDPA's dropout_p, F.dropout on hand-written
    probabilities) become the op, whose Triton kernels draw the mask in every order; the
    compiled HVP and MAML meta-gradient (inductor) equal the op's eager ones given the same
    generator state (float32: the same kernels, so up to the compiled graph's roundings)."""
    from training.test_second_order_ops import SDPADropout, hessian_vector_product
    from training.test_second_order_ops import maml as maml_of
    torch.manual_seed(0)
    model = SDPADropout().cuda()
    reference = SDPADropout(op=True).cuda()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 8, 8, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    run = {"hvp": hessian_vector_product, "maml": maml_of}[scenario]
    compiled = torch.compile(model, backend=flashbob, options=OPTIONS)
    for seed in (10, 11):
        torch.manual_seed(seed)
        expected = run(reference, x)
        torch.manual_seed(seed)
        actual = run(compiled, x)
        assert relative_error(actual, expected) <= 1e-4
    assert sorted(site.dropout for site in recent_reports[-1].replaced) == [0.1, 0.3]


def test_attention_dropout_under_cuda_graphs():
    """mode="reduce-overhead" with attention dropout: each replay draws fresh seeds from the
    CUDA generator (the draw is recorded in the graph), so steps differ, each equals the op's
    eager step from the same generator state, and nothing is recorded again."""
    from training.test_second_order_ops import SDPADropout, hessian_vector_product
    torch.manual_seed(0)
    model = SDPADropout().cuda()
    reference = SDPADropout(op=True).cuda()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 8, 8, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    compiled = torch.compile(model, backend=flashbob, mode="reduce-overhead")
    for seed in (1, 2, 3):              # warm-up, record, replay
        torch.manual_seed(seed)
        hessian_vector_product(compiled, x)
    recorded = recorded_graphs()
    results = []
    for seed in (10, 11):
        torch.manual_seed(seed)
        expected = hessian_vector_product(reference, x)
        torch.manual_seed(seed)
        results.append([h.clone() for h in hessian_vector_product(compiled, x)])
        assert relative_error(results[-1], expected) <= 1e-4
    assert relative_error(results[0], results[1]) > 1e-3      # other seeds, other masks
    assert recorded_graphs() == recorded


@pytest.mark.parametrize("scenario", ["hvp", "maml"])
def test_learned_bias_on_cuda(scenario):
    """A learned (H, L, L) bias parameter on CUDA (inductor, float32): the site becomes the
    op, whose Triton kernels add the bias's cotangents into its shape; HVP and MAML w.r.t.
    every parameter, the bias included, against eager math."""
    from training.test_second_order_ops import LearnedBias, hessian_vector_product
    from training.test_second_order_ops import maml as maml_of
    torch.manual_seed(0)
    model = LearnedBias().cuda()
    x = torch.randn(2, 8, 8, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    run = {"hvp": hessian_vector_product, "maml": maml_of}[scenario]
    with sdpa_kernel(SDPBackend.MATH):
        expected = run(model, x)
    actual = run(torch.compile(model, backend=flashbob, options=OPTIONS), x)
    assert relative_error(actual, expected) <= 1e-4
    assert recent_reports and all(len(r.replaced) == 1 for r in recent_reports)

