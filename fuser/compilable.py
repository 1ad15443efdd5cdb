"""Which windows may be compiled, and which may be compiled to write their inputs in place."""

from __future__ import annotations

import torch

from .partition import is_check
from .window import Out, Window

_untyped_storage = torch._C.TensorBase.untyped_storage


def _inputs_alias(window: Window) -> bool:
    """Whether a written real input shares storage with another real input.

    The graph treats each slot as its own buffer; two slots over one storage with a write through
    one of them (``p`` and ``p.view(-1)``) cannot be expressed, so such windows are replayed.
    """
    if not window.mutated:
        return False
    seen: dict[int, int] = {}
    mutated_storages = set()
    for slot, t in enumerate(window.real_inputs):
        sid = _untyped_storage(t)._cdata
        if slot in window.mutated:
            mutated_storages.add(sid)
        seen[sid] = seen.get(sid, 0) + 1
    return any(seen[s] > 1 for s in mutated_storages)


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
# ``_fast._hot_slot``, demotes on it), and such a window replays (``fuser.regions.run``), counted
# ``conj_or_neg_input``, while the same structure without the bit runs compiled.


def _not_compilable(window: Window) -> str | None:
    if _inputs_alias(window):
        return "aliased_inputs"
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
