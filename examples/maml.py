"""MAML on a small transformer classifier, compiled with torch.compile(backend="flashbob").

Each task is a fresh few-shot problem: `n_way` random prototype token sequences, and
examples that are noisy copies of them (some tokens replaced at random). MAML learns an
initialisation from which one or a few SGD steps on a task's support set classify its query
set. The outer (meta) gradient goes *through* the inner SGD steps, so it needs the second
derivative of the loss: the inner gradients are taken with create_graph=True.

The inner loop is the torch.func.functional_call pattern of functorch's MAML example and of
the MAML trainers built on Hugging Face models:

    grads = torch.autograd.grad(loss, params, create_graph=True)
    params = {name: p - inner_lr * g ...}
    query_loss(functional_call(model, params, x_query)).backward()

Before training, the script computes one meta-gradient four ways and compares them:
eager PyTorch with math attention (the reference), eager first-order MAML (inner gradients
detached), stock torch.compile (backend aot_eager by default), and flashbob. Stock
torch.compile cannot give second-order MAML: AOTAutograd refuses the double backward with
an error (this model, torch 2.11 and 2.13), or, for compiled graphs that save no tensor
requiring grad (a single linear layer, say), silently returns first-order numbers. The
script prints which happened. flashbob must match the eager reference, or the script exits
with status 1.

    python examples/maml.py                       # tiny, CPU, ~90 s (mostly compiling)
    python examples/maml.py --device cuda --dtype bfloat16 --seq-len 1024 --d-model 256 \\
        --n-heads 4 --n-layers 4 --steps 200
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

import _common


class SelfAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)  # a classifier: every token sees all tokens
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class SequenceClassifier(nn.Module):
    """Token + position embeddings, pre-LN transformer blocks, mean pooling, linear head."""

    def __init__(self, vocab, n_classes, seq_len, d_model, n_heads, n_layers):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x).mean(dim=1))


def sample_tasks(args, device, generator):
    """A meta-batch of few-shot tasks: (support x, support y, query x, query y) each."""
    def noisy_copies(prototypes, per_class):
        labels = torch.arange(args.n_way).repeat_interleave(per_class)
        x = prototypes[labels]
        replace = torch.rand(x.shape, generator=generator) < args.noise
        x = torch.where(replace, torch.randint(args.vocab, x.shape, generator=generator), x)
        return x.to(device), labels.to(device)

    tasks = []
    for _ in range(args.meta_batch):
        prototypes = torch.randint(args.vocab, (args.n_way, args.seq_len), generator=generator)
        tasks.append((*noisy_copies(prototypes, args.k_shot), *noisy_copies(prototypes, args.k_query)))
    return tasks


def adapt(model, params, x, y, args, first_order=False):
    """Inner loop: plain SGD on the support set, differentiable unless first_order."""
    for _ in range(args.inner_steps):
        loss = F.cross_entropy(functional_call(model, params, (x,)), y)
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=not first_order)
        params = {name: p - args.inner_lr * g for (name, p), g in zip(params.items(), grads)}
    return params


def meta_loss(model, tasks, args, first_order=False):
    """Mean query loss after adaptation, and query accuracy."""
    # named_parameters of a compiled model carry its "_orig_mod." prefix, which is exactly
    # what functional_call on that compiled model expects.
    params = dict(model.named_parameters())
    losses, correct, total = [], 0, 0
    for x_s, y_s, x_q, y_q in tasks:
        fast = adapt(model, params, x_s, y_s, args, first_order)
        logits = functional_call(model, fast, (x_q,))
        losses.append(F.cross_entropy(logits, y_q))
        correct += (logits.argmax(-1) == y_q).sum().item()
        total += y_q.numel()
    return torch.stack(losses).mean(), correct / total


def meta_gradient(model, tasks, args, first_order=False):
    loss, _ = meta_loss(model, tasks, args, first_order)
    return torch.autograd.grad(loss, list(model.parameters()))


def compare_meta_gradients(model, tasks, args, tol):
    """One meta-gradient four ways; True when flashbob matches eager math attention."""
    with sdpa_kernel(SDPBackend.MATH):  # the only PyTorch SDPA backend with a double backward
        second_order = meta_gradient(model, tasks, args)
        first_order = meta_gradient(model, tasks, args, first_order=True)
    gap = _common.rel_err(first_order, second_order)
    print(f"eager math attention: first-order MAML differs from second-order by {gap:.2e} (relative)")

    torch._dynamo.reset()
    try:
        stock = meta_gradient(torch.compile(model, backend=args.stock_backend), tasks, args)
        print(f"stock torch.compile(backend={args.stock_backend!r}): relative difference "
              f"{_common.rel_err(stock, second_order):.2e} from second-order MAML, "
              f"{_common.rel_err(stock, first_order):.2e} from first-order MAML")
    except Exception as error:  # AOTAutograd's "does not currently support double backward"
        print(f"stock torch.compile(backend={args.stock_backend!r}) failed: "
              f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")

    torch._dynamo.reset()
    ours = meta_gradient(torch.compile(model, backend=args.backend), tasks, args)
    ok = _common.check(f"{args.backend} meta-gradient vs eager math attention (second order)",
                       ours, second_order, tol)
    ok &= _common.attention_replaced(args.backend)
    if gap <= 10 * tol:
        print(f"check: the second-order term ({gap:.1e}) is too small to tell the orders apart; "
              "raise --inner-lr")
        ok = False
    return ok


def main(argv=None):
    p = _common.parser(__doc__.split("\n\n")[0], steps=15, vocab=16, n_way=3, k_shot=2, k_query=3,
                       seq_len=12, noise=0.2, d_model=32, n_heads=2, n_layers=2, inner_steps=1,
                       inner_lr=0.5, meta_batch=4, lr=3e-3)
    p.add_argument("--stock-backend", default="aot_eager",
                   help="stock torch.compile backend to compare against (aot_eager or inductor)")
    args = p.parse_args(argv)
    device = _common.device_of(args)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    model = SequenceClassifier(args.vocab, args.n_way, args.seq_len, args.d_model, args.n_heads,
                               args.n_layers).to(device)

    # fp32 kernels on CUDA may use TF32 internally; on CPU the blockwise path is plain fp32.
    tol = 1e-4 if device.type == "cpu" else 1e-2
    ok = compare_meta_gradients(model, sample_tasks(args, device, generator), args, tol)

    print(f"\nmeta-training with torch.compile(backend={args.backend!r}), {args.dtype}:")
    compiled = torch.compile(model, backend=args.backend)  # same compiled code as the check
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    timer = _common.StepTimer(device)
    _common.reset_peak_memory(device)
    for step in range(args.steps):
        tasks = sample_tasks(args, device, generator)
        with timer.step():
            with _common.autocast(args, device):
                loss, accuracy = meta_loss(compiled, tasks, args)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        print(f"step {step:4d}  query loss {loss.item():.4f}  query accuracy {accuracy:.2f}  "
              f"{timer.last_ms:8.1f} ms")
    print(timer.summary("outer step"))
    print(f"peak memory: {_common.peak_memory(device)}")

    # Once more with the meta-trained weights (sharper attention than at initialisation).
    tasks = sample_tasks(args, device, generator)
    with sdpa_kernel(SDPBackend.MATH):
        reference = meta_gradient(model, tasks, args)
    ok &= _common.check(f"{args.backend} meta-gradient vs eager math attention (trained weights)",
                        meta_gradient(compiled, tasks, args), reference, tol)
    return _common.finish(ok)


if __name__ == "__main__":
    sys.exit(main())
