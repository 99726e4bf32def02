"""`F.multi_head_attention_forward` with its softmax attention computed by
`bob_compile.attention`: what nn.MultiheadAttention and nn.Transformer* layers compute.

Dynamo records those modules' attention as one `F.multi_head_attention_forward` call; the
flashbob backend puts `multi_head_attention` in its place where that is exact
(bob_compile/passes/multi_head_forward.py): the attention weights are not used, there is no
key_padding_mask, and the attention mask is absent or causal; dropout goes to the op.
"""
import torch
import torch.nn.functional as F

from .attention import attention


def multi_head_attention(query, key, value, num_heads, in_proj_weight, in_proj_bias,
                         out_proj_weight, out_proj_bias, *, separate_proj_weights=None,
                         bias_k=None, bias_v=None, add_zero_attn=False, is_causal=False,
                         dropout_p=0.0):
    """`F.multi_head_attention_forward(...)` with need_weights=False and no key_padding_mask:
    `(attn_output, None)`; dropout_p: the attention dropout in training (the op's).

    query (L, N, E), key (S, N, Ek), value (S, N, Ev), or unbatched (L, E), (S, Ek), (S, Ev).
    in_proj_weight (3E, E) packs the q, k, v projections; where kdim or vdim differ from E,
    nn.MultiheadAttention passes them as separate_proj_weights = (q_proj_weight,
    k_proj_weight, v_proj_weight) instead. in_proj_bias (3E) is packed either way.
    bias_k, bias_v (1, 1, E) and add_zero_attn append one key/value each, in that order,
    after the S projected ones. is_causal: query i attends to keys j <= i (SDPA's
    top-left alignment)."""
    q, k, v = _in_projection(query, key, value, in_proj_weight, in_proj_bias,
                             separate_proj_weights)
    batched = query.dim() == 3
    if not batched:  # a batch of one, dropped again at the end
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    length, batch, embed_dim = q.shape
    if bias_k is not None:
        k = torch.cat([k, bias_k.expand(1, batch, embed_dim)])
        v = torch.cat([v, bias_v.expand(1, batch, embed_dim)])
    if add_zero_attn:
        k = torch.cat([k, k.new_zeros(1, batch, embed_dim)])
        v = torch.cat([v, v.new_zeros(1, batch, embed_dim)])
    out = attention(*(_split_heads(t, num_heads) for t in (q, k, v)), is_causal=is_causal,
                    dropout_p=dropout_p)
    out = F.linear(out.permute(2, 0, 1, 3).reshape(length, batch, embed_dim),
                   out_proj_weight, out_proj_bias)
    return (out if batched else out.squeeze(1)), None


def _in_projection(query, key, value, weight, bias, separate_weights):
    """The inputs times their projections: with self-attention's one input, one matmul."""
    if separate_weights is None and query is key is value:
        return F.linear(query, weight, bias).chunk(3, dim=-1)
    weights = separate_weights or weight.chunk(3)
    biases = (None,) * 3 if bias is None else bias.chunk(3)
    return tuple(F.linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))


def _split_heads(x, num_heads):
    """(L, N, E) -> (N, num_heads, L, E / num_heads): head h is features h*E/H to (h+1)*E/H."""
    return x.unflatten(-1, (num_heads, -1)).permute(1, 2, 0, 3)
