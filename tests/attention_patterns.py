"""Hand-written attention as real models spell it: what handwritten.py must recognise.

Each function is the attention core of one model family, copied in spirit from its source
(the comment names it), with the caller's tensors as arguments: q (B, H, L, E), k (B, H, S, E),
v (B, H, S, Ev) and `bias`, nanoGPT's causal buffer `torch.tril(torch.ones(n, n)).view(1, 1, n, n)`
with n >= L (patterns that build their mask in the graph ignore it). The tests compile
every entry of PATTERNS with flashbob and check that it is replaced and matches SDPA;
MASKED_PATTERNS are replaced with their (not causal) mask passed on, and match the written
code at every order; the MUST_NOT_MATCH entries look similar but are not softmax attention
and must stay untouched.
"""
import math

import torch
import torch.nn.functional as F


def nanogpt(q, k, v, bias):
    # karpathy/nanoGPT model.py CausalSelfAttention (slow path); also Sophia and Sassha.
    T = q.size(-2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(bias[:, :, :T, :T] == 0, float("-inf"))
    att = F.softmax(att, dim=-1)
    att = F.dropout(att, p=0.0, training=True)  # self.attn_dropout with dropout=0.0
    return att @ v


def hf_eager(q, k, v, bias):
    # transformers eager_attention_forward (Llama, Mistral, Qwen2, ...), with the additive
    # causal mask of LlamaModel._update_causal_mask (before masking_utils).
    T = q.shape[-2]
    min_value = torch.finfo(q.dtype).min
    causal_mask = torch.triu(torch.full((T, T), min_value, dtype=q.dtype), diagonal=1)
    causal_mask = causal_mask[None, None, :, :].expand(q.shape[0], 1, -1, -1)
    attn_weights = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5)
    attn_weights = attn_weights + causal_mask[:, :, :, : k.shape[-2]]
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
    attn_weights = F.dropout(attn_weights, p=0.1, training=False)
    return torch.matmul(attn_weights, v)


def gpt2(q, k, v, bias):
    # transformers GPT2Attention._attn (eager, before 4.48): a bool buffer, where(), and the
    # scale as a 0-d tensor.
    causal_bias = bias.bool()
    attn_weights = torch.matmul(q, k.transpose(-1, -2))
    attn_weights = attn_weights / torch.full([], v.size(-1) ** 0.5, dtype=attn_weights.dtype)
    query_length, key_length = q.size(-2), k.size(-2)
    causal_mask = causal_bias[:, :, key_length - query_length: key_length, :key_length]
    mask_value = torch.full([], torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype)
    attn_weights = torch.where(causal_mask, attn_weights.to(attn_weights.dtype), mask_value)
    attn_weights = F.softmax(attn_weights, dim=-1)
    attn_weights = attn_weights.type(v.dtype)
    return torch.matmul(attn_weights, v)


def llama_reference(q, k, v, bias):
    # meta-llama/llama model.py Attention.forward: triu(-inf) mask, softmax in float32.
    T = q.shape[-2]
    mask = torch.triu(torch.full((T, T), float("-inf")), diagonal=1)
    scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.shape[-1])
    scores = scores + mask.to(scores.dtype)
    scores = F.softmax(scores.float(), dim=-1).type_as(q)
    return torch.matmul(scores, v)


def timm_vit(q, k, v, bias):
    # timm Attention.forward (fused_attn=False): ViT, DeiT. Not causal; scale on q.
    q = q * q.shape[-1] ** -0.5
    attn = q @ k.transpose(-2, -1)
    attn = attn.softmax(dim=-1)
    attn = F.dropout(attn, 0.0)  # self.attn_drop
    return attn @ v


def arange_mask(q, k, v, bias):
    # x-transformers / lucidrains style: mask from arange comparisons, where(), .mT.
    i = torch.arange(q.shape[-2], device=q.device)
    j = torch.arange(k.shape[-2], device=q.device)
    causal = j[None, :] > i[:, None]
    sim = (q @ k.mT) * q.shape[-1] ** -0.5
    sim = sim.masked_fill(causal, -torch.finfo(sim.dtype).max)
    return sim.softmax(dim=-1) @ v


def bmm_3d(q, k, v, bias):
    # fairseq MultiheadAttention / older HF encoders: heads folded into the batch, bmm.
    B, H, L, E = q.shape
    q3, k3, v3 = q.reshape(B * H, L, E), k.reshape(B * H, -1, E), v.reshape(B * H, -1, v.shape[-1])
    weights = torch.bmm(q3 * E ** -0.5, k3.transpose(1, 2))
    probs = torch.softmax(weights, -1)
    return torch.bmm(probs, v3).reshape(B, H, L, -1)


def einsum_lucidrains(q, k, v, bias):
    # lucidrains x-transformers / Perceiver / imagen: einsum with spaced letters, a boolean
    # triu mask filled with -finfo.max.
    i, j = q.shape[-2], k.shape[-2]
    sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * q.shape[-1] ** -0.5
    causal_mask = torch.ones((i, j), dtype=torch.bool, device=q.device).triu(j - i + 1)
    sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)
    attn = sim.softmax(dim=-1)
    return torch.einsum("b h i j, b h j d -> b h i d", attn, v)


def einsum_sequence_major(q, k, v, bias):
    # flash-attention's tests, attention_ref: (batch, seq, heads, dim) layout throughout,
    # the scale on q; here transposed in and out so that the pattern takes (B, H, L, E).
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    scores = torch.einsum("bthd,bshd->bhts", q / math.sqrt(q.shape[-1]), k)
    attention = torch.softmax(scores, dim=-1)
    return torch.einsum("bhts,bshd->bthd", attention, v).transpose(1, 2)


def megatron_baddbmm(q, k, v, bias):
    # Megatron-LM CoreAttention (and GPT-NeoX): heads folded into the batch, the scale as
    # baddbmm's alpha over an empty buffer that beta=0 ignores, a method-spelled bmm after.
    B, H, L, E = q.shape
    q3, k3, v3 = q.reshape(B * H, L, E), k.reshape(B * H, -1, E), v.reshape(B * H, -1, v.shape[-1])
    buffer = torch.empty(B * H, L, k3.shape[1], dtype=q.dtype, device=q.device)
    scores = torch.baddbmm(buffer, q3, k3.transpose(1, 2), beta=0.0, alpha=1.0 / math.sqrt(E))
    probs = F.softmax(scores, dim=-1)
    return probs.bmm(v3).reshape(B, H, L, -1)


def baddbmm_causal_mask(q, k, v, bias):
    # BLOOM/Falcon-style baddbmm with its input added (beta=1), here a causal mask.
    B, H, L, E = q.shape
    q3, k3, v3 = q.reshape(B * H, L, E), k.reshape(B * H, -1, E), v.reshape(B * H, -1, v.shape[-1])
    mask = torch.triu(torch.full((L, L), float("-inf"), dtype=q.dtype, device=q.device), 1)
    scores = torch.baddbmm(mask.expand(B * H, L, L), q3, k3.transpose(1, 2), alpha=E ** -0.5)
    return torch.bmm(F.softmax(scores, dim=-1), v3).reshape(B, H, L, -1)


# name -> (pattern, is_causal)
def active_dropout(q, k, v, bias):
    # nanoGPT / HF GPT-2 eager in training: self.attn_dropout(att) between softmax and @ v
    probs = F.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1)
    return F.dropout(probs, p=0.1, training=True) @ v


def gemma2_eager(q, k, v, bias):
    # transformers Gemma2 eager_attention_forward: scaled scores soft-capped
    # (attn_logit_softcapping = 50), then the additive causal mask, softmax in float32.
    T = q.shape[-2]
    causal_mask = torch.triu(torch.full((T, T), torch.finfo(q.dtype).min, dtype=q.dtype), 1)
    attn_weights = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5)
    attn_weights = attn_weights / 50.0
    attn_weights = torch.tanh(attn_weights)
    attn_weights = attn_weights * 50.0
    attn_weights = attn_weights + causal_mask[None, None, :, : k.shape[-2]]
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(attn_weights, v)


def grok_capped(q, k, v, bias):
    # xai-org grok-1 (and its PyTorch ports): 30 * tanh(logits / 30) after the scale, then a
    # masked_fill with nanoGPT's causal buffer
    T = q.size(-2)
    logits = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    logits = 30.0 * torch.tanh(logits / 30.0)
    logits = logits.masked_fill(bias[:, :, :T, :T] == 0, float("-inf"))
    return F.softmax(logits, dim=-1) @ v


def bare_tanh(q, k, v, bias):
    # tanh of the scores, no factor: a cap of 1 (the op's scale multiplied by it)
    scores = torch.tanh(q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5))
    return scores.softmax(-1) @ v


# patterns with soft-capped scores: name -> (function, causal, cap); replaced by the op with
# its softcap, exact at every order against the written code
SOFTCAPPED_PATTERNS = {"gemma2_eager": (gemma2_eager, True, 50.0),
                       "grok_capped": (grok_capped, True, 30.0),
                       "bare_tanh": (bare_tanh, False, 1.0)}

# patterns that draw random numbers: replaced by the op with their dropout, which draws its
# own mask (tests/passes/test_passes.py compares with the op given the same generator state)
RANDOM_PATTERNS = {"active_dropout": (active_dropout, 0.1)}

PATTERNS = {
    "nanogpt": (nanogpt, True),
    "hf_eager": (hf_eager, True),
    "gpt2": (gpt2, True),
    "llama_reference": (llama_reference, True),
    "timm_vit": (timm_vit, False),
    "arange_mask": (arange_mask, True),
    "bmm_3d": (bmm_3d, False),
    "einsum_lucidrains": (einsum_lucidrains, True),
    "einsum_sequence_major": (einsum_sequence_major, False),
    "megatron_baddbmm": (megatron_baddbmm, False),
    "baddbmm_causal_mask": (baddbmm_causal_mask, True),
}


# ---------------------------------------------------------------------------- must not match
def linear_attention(q, k, v, bias):
    # Katharopoulos et al. linear attention: feature maps, no softmax.
    q, k = F.elu(q) + 1, F.elu(k) + 1
    kv = k.transpose(-2, -1) @ v
    normaliser = q @ k.sum(-2, keepdim=True).transpose(-2, -1)
    return (q @ kv) / normaliser


def ttt_dual_form(q, k, v, bias):
    # test-time training (TTT-Linear) dual form: a causal matmul chain without softmax.
    attn = torch.tril(q @ k.transpose(-2, -1))
    return v - attn @ v


def softmax_over_queries(q, k, v, bias):
    # normalised over the queries (dim -2), as in some slot-attention variants.
    return F.softmax(q @ k.transpose(-2, -1), dim=-2) @ v


def scale_after_softmax(q, k, v, bias):
    return (F.softmax(q @ k.transpose(-2, -1), dim=-1) * 0.5) @ v


def probabilities_returned(q, k, v, bias):
    # output_attentions=True: the probabilities leave the graph.
    probs = F.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1)
    return probs @ v, probs


def dropout_in_place(q, k, v, bias):
    # the probabilities overwritten by their dropout (nn.Dropout(inplace=True)): the op would
    # draw its own mask, but the graph's dropout writes to a tensor the rewrite removes
    probs = F.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1)
    return F.dropout(probs, p=0.1, training=True, inplace=True) @ v


def padding_mask(q, k, v, bias):
    # a mask that depends on the data (here: the input itself), not on positions: a boolean
    # key-padding mask as BERT-style encoders build it.
    keep = v[..., :1].transpose(-2, -1) > 0
    scores = (q @ k.transpose(-2, -1)).masked_fill(~keep, float("-inf"))
    return scores.softmax(-1) @ v


def soft_additive_mask(q, k, v, bias):
    # old BERT/GPT-2 style -10000.0 mask: not provably -inf.
    T = q.shape[-2]
    mask = (1.0 - torch.tril(torch.ones(T, T, dtype=q.dtype))) * -10000.0
    return F.softmax(q @ k.transpose(-2, -1) + mask, dim=-1) @ v


def bottom_right_causal(q, k, v, bias):
    # causal mask aligned bottom-right (KV cache with L < S): not the op's top-left mask.
    L, S = q.shape[-2], k.shape[-2]
    mask = bias[:, :, S - L:S, :S] == 0
    return F.softmax((q @ k.transpose(-2, -1)).masked_fill(mask, float("-inf")), dim=-1) @ v


def alibi_baddbmm(q, k, v, bias):
    # BLOOM: baddbmm(alibi, q, k, beta=1.0, alpha=1/sqrt(d)), a per-head linear bias.
    B, H, L, E = q.shape
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(H)], dtype=q.dtype)
    alibi = (slopes[:, None, None] * torch.arange(L, dtype=q.dtype)[None, None, :]).repeat(B, L, 1)
    q3, k3, v3 = q.reshape(B * H, L, E), k.reshape(B * H, -1, E), v.reshape(B * H, -1, v.shape[-1])
    scores = torch.baddbmm(alibi, q3, k3.transpose(1, 2), beta=1.0, alpha=E ** -0.5)
    return torch.bmm(F.softmax(scores, dim=-1), v3).reshape(B, H, L, -1)


def einsum_over_queries(q, k, v, bias):
    # the scores laid out (keys, queries): softmax(-1) normalises over the queries.
    scores = torch.einsum("bhqd,bhkd->bhkq", q, k)
    return torch.einsum("bhkq,bhkd->bhqd", scores.softmax(-1), v)


def relative_position_bias(q, k, v, bias):
    # a fixed (not learned) relative-position bias added to the scores.
    L = q.shape[-2]
    distance = torch.arange(L)[None, :] - torch.arange(L)[:, None]
    position_bias = torch.sin(distance.to(q.dtype))
    scores = q @ k.transpose(-2, -1) + position_bias
    return F.softmax(scores, dim=-1) @ v


_POSITION_TABLE = torch.zeros(64, 64, dtype=torch.float64, requires_grad=True)  # a "parameter"


def learned_position_bias(q, k, v, bias):
    # T5-style learned relative-position bias: the additive mask requires grad.
    table = _POSITION_TABLE[:q.shape[-2], :k.shape[-2]].to(q.dtype)
    return F.softmax(q @ k.transpose(-2, -1) + table * 0.5, dim=-1) @ v


# Spellings whose mask is not causal but is passed on as attention's attn_mask (exact
# whatever it holds): what the written code computes, at every order.
MASKED_PATTERNS = {
    "learned_position_bias": learned_position_bias,
    "padding_mask": padding_mask,
    "soft_additive_mask": soft_additive_mask,
    "bottom_right_causal": bottom_right_causal,
    "relative_position_bias": relative_position_bias,
}

def mask_under_the_cap(q, k, v, bias):
    # masked, then capped: -inf becomes -c, the masked keys are seen (not the op's order)
    T = q.size(-2)
    logits = (q @ k.transpose(-2, -1)).masked_fill(bias[:, :, :T, :T] == 0, float("-inf"))
    return F.softmax(30.0 * torch.tanh(logits / 30.0), dim=-1) @ v


MUST_NOT_MATCH = {
    "linear_attention": (linear_attention, "no softmax"),
    "ttt_dual_form": (ttt_dual_form, "no softmax"),
    "softmax_over_queries": (softmax_over_queries, "softmax over dim -2"),
    "scale_after_softmax": (scale_after_softmax, "the probabilities go to"),
    "probabilities_returned": (probabilities_returned, "used 2 times"),
    "dropout_in_place": (dropout_in_place, "dropout of the probabilities in place"),
    "alibi_baddbmm": (alibi_baddbmm, "not provably causal"),
    "einsum_over_queries": (einsum_over_queries, "does not contract the probabilities' key dim"),
    "mask_under_the_cap": (mask_under_the_cap, "before they are soft-capped"),
}
