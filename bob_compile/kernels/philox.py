"""Triton's counter-based random numbers (Philox-4x32 with 10 rounds: `tl.randint4x`, whose
first word is `tl.randint`) in plain PyTorch, bit for bit: what an attention dropout's keep
mask is made of, so that the CPU path and the oracle regenerate the very mask a Triton kernel
draws, from a seed and a counter, without storing it.

`tl.randint4x(seed, counter)` splits the 64-bit seed into the key (low word, high word) and
runs Philox on the counter (its low word, its high word, 0, 0), returning all four words. A
product of two 32-bit words needs 64 unsigned bits: int64 multiplication wraps modulo 2**64,
so its bit pattern is that product's, and both words are read from the one multiplication
(an arithmetic shift then a mask gives the high word).
"""
import torch

ROUNDS = 10                         # tl.randint4x's default
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_WORD = 0xFFFFFFFF


def randint4x(seed, counters):
    """The four uint32 words tl.randint4x(seed, counters) returns, each as int64 in
    [0, 2**32). seed: a Python int in [0, 2**63); counters: an int64 tensor, non-negative."""
    c0 = counters & _WORD
    c1 = (counters >> 32) & _WORD
    c2 = torch.zeros_like(counters)
    c3 = torch.zeros_like(counters)
    k0, k1 = seed & _WORD, (seed >> 32) & _WORD
    for _ in range(ROUNDS):
        product_b, product_a = _ROUND_B * c2, _ROUND_A * c0
        c0, c1, c2, c3 = (((product_b >> 32) & _WORD) ^ c1 ^ k0, product_b & _WORD,
                          ((product_a >> 32) & _WORD) ^ c3 ^ k1, product_a & _WORD)
        k0, k1 = (k0 + _KEY_A) & _WORD, (k1 + _KEY_B) & _WORD
    return c0, c1, c2, c3


def randint(seed, counters):
    """tl.randint(seed, counters): randint4x's first word."""
    return randint4x(seed, counters)[0]
