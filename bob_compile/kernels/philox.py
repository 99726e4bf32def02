"""Philox-2x32-7, the counter-based generator attention dropout's keep mask is drawn from
(Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3", SC 2011), in
plain PyTorch: the CPU path and the oracle regenerate, bit for bit, the mask the Triton
kernels draw (triton_dropout.py has the same rounds), from a key and a counter, without
storing it.

One call maps a 64-bit counter (c0, c1) and a 32-bit key k to two 32-bit words, in seven
rounds of: (hi, lo) = the 64-bit product 0xD256D193 * c0; (c0, c1) = (hi ^ k ^ c1, lo); then
the key grows by 0x9E3779B9. Why 2x32 and not Triton's 4x32 (tl.randint4x): dropout.py.

Why seven rounds, not Random123's default ten: the mask is regenerated in every pass of a
step, and on an H100 a dropout step at 16K causal took 18.7 ms with ten rounds, 16.6 with
four and 15.2 with one (docs/measurements.md, "Philox rounds"): the rounds are a third of
what dropout costs. Seven keep a margin over what tells the output from random: flipping
any one bit of the counter or the key flips each output bit with probability 1/2 within
sampling error (|z| < 4 over all 96 x 64 bit pairs, 2**20 samples) from five rounds on,
while four rounds are far off (|z| = 59); tests/kernels/test_dropout.py checks this. PyTorch's
own CUDA flash-attention draws its dropout with Philox-4x32 of seven rounds too.
Random123's known answers (ten rounds) check the round function itself.

A product of two 32-bit words needs 64 unsigned bits: int64 multiplication wraps modulo
2**64, so its bit pattern is that product's, and both words are read from the one
multiplication (an arithmetic shift then a mask gives the high word).
"""

ROUNDS = 7
MULTIPLIER = 0xD256D193
KEY_STEP = 0x9E3779B9
_WORD = 0xFFFFFFFF


def philox2x32(key, c0, c1, rounds=ROUNDS):
    """The two words (int64 tensors in [0, 2**32)) of Philox-2x32 at counters (c0, c1)
    (int64 tensors in [0, 2**32)) under `key` (a Python int, or an int64 tensor, in
    [0, 2**32)), after `rounds` rounds."""
    for _ in range(rounds):
        product = MULTIPLIER * c0
        c0, c1 = ((product >> 32) & _WORD) ^ key ^ c1, product & _WORD
        key = (key + KEY_STEP) & _WORD
    return c0, c1
