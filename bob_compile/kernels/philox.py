"""Philox-2x32-10, the counter-based generator attention dropout's keep mask is drawn from
(Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3", SC 2011), in
plain PyTorch: the CPU path and the oracle regenerate, bit for bit, the mask the Triton
kernels draw (triton_dropout.py has the same rounds), from a key and a counter, without
storing it.

One call maps a 64-bit counter (c0, c1) and a 32-bit key k to two 32-bit words, in ten
rounds of: (hi, lo) = the 64-bit product 0xD256D193 * c0; (c0, c1) = (hi ^ k ^ c1, lo); then
the key grows by 0x9E3779B9. Ten rounds is Random123's default (seven already pass
TestU01's BigCrush; tests/kernels/test_dropout.py checks Random123's known answers). Why 2x32
and not Triton's 4x32 (tl.randint4x): dropout.py.

A product of two 32-bit words needs 64 unsigned bits: int64 multiplication wraps modulo
2**64, so its bit pattern is that product's, and both words are read from the one
multiplication (an arithmetic shift then a mask gives the high word).
"""

ROUNDS = 10
MULTIPLIER = 0xD256D193
KEY_STEP = 0x9E3779B9
_WORD = 0xFFFFFFFF


def philox2x32(key, c0, c1):
    """The two words (int64 tensors in [0, 2**32)) of Philox-2x32-10 at counters (c0, c1)
    (int64 tensors in [0, 2**32)) under `key` (a Python int in [0, 2**32))."""
    for _ in range(ROUNDS):
        product = MULTIPLIER * c0
        c0, c1 = ((product >> 32) & _WORD) ^ key ^ c1, product & _WORD
        key = (key + KEY_STEP) & _WORD
    return c0, c1
