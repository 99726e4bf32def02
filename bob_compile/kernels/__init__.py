"""The kernels behind the attention ops, and the choice between them.

Contract shared by every implementation (`reference`, `blockwise`, `triton_attention`):
- inputs are 4-D: q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev), any strides;
  Hkv divides Hq (grouped-query attention: query head h reads key/value head h // (Hq/Hkv));
- `causal` masks are aligned top-left like PyTorch (query i sees keys j <= i);
- lse is in the accumulation dtype (float32 for half inputs), natural log, -inf on rows
  that see no key (whose outputs are 0, never NaN);
- outputs are dense tensors of their own (contiguous, or, for forward/backward, laid out
  like their primal: layout.py), in their primal's dtype; ops.py gives each its final layout;
- optional cotangents/tangents may be None, meaning zero: implementations skip that work.

Functions (names and argument order are the same in every implementation; `params` is an
AttentionParams (params.py): scale, causal and an optional mask tensor, never
differentiated, that every function applies where it forms the scores):
    forward(q, k, v, params) -> (o, lse)
    forward_output(q, k, v, params) -> o             for calls nothing will differentiate
    backward(q, k, v, o, lse, do, dlse, params) -> (dq, dk, dv)
    bob(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, params)
        -> (gq, gk, gv, go, glse, gdo, gdlse)         the VJP of `backward`
    bob_folded(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, dq, params)
        -> (gq, gk, gv, gdo, gdlse)                   the same where o, lse = forward(q, k, v)
                                                      (and dq, if given, = backward(...)'s)
    forward_jvp(q, k, v, o, lse, tq, tk, tv, params) -> (to, tlse)
    backward_jvp(q, k, v, o, lse, do, dlse, tq, tk, tv, to, tlse, tdo, tdlse, params)
        -> (tdq, tdk, tdv)
and, for a mask that the derivatives take as an input (a learned bias), its cotangents in
the mask's own shape (params.mask_own_shape: 1 on its broadcast, stride-0, dims):
    backward_bias(q, k, v, o, lse, do, dlse, params) -> (dq, dk, dv, dmask)
    bob_folded_bias(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, gdmask, dq, params)
        -> (gq, gk, gv, gdo, gdlse, gmask)

Adding an attention parameter (a sliding window, say; the mask went this way): a field of
AttentionParams (params.py); its read in each implementation's six functions (reference,
blockwise, triton_attention); in Triton, a kernel parameter passed by name at each launch site (and, for a tensor, its
stride group in the kernel's `strides_of` declaration: launching.py); in
bob_compile/ops.py the ops' arguments and `call_*`'s AttentionParams; in
bob_compile/autograd.py what the Functions save.

`select(q, k, v)` picks the Triton kernels for CUDA tensors they support, and the
memory-efficient `blockwise` PyTorch path everywhere else. BOB_COMPILE_KERNELS=blockwise
(or =reference, for debugging at small sizes) forces a choice. Like every environment switch
of the kernels it is read once (`settings.py`; `settings.reload()` after changing it
in-process).
"""
import importlib
import logging

from . import blockwise, reference, settings
from .params import AttentionParams  # noqa: F401  (the contract's parameter bundle)

log = logging.getLogger("bob_compile.kernels")

_IMPLEMENTATIONS = {"blockwise": blockwise, "reference": reference}
_triton_module = None
_triton_import_failed = False


def _triton():
    """The Triton implementation module, or None where Triton cannot be imported."""
    global _triton_module, _triton_import_failed
    if _triton_module is None and not _triton_import_failed:
        try:
            _triton_module = importlib.import_module(".triton_attention", __name__)
        except ImportError as e:
            _triton_import_failed = True
            log.warning("Triton attention kernels unavailable (%s); using the blockwise PyTorch path", e)
    return _triton_module


def call_path(q, k, v, scale, causal):
    """For 4-D inputs without a mask: the Triton module's CallPath (what it runs for this call
    signature, decided once) where select() picks that module; else None."""
    if not q.is_cuda:
        return None
    tri = _triton()
    return None if tri is None else tri.call_path(q, k, v, scale, causal)


def fold_bob(q, k, v):
    """Whether the BoB of a first backward on these inputs runs in the folded form
    (`bob_folded`: the cotangents of o and lse folded into those of q, k, v, so that no
    second backward runs; docs/second-order.md) rather than the chain form (`bob`).
    BOB_COMPILE_DEV_BOB_FORM=folded|chain decides; auto (the default) folds except where the
    Triton kernels' folded row pass is measured slower (triton_attention.folded_bob_pays).
    The atomic BoB schedule exists in the chain form only, so it implies the chain form."""
    s = settings.current()
    if s.bob_row_atomics or s.bob_form == "chain":
        return False
    if s.bob_form == "folded":
        return True
    on_triton = s.kernels == "triton" or (s.kernels is None and q.is_cuda)
    tri = _triton() if on_triton else None
    return tri is None or tri.folded_bob_pays(q, v)


def select(q, k, v):
    """The implementation module for these inputs (see the module docstring)."""
    forced = settings.current().kernels
    if forced is not None:
        # settings.KERNELS is checked when the settings are read
        return _triton() if forced == "triton" else _IMPLEMENTATIONS[forced]
    if q.is_cuda:
        tri = _triton()
        if tri is not None and tri.supports(q, k, v):
            return tri
    return blockwise
