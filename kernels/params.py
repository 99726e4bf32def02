"""The attention parameters every kernel takes besides its tensors, in one place.

Each implementation's contract functions (kernels/__init__.py) take one AttentionParams
after their tensors, and read the fields they need by name, so that a new parameter (a
sliding window, a mask) is one field here and one read per implementation, and passing
scale where causal belongs (or the reverse) is an error at once, not a wrong kernel.
"""


class AttentionParams:
    """scale: the factor of the scores q·k (a float; SymFloat while tracing);
    causal: top-left causal mask (query i sees keys j <= i). Keyword-only, checked."""
    __slots__ = ("scale", "causal")

    def __init__(self, *, scale, causal):
        if causal is not True and causal is not False:
            raise TypeError(f"AttentionParams: causal must be a bool, got {causal!r}")
        if scale is True or scale is False:
            raise TypeError(f"AttentionParams: scale must be a number, got {scale!r}")
        self.scale, self.causal = scale, causal

    def __repr__(self):
        return f"AttentionParams(scale={self.scale!r}, causal={self.causal!r})"

    def __eq__(self, other):
        return isinstance(other, AttentionParams) and \
            (self.scale, self.causal) == (other.scale, other.causal)

    def __hash__(self):
        return hash((self.scale, self.causal))
