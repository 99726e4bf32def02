"""A Hugging Face GPT-2 trained with Sophia-H, compiled with torch.compile(backend="flashbob").

The model is transformers' own GPT2LMHeadModel, built from a small GPT2Config (nothing is
downloaded), once with attn_implementation="sdpa" (F.scaled_dot_product_attention) and once
with "eager" (transformers' hand-written eager_attention_forward, the path that TRAK and
bergson choose for higher-order work). Each training step is second order: the Hessian
diagonal is estimated by Hutchinson's method, a double backward through the whole model,
and fed to the Sophia update of examples/sophia_h.py. The data are the bytes of README.md.

For each implementation the script first checks the compiled model's loss, gradient and
Hessian-vector product against the same model run eagerly with math attention
(sdpa_kernel(SDPBackend.MATH) for "sdpa"; "eager" is math already), and exits with status 1
if they differ. Without transformers installed it says so and exits with status 0:
    pip install -e ".[examples]"

    python examples/hf_gpt2.py                    # tiny, CPU
    python examples/hf_gpt2.py --device cuda --dtype bfloat16 --block-size 1024 --n-layer 12 \\
        --n-head 12 --n-embd 768 --batch-size 4 --steps 20
"""
import pathlib
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import _common
from sophia_h import SophiaH, get_batch, load_bytes, rademacher_like

REPO = pathlib.Path(__file__).resolve().parent.parent


def build_gpt2(args, attn_implementation, device):
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=256, n_positions=args.block_size, n_embd=args.n_embd,
                        n_layer=args.n_layer, n_head=args.n_head, bos_token_id=0, eos_token_id=0,
                        # No dropout: a Hessian estimate wants one fixed function.
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(args.seed)  # the same weights for every implementation
    return GPT2LMHeadModel._from_config(config, attn_implementation=attn_implementation).to(device)


def hessian_step(model, params, x, zs):
    """loss, ∇L, z ⊙ (∇²L z) and ∇²L z for the language-model loss on x."""
    # The loss is computed here rather than by labels=x: transformers' loss helper logs a
    # notice on first use, which would split the compiled graph in two.
    logits = model(input_ids=x).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())
    grads = torch.autograd.grad(loss, params, create_graph=True)
    hvps = torch.autograd.grad(grads, params, grad_outputs=zs)
    return loss.detach(), [g.detach() for g in grads], torch._foreach_mul(zs, hvps), hvps


def check_against_eager(model, compiled, attn_implementation, x, zs, tol):
    params = list(model.parameters())
    with sdpa_kernel(SDPBackend.MATH):  # no effect on "eager", the math kernel for "sdpa"
        ref_loss, ref_grads, _, ref_hvps = hessian_step(model, params, x, zs)
    loss, grads, _, hvps = hessian_step(compiled, params, x, zs)
    ok = _common.check(f"{attn_implementation}: loss", [loss], [ref_loss], tol)
    ok &= _common.check(f"{attn_implementation}: gradient", grads, ref_grads, tol)
    ok &= _common.check(f"{attn_implementation}: Hessian-vector product", hvps, ref_hvps, tol)
    return ok


def train(args, attn_implementation, data, device, tol):
    from torch._dynamo.utils import counters
    counters["flashbob"].clear()  # count this implementation's attention sites alone
    torch._dynamo.reset()         # a fresh compile per implementation, not a recompile
    model = build_gpt2(args, attn_implementation, device)
    params = list(model.parameters())
    compiled = torch.compile(model, backend=args.backend)
    generator = torch.Generator().manual_seed(args.seed)  # batches are cut on the host
    z_generator = torch.Generator(device=device).manual_seed(args.seed)

    x, _ = get_batch(data, args.batch_size, args.block_size, device, generator)
    ok = check_against_eager(model, compiled, attn_implementation, x, rademacher_like(params, z_generator), tol)
    ok &= _common.attention_replaced(args.backend)

    optimizer = SophiaH(params, lr=args.lr)
    timer = _common.StepTimer(device)
    _common.reset_peak_memory(device)
    for step in range(args.steps):
        x, _ = get_batch(data, args.batch_size, args.block_size, device, generator)
        with timer.step():
            with _common.autocast(args, device):
                loss, grads, h_hat, _ = hessian_step(compiled, params, x, rademacher_like(params, z_generator))
            optimizer.update_hessian(h_hat)
            for p, g in zip(params, grads):
                p.grad = g
            optimizer.step()
        print(f"[{attn_implementation}] step {step:3d}  loss {loss.item():.4f}  {timer.last_ms:8.1f} ms")
    print(f"[{attn_implementation}] Sophia-H steps (each with a Hessian estimate): {timer.summary()}")
    print(f"[{attn_implementation}] peak memory: {_common.peak_memory(device)}")
    return ok


def main(argv=None):
    p = _common.parser(__doc__.split("\n\n")[0], steps=4, text=str(REPO / "README.md"), block_size=32,
                       batch_size=2, n_layer=2, n_head=2, n_embd=32, lr=3e-3)
    p.add_argument("--attn-implementation", nargs="+", default=["sdpa", "eager"],
                   choices=["sdpa", "eager"], help="transformers attention implementations to run")
    args = p.parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("skipped: this example needs Hugging Face transformers, which is not installed "
              "(pip install -e \".[examples]\")")
        return 0
    transformers.logging.set_verbosity_error()  # config notices about the tiny vocabulary
    device = _common.device_of(args)
    data = load_bytes(args.text, args.block_size)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; "
          f"training on {data.numel()} bytes of {args.text}")
    # fp32 kernels on CUDA may use TF32 internally; on CPU the blockwise path is plain fp32.
    tol = 1e-4 if device.type == "cpu" else 1e-2
    ok = True
    for attn_implementation in args.attn_implementation:
        print(f"\nGPT2LMHeadModel(attn_implementation={attn_implementation!r}), "
              f"torch.compile(backend={args.backend!r}), {args.dtype}:")
        ok &= train(args, attn_implementation, data, device, tol)
    return _common.finish(ok)


if __name__ == "__main__":
    sys.exit(main())
