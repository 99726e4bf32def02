"""Small models for the backend tests, each spelling attention the way a real codebase does.

All are tiny (width 16, 2 heads, sequences of 8) so that float64 CPU runs take milliseconds.
`CASES` maps a name to a Case: how to build the model, a batch, and its exact reference
twin (the same weights; only Hugging Face's float32 softmax is made float64, since in a
float64 test that cast, not the backend, would dominate the error).
"""
import copy
import dataclasses
import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH, HEADS, SEQ, BATCH, VOCAB, BLOCK_SIZE = 16, 2, 8, 2, 32, 16


class SDPAAttention(nn.Module):
    """nanoGPT CausalSelfAttention, flash path: F.scaled_dot_product_attention."""

    def __init__(self, dim=WIDTH, heads=HEADS):
        super().__init__()
        self.n_head, self.n_embd = heads, dim
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class NanoGPTAttention(SDPAAttention):
    """nanoGPT CausalSelfAttention, slow path: hand-written, causal `bias` buffer."""

    def __init__(self, dim=WIDTH, heads=HEADS, block_size=BLOCK_SIZE, dropout=0.0):
        super().__init__(dim, heads)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size))
                             .view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """nanoGPT MLP."""

    def __init__(self, dim=WIDTH):
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class NanoGPTBlock(nn.Module):
    def __init__(self, dim=WIDTH, attention=NanoGPTAttention):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = attention(dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class SDPABlock(NanoGPTBlock):
    def __init__(self, dim=WIDTH):
        super().__init__(dim, SDPAAttention)


def repeat_kv(hidden_states, n_rep):
    """transformers.models.llama.modeling_llama.repeat_kv."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0):
    """transformers eager_attention_forward (Llama), with the softmax dtype a module attribute."""
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = attn_weights + causal_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=module.softmax_dtype).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


class HFEagerAttention(nn.Module):
    """Llama-style attention (4 query heads, 2 key/value heads) with the additive causal
    mask of LlamaModel._update_causal_mask built in the graph."""

    def __init__(self, dim=WIDTH, heads=4, kv_heads=2):
        super().__init__()
        self.head_dim = dim // heads
        self.num_key_value_groups = heads // kv_heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = 0.1
        self.softmax_dtype = torch.float32
        self.q_proj = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        hidden_shape = (B, T, -1, self.head_dim)
        q = self.q_proj(x).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(x).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(x).view(hidden_shape).transpose(1, 2)
        min_dtype = torch.finfo(x.dtype).min
        causal_mask = torch.full((T, T), fill_value=min_dtype, dtype=x.dtype, device=x.device)
        causal_mask = torch.triu(causal_mask, diagonal=1)
        causal_mask = causal_mask[None, None, :, :].expand(B, 1, -1, -1)
        out, _ = eager_attention_forward(self, q, k, v, causal_mask, scaling=self.scaling,
                                         dropout=0.0 if not self.training else self.attention_dropout)
        return self.o_proj(out.reshape(B, T, -1).contiguous())


class HFEagerBlock(NanoGPTBlock):
    def __init__(self, dim=WIDTH):
        super().__init__(dim, HFEagerAttention)
        self.eval()  # attention_dropout is 0.1: eval mode turns it off, as HF inference does


class ViTAttention(nn.Module):
    """timm Attention (fused_attn=False)."""

    def __init__(self, dim=WIDTH, num_heads=HEADS):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.q_norm, self.k_norm = nn.Identity(), nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = attn @ v
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class ViTBlock(NanoGPTBlock):
    """timm Block: norm1, attention, norm2, MLP (GELU)."""

    def __init__(self, dim=WIDTH):
        super().__init__(dim, ViTAttention)


class CheckpointedBlock(nn.Module):
    """A transformer block under activation checkpointing, as long-sequence training runs
    it: torch.utils.checkpoint.checkpoint(block, x) (Dynamo puts the block in a body graph
    of tag_activation_checkpoint, whose causal `bias` buffer comes from outside it)."""

    def __init__(self, dim=WIDTH, block=NanoGPTBlock, use_reentrant=False):
        super().__init__()
        self.block, self.use_reentrant = block(dim), use_reentrant
        self.checkpointing = True

    def forward(self, x):
        if not self.checkpointing:
            return self.block(x)
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.use_reentrant)


class GPT(nn.Module):
    """nanoGPT GPT, 2 layers (hand-written attention), returning the cross-entropy loss."""

    def __init__(self, n_layer=2, dim=WIDTH, vocab=VOCAB, block_size=BLOCK_SIZE):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block_size, dim)
        self.h = nn.ModuleList([NanoGPTBlock(dim) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets):
        pos = torch.arange(0, idx.size(-1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


@dataclasses.dataclass
class Case:
    make: Callable        # () -> float64 nn.Module
    batch: Callable       # (seed, seq) -> tuple of inputs
    sites: int            # attention sites the backend must replace in one forward
    # whether torch.func transforms run over it (PyTorch's own torch.func refuses the
    # saved-tensor hooks of activation checkpointing, compiled or not)
    transforms: bool = True

    def model(self):
        torch.manual_seed(0)
        return self.make().double()


def float_batch(seed, seq=SEQ):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, seq, WIDTH, generator=g, dtype=torch.float64),)


def token_batch(seed, seq=SEQ):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (BATCH, seq), generator=g),
            torch.randint(0, VOCAB, (BATCH, seq), generator=g))


CASES = {
    "sdpa": Case(SDPABlock, float_batch, 1),
    "nanogpt": Case(NanoGPTBlock, float_batch, 1),
    "hf_eager": Case(HFEagerBlock, float_batch, 1),
    "vit": Case(ViTBlock, float_batch, 1),
    "gpt2layer": Case(GPT, token_batch, 2),
    "checkpointed_nanogpt": Case(CheckpointedBlock, float_batch, 1, transforms=False),
    "checkpointed_sdpa": Case(lambda: CheckpointedBlock(block=SDPABlock), float_batch, 1,
                              transforms=False),
}


def loss_of(output):
    return output if output.dim() == 0 else output.square().mean()


def exact_twin(model):
    """A copy whose eager run is exact in float64 (HF's float32 softmax made float64), and
    without activation checkpointing: eager checkpointing recomputes the block in the
    backward with the module's own parameters, so under functional_call (MAML's fast
    weights) it differentiates the wrong weights. Compiled, the weights are inputs of the
    checkpointed body and the result is exact."""
    twin = copy.deepcopy(model)
    for module in twin.modules():
        if isinstance(module, HFEagerAttention):
            module.softmax_dtype = torch.float64
        if isinstance(module, CheckpointedBlock):
            module.checkpointing = False
    return twin
