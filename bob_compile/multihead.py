"""`F.multi_head_attention_forward` with its softmax attention computed by
`bob_compile.attention`: what nn.MultiheadAttention and nn.Transformer* layers compute.

Dynamo records those modules' attention as one `F.multi_head_attention_forward` call; the
flashbob backend puts `multi_head_attention` in its place where that is exact
(bob_compile/passes/multi_head_forward.py): the attention weights are not used; masks
(attn_mask, key_padding_mask) and dropout go to the op.
"""
import torch
import torch.nn.functional as F

from .attention import attention


def multi_head_attention(query, key, value, num_heads, in_proj_weight, in_proj_bias,
                         out_proj_weight, out_proj_bias, *, separate_proj_weights=None,
                         bias_k=None, bias_v=None, add_zero_attn=False, is_causal=False,
                         attn_mask=None, key_padding_mask=None, dropout_p=0.0):
    """`F.multi_head_attention_forward(...)` with need_weights=False: `(attn_output, None)`;
    dropout_p: the attention dropout in training (the op's).

    query (L, N, E), key (S, N, Ek), value (S, N, Ev), or unbatched (L, E), (S, Ek), (S, Ev).
    in_proj_weight (3E, E) packs the q, k, v projections; where kdim or vdim differ from E,
    nn.MultiheadAttention passes them as separate_proj_weights = (q_proj_weight,
    k_proj_weight, v_proj_weight) instead. in_proj_bias (3E) is packed either way.
    bias_k, bias_v (1, 1, E) and add_zero_attn append one key/value each, in that order,
    after the S projected ones. is_causal: query i attends to keys j <= i (SDPA's
    top-left alignment), on top of the masks.
    attn_mask (L, S) or (N num_heads, L, S), key_padding_mask (N, S) or unbatched (S,), in
    nn.MultiheadAttention's conventions: bool True hides the key, floating is added to the
    scores; both apply (PyTorch adds them), and the appended keys are visible to all."""
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
    mask = _op_mask(attn_mask, key_padding_mask, batch, num_heads, q.dtype,
                    appended=(bias_k is not None) + add_zero_attn)
    out = attention(*(_split_heads(t, num_heads) for t in (q, k, v)), attn_mask=mask,
                    is_causal=is_causal, dropout_p=dropout_p)
    out = F.linear(out.permute(2, 0, 1, 3).reshape(length, batch, embed_dim),
                   out_proj_weight, out_proj_bias)
    return (out if batched else out.squeeze(1)), None


def _op_mask(attn_mask, key_padding_mask, batch, num_heads, dtype, appended):
    """The two masks as one mask of bob_compile.attention, broadcastable to (N, num_heads, L,
    S + appended): bool where both are (True: visible, SDPA's convention), else additive,
    bool entries -inf in the queries' dtype (as F._canonical_mask makes them)."""
    masks = []
    if attn_mask is not None:
        masks.append(attn_mask.unflatten(0, (batch, num_heads)) if attn_mask.dim() == 3
                     else attn_mask[None, None])
    if key_padding_mask is not None:
        masks.append(key_padding_mask.reshape(batch, 1, 1, -1))
    if not masks:
        return None
    if appended:    # the keys bias_k / add_zero_attn append are seen by every query
        masks = [F.pad(m, (0, appended), value=False if m.dtype == torch.bool else 0.0)
                 for m in masks]
    if all(m.dtype == torch.bool for m in masks):
        hidden = masks[0] if len(masks) == 1 else masks[0] | masks[1]
        return ~hidden
    additive = [torch.zeros_like(m, dtype=dtype).masked_fill_(m, float("-inf"))
                if m.dtype == torch.bool else m for m in masks]
    return additive[0] if len(additive) == 1 else additive[0] + additive[1]


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
