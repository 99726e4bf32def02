"""A block that writes attention with torch.nn.attention.flex_attention, for the passes'
tests (tests/passes/test_flex_attention_pass.py, CPU float64) and the GPU suite: masks and
score mods as attention-gym's recipes write them, and the block's twin in eager math, which
applies the same mods by broadcasting over index grids (no vmap, no BlockMask, no code
under test)."""
import copy

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

B, H, E = 2, 2, 4
BLOCK = 16                 # smaller than the lengths: full, partial and empty blocks


# ---------------------------------------------------------------------------- masks and mods
# Each takes index tensors (0-d under FlexAttention's vmap; broadcast (B, H, L, S) grids in
# the reference), as attention-gym's recipes are written.
def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):          # Mistral / Gemma 2 local layers
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 9)


def prefix_lm(b, h, q_idx, kv_idx):               # T5-style prefix LM: a 6-token prefix
    return (kv_idx < 6) | (q_idx >= kv_idx)


def sink_and_window(b, h, q_idx, kv_idx):        # StreamingLLM: 4 sink keys + a window
    return (kv_idx < 4) | ((q_idx >= kv_idx) & (q_idx - kv_idx < 9))   # (2 intervals a row)


DOCUMENT_IDS = torch.tensor([0] * 7 + [1] * 13 + [2] * 3 + [3] * 14)   # packed, 37 tokens


def documents(b, h, q_idx, kv_idx):               # packed sequences, causal per document
    return (DOCUMENT_IDS[q_idx] == DOCUMENT_IDS[kv_idx]) & (q_idx >= kv_idx)


def alibi(score, b, h, q_idx, kv_idx):            # slopes 2^-(h+1), computed (any device)
    return score + torch.exp2(-(h + 1).to(score.dtype)) * (kv_idx - q_idx)


def softcap_30(score, b, h, q_idx, kv_idx):        # Gemma 2's attention logit soft-capping
    return 30 * torch.tanh(score / 30)


def softcap_50(score, b, h, q_idx, kv_idx):
    return 50 * torch.tanh(score / 50)


def bias_inside_the_cap(score, b, h, q_idx, kv_idx):    # not the op's order: the bias
    return 30 * torch.tanh((score + (kv_idx - q_idx) * 0.1) / 30)   # is capped too


RELATIVE = torch.randn(2 * 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


def relative_buffer(score, b, h, q_idx, kv_idx):   # a relative-position bias table
    return score + RELATIVE[q_idx - kv_idx + 64]


class FlexBlock(torch.nn.Module):
    """A projection, flex_attention with the given mods, a projection; `learned_bias`
    adds a parameter table read by the score_mod (its gradient flows through the op)."""

    def __init__(self, length, mask_mod, score_mod, kv_heads=H, learned_bias=False,
                 device="cpu", head_dim=E):
        super().__init__()
        self.head_dim = E = head_dim
        self.length, self.kv_heads, self.reference = length, kv_heads, False
        self.qkv = torch.nn.Linear(E * H, E * (H + 2 * kv_heads))
        self.out = torch.nn.Linear(E * H, E * H)
        self.mask_mod, self.base_score_mod = mask_mod, score_mod
        self.table = torch.nn.Parameter(0.1 * torch.randn(H, length, length)) \
            if learned_bias else None
        self.block_mask = None if mask_mod is None else create_block_mask(
            mask_mod, None, None, length, length, device=device, BLOCK_SIZE=BLOCK)

    @property
    def modifies_scores(self):
        return self.base_score_mod is not None or self.table is not None

    def score_mod(self, score, b, h, q_idx, kv_idx):
        if self.base_score_mod is not None:
            score = self.base_score_mod(score, b, h, q_idx, kv_idx)
        if self.table is not None:
            score = score + self.table[h, q_idx, kv_idx]
        return score

    def heads(self, x):
        E = self.head_dim
        q, k, v = self.qkv(x).split([E * H, E * self.kv_heads, E * self.kv_heads], -1)
        return [t.unflatten(-1, (-1, E)).transpose(1, 2) for t in (q, k, v)]

    def forward(self, x):
        q, k, v = self.heads(x)
        if self.reference:
            y = self.math(q, k, v)
        else:
            y = flex_attention(q, k, v, score_mod=self.score_mod if self.modifies_scores else None,
                               block_mask=self.block_mask, enable_gqa=self.kv_heads != H)
        return self.out(y.transpose(1, 2).flatten(-2)).tanh()

    def math(self, q, k, v):
        """The same attention in eager math: the mods evaluated on broadcast index grids."""
        k, v = (t.repeat_interleave(H // self.kv_heads, 1) for t in (k, v))
        L = q.shape[-2]
        b, h, q_idx, kv_idx = (torch.arange(n, device=q.device).view([-1 if i == d else 1 for i in range(4)])
                               for d, n in enumerate((B, H, L, L)))
        scores = q @ k.transpose(-1, -2) / self.head_dim ** 0.5
        scores = self.score_mod(scores, b, h, q_idx, kv_idx) if self.modifies_scores else scores
        if self.mask_mod is not None:
            scores = scores.masked_fill(~self.mask_mod(b, h, q_idx, kv_idx), float("-inf"))
        return scores.softmax(-1) @ v


def reference(model):
    """The model's twin with the same parameters, attention in eager math."""
    twin = copy.deepcopy(model)
    twin.reference = True
    return twin


CASES = {   # name: (length, mask_mod, score_mod, kv heads, learned bias)
    "causal": (29, causal, None, H, False),
    "sliding window + ALiBi": (45, sliding_window, alibi, H, False),
    "documents": (37, documents, None, H, False),
    "attention sink + sliding window": (45, sink_and_window, None, H, False),
    "prefix-LM + relative buffer": (33, prefix_lm, relative_buffer, H, False),
    "causal + learned bias": (23, causal, None, H, True),
    "ALiBi alone, GQA": (19, None, alibi, 1, False),
    "soft-capping 30 + sliding window": (45, sliding_window, softcap_30, H, False),
    "soft-capping 50 + causal": (29, causal, softcap_50, H, False),
    "a bias inside the cap + causal": (27, causal, bias_inside_the_cap, H, False),
}
REPLACED = {name: case[2] is not bias_inside_the_cap for name, case in CASES.items()}


def make(name, device="cpu", dtype=torch.float64, head_dim=E):
    """The case's block and two batches. Cases whose mods read module-level tensors
    (documents, the relative buffer) are CPU-only; PyTorch's flex kernels on CUDA need
    head_dim >= 16."""
    length, mask_mod, score_mod, kv_heads, learned = CASES[name]
    torch.manual_seed(0)
    model = FlexBlock(length, mask_mod, score_mod, kv_heads, learned, device, head_dim).to(
        device, dtype)
    g = torch.Generator(device).manual_seed(1)
    batches = [torch.randn(B, length, head_dim * H, dtype=dtype, device=device, generator=g)
               for _ in range(2)]
    return model, batches


def tile_by_tile_masks(B, Hq, L, S, block, device="cpu", relative=False, per_batch=False,
                       intervals=False):
    """Masks whose rows see more than one interval, per query head: dilated causal (every
    other key), an attention sink of 5 keys beside a causal window of 9, and a random
    layout of empty, full and random partial blocks; as FlexAttention BlockMasks of
    `block`-sized blocks resolved tile by tile (BlockSparseMask: what the ops get for
    them), and as booleans; `relative`: with a relative bias per head (random, a few
    values below -1e4 that hide pairs above the diagonal), then the additive mask instead
    of booleans; `per_batch`: each batch entry's heads take the patterns in another order
    (a mask that reads b); `intervals`: patterns whose rows and keys are intervals instead
    (causal, a causal window of 9, prefix-LM over 20 keys), which with a relative bias the
    kernels apply from indices. Every row sees key 0 (`intervals`: some key)."""
    from bob_compile import block_masks
    g = torch.Generator().manual_seed(L * S + block)
    rows, keys = torch.arange(L)[:, None], torch.arange(S)[None, :]
    layout = torch.randint(0, 3, (-(-L // block), -(-S // block)), generator=g)
    layout = layout.repeat_interleave(block, 0)[:L].repeat_interleave(block, 1)[:, :S]
    # every row sees key 0 (no row without a key: a low-precision softmax's NaN there)
    random = torch.where(layout == 2, torch.rand(L, S, generator=g) < 0.4, layout == 1) | \
        (keys == 0)
    patterns = torch.stack(((keys <= rows) & ((rows - keys) % 2 == 0),
                            (keys < 5) | ((keys <= rows) & (rows - keys < 9)), random))
    if intervals:
        patterns = torch.stack((keys <= rows, (keys <= rows) & (rows - keys < 9),
                                (keys < 20) | (keys <= rows)))
    patterns = patterns[torch.arange(Hq) % 3].to(device)

    def per_head(b, h, q_idx, kv_idx):
        return patterns[(h + b) % Hq if per_batch else h, q_idx, kv_idx]
    block_mask = create_block_mask(per_head, B if per_batch else None, Hq, L, S, device=device,
                                   BLOCK_SIZE=block)
    bias = None
    if relative:
        bias = torch.randn(1, Hq, L + S - 1, generator=g)
        bias[..., :S - 1:17] = -2e4      # pairs above the diagonal (key 0 stays seen)
        bias = bias.to(device)
    tiles = block_masks.key_intervals(block_masks.Blocks.of(block_mask), L, S, device, B, Hq,
                                      tiles_otherwise=True, relative_bias=bias)
    visible = patterns.expand(B, Hq, L, S)
    if per_batch:
        visible = torch.stack([patterns[(torch.arange(Hq) + b) % Hq] for b in range(B)])
    if relative:
        at = (torch.arange(L)[:, None] - torch.arange(S)[None, :] + S - 1).to(device)
        visible = bias[..., at].masked_fill(~visible, float("-inf"))
    return tiles.for_call(B, Hq), visible
