"""Plain math attention: what autograd differentiates in the reference answers."""
import math

import torch


def math_attention(q, k, v, is_causal=False, scale=None, enable_gqa=False):
    """softmax(q kᵀ · scale, top-left causal mask) v, written with ordinary ops."""
    if enable_gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-2, -1) * scale
    if is_causal:
        keep = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ v
