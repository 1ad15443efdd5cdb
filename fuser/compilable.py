"""Which windows may be compiled, and which may be compiled to write their inputs in place."""

from __future__ import annotations

import torch

from .partition import is_check
from .window import Out, Window

_untyped_storage = torch._C.TensorBase.untyped_storage


# Note [Inputs over one memory]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The graph treats each real input (slot) as its own buffer. Two slots over one storage with a
# write through one of them cannot be given to it as they are: the graph would read the other
# slot's memory as it was before the window, or as the compiled code has half written it. The
# common case is a parameter's transpose: ``nn.Linear`` saves ``weight.t()`` for its backward,
# and when the forward ends in an earlier window (a ``loss.item()`` between forward and
# backward) that saved view is a real input of the window whose optimizer step writes
# ``weight``, every step. Such a slot V is *derived*: when V is not written, has W's dtype and
# storage offset and its (size, stride) pairs are W's in another order (``W.t()``, ``W.mT``,
# ``W.permute(...)``, ``W.detach()``), it covers exactly W's elements, and the graph makes it
# inside, as ``permute(W, perm)`` of W's input (``fuser.program.Program.derived``). Functionalization
# then keeps V in step with W: a read of V before W's write in program order sees W's old value,
# a read after it the new one, as eager's reads through the one memory do; V's own slot stays in
# the graph's signature, unread. Which slots are derived, and from which, is not in the window's
# signature (a real input is keyed by its shape, strides and dtype): for a window that passed a
# view (``Window.passed``: Note [Views of unwritten memory] in adaptive_eager._record), where
# shared memory is expected, every window is checked and the derived slots are part of its
# region key (``fuser.regions.run``); a window that passed none is checked at its structure's
# first sight (as whether its inputs alias at all always was), its entry keeps what was found,
# and each later window of it checks only that those slots still share their base's memory
# (``derived_hold``), else it replays. Anything else over a written storage (a slice of W, a
# second written slot, a view with another dtype) is replayed, counted ``aliased_inputs``.
def _input_aliases(window: Window) -> tuple | None:
    """The derived slots of ``window`` as ``(slot, base slot, permutation)``, () when no written
    real input shares storage with another real input, None when one does in a way the graph
    cannot express (Note [Inputs over one memory])."""
    if not window.mutated:
        return ()
    real = window.real_inputs
    groups: dict[int, list[int]] = {}
    for slot, t in enumerate(real):
        groups.setdefault(_untyped_storage(t)._cdata, []).append(slot)
    derived = []
    for slots in groups.values():
        if len(slots) < 2:
            continue
        written = [s for s in slots if s in window.mutated]
        if not written:
            continue
        if len(written) > 1:
            return None
        base = written[0]
        for s in slots:
            if s != base:
                perm = _permutation(real[s], real[base])
                if perm is None:
                    return None
                derived.append((s, base, perm))
    return tuple(derived)


def derived_hold(derived: tuple, window: Window) -> bool:
    """Whether ``window``'s real inputs are over one memory as ``derived`` says (the derived slots
    its region's first window had): a check of those slots only."""
    real = window.real_inputs
    return all(_untyped_storage(real[v])._cdata == _untyped_storage(real[w])._cdata
               and _permutation(real[v], real[w]) == perm for v, w, perm in derived)


def _permutation(v: torch.Tensor, w: torch.Tensor) -> tuple[int, ...] | None:
    """``perm`` with ``w.permute(perm)`` of ``v``'s geometry over the same memory, else None."""
    if v.dtype != w.dtype or v.dim() != w.dim() or v.storage_offset() != w.storage_offset():
        return None
    pairs = list(zip(w.shape, w.stride()))
    perm = []
    for pair in zip(v.shape, v.stride()):
        for j, p in enumerate(pairs):
            if p == pair and j not in perm:
                perm.append(j)
                break
        else:
            return None
    return tuple(perm)


def _checks(window: Window) -> bool:
    """Whether the window has ops that exist only to raise (Note [Partitions])."""
    return any(is_check(n.func) for n in window.nodes if not n.is_view)


# Ops whose results depend on grad mode: ``mkldnn_rnn_layer`` (``nn.LSTM``'s CPU kernel) returns
# the workspace its backward needs only while grad mode is on. A compiled region runs with it off
# (``below_autograd``): compiled, its workspace came back undefined and every LSTM region failed
# its first run, with a warning each. The replay runs ops below autograd's dispatch keys with grad
# mode as it is (``fuser.replay.as_recorded``), as eager's kernel runs, so such windows replay.
GRAD_MODE_OPS = frozenset({torch.ops.aten.mkldnn_rnn_layer.default})


# Note [Conjugate and negative bits]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A tensor with the conjugate or negative bit (``t.conj()``, ``t.conj().imag``, ``x._neg_view()``)
# holds its values unconjugated or unnegated in memory; eager's kernels see the bit (its fallback
# resolves it first), compiled code reads the memory: as a real input of a compiled region,
# ``t.conj().imag * 1`` came back negated. The bit is not in a window's key (a real input is keyed
# by shape, strides and dtype), so it is checked per window, not per structure: ``Window.bits``,
# set where a real input gets its slot (``Window.slot_of``; a hot window's slot check,
# ``_record._slot_differs``, demotes on it), and such a window replays (``fuser.regions.run``), counted
# ``conj_or_neg_input``, while the same structure without the bit runs compiled.


def _not_compilable(window: Window) -> str | None:
    if _writes_overlapping(window):
        return "overlapping_write"
    if any(n.func in GRAD_MODE_OPS for n in window.nodes):
        return "grad_mode_op"
    return None



_WRITES: dict = {}  # OpOverload -> the positions (and keyword names) of the arguments it writes


def _writes_overlapping(window: Window) -> bool:
    """Whether a node writes through a tensor whose elements share memory (a dimension of stride 0:
    ``x[0].expand(3, 4).fill_(2)``, which eager allows for ``fill_`` and ``zero_``). The functional
    graph makes that one value per element and writes them back through the expand's inverse, which
    sums them (``fill_(2)`` of a 3-row expand stored 6), so such windows replay. Eager refuses the
    other ops that would write so (Note [Overlapping writes] in adaptive_eager._overlap)."""
    for node in window.nodes:
        if not node.mutates or node.is_view:
            continue
        positions = _WRITES.get(node.func)
        if positions is None:
            positions = _WRITES[node.func] = tuple(
                a.name if a.kwarg_only else i for i, a in enumerate(node.func._schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write)
        for p in positions:
            arg = node.kwargs.get(p) if type(p) is str else (node.args[p] if p < len(node.args) else None)
            for x in (arg if type(arg) in (list, tuple) else (arg,)):
                meta = x.meta if type(x) is Out else (x.shape, x.stride()) if isinstance(x, torch.Tensor) else None
                if meta is not None and any(st == 0 and n > 1 for n, st in zip(meta[0], meta[1])):
                    return True
    return False


# Note [In-place regions]
# A region that writes real inputs (parameters, optimizer state, BatchNorm buffers) could return
# their new values for the fuser to copy back: one extra launch and one extra pass over memory per
# written tensor (600 copies for AdamW over 200 parameters). Instead, when the backend can
# (``writes_inputs``), the graph keeps functionalization's trailing ``copy_`` into its inputs and
# the compiled kernels store the new values in place. The price: a compiled run that fails half
# way has already written some inputs, so replaying the window (the fallback for a failed run)
# would apply those updates twice. So only windows that cannot fail at run time are compiled in
# place: no op reads an integer tensor (indices, targets: the out-of-range checks) and no op exists
# only for a check (``_linalg_check_errors``). Everything else keeps the copy-back. A backend whose
# callable stores the new values only once its executable has finished (``stores_after_run``: the
# stablehlo backend, Note [Regions that write their inputs] in fuser.backends._stablehlo_lowering)
# writes nothing in a run that fails, so any window it compiles may be compiled in place.
_INT_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


def _may_raise(node) -> bool:
    """Whether ``node`` can fail depending on data (Note [In-place regions])."""
    if not node.outs:
        return True
    for a in (*node.args, *node.kwargs.values()):
        for x in (a if type(a) in (list, tuple) else (a,)):
            if type(x) is Out:
                if x.meta is not None and x.meta[2] in _INT_DTYPES:
                    return True
            elif isinstance(x, torch.Tensor) and x.dtype in _INT_DTYPES:
                return True
    return False
