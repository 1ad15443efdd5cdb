"""Ops that run now instead of being recorded: eager fallbacks and sync points, flushing first when
they read pending data or write anything."""

from __future__ import annotations

import logging

import torch
from fuser.window import where

from ._args import _tensors
from ._flush import flush
from ._log import log
from ._metrics import METRICS
from .reasons import REASONS
from ._source import _flush_site
from ._state import TracerState, _on_target, _strided
from ._threads import _check_elsewhere

_untyped_storage = torch._C.TensorBase.untyped_storage  # unpatched (adaptive_eager._patches)

def needs_flush(st: TracerState, t: torch.Tensor) -> bool:
    """Whether reading ``t``'s memory now would see a pending write.

    A tensor is pending when it is a value of the open window (marked ``_ae``) or when its storage
    is written by a pending in-place op (a real tensor such as a parameter, or any view of it).
    Another device's tensor never is, and a sparse one may be read through its indices and values,
    which pending ops may write (Note [Tensors the mode leaves alone] in _state).
    """
    window = st.window
    if not window.nodes:
        return False
    o = getattr(t, "_ae", None)
    if o is not None and o.win is window.token:
        return True
    if not window.written or not _on_target(st, t):
        return False
    if t.layout is not _strided:
        return True
    return _untyped_storage(t)._cdata in window.written


def _reads_pending(st: TracerState, args, kwargs) -> bool:
    return any(needs_flush(st, t) for t in _tensors(args, kwargs))


def _eager(st: TracerState, f, args, kwargs, reason: str | None):
    """Run the op now, flushing first if it reads pending data or writes anything.

    A write must wait for the window even if what it writes is not pending: a pending op may read
    the old value (write-after-read).
    """
    if reason is not None:
        token = st.window.token
        for t in _tensors(args, kwargs):
            o = getattr(t, "_ae", None)
            if o is not None and o.win is not token:
                _check_elsewhere(t, o)
        pending = st.window.nodes and (f.mutates or _reads_pending(st, args, kwargs))
        if pending:
            flush(st, reason)
        elif reason == "item" and st.scalar_fast_path and args[0].dim() == 0:
            # ``step.item()``: a read of a real 0-dim CPU tensor, nothing computed for it
            METRICS.host_scalar_ops += 1
        if REASONS[reason].fallback:
            METRICS.fallback_ops[f.name] += 1
            site, inside = _flush_site(2)  # Note [Whose line]
            METRICS.fallback_sites[(f.name, reason, site, inside)] += 1
            if log.isEnabledFor(logging.INFO):
                log.info("eager op %s (%s) at %s", f.name, reason, where(site))
    METRICS.ops_eager += 1
    METRICS.launches += 1
    METRICS.eager_equivalent_launches += 1
    return f.func(*args, **kwargs)


def _touches_target(st: TracerState, f, args, kwargs) -> bool:
    if any(_on_target(st, t) for t in _tensors(args, kwargs)):
        return True
    dv = kwargs.get("device")
    if dv is not None and torch.device(dv).type == st.target:
        return True
    if f.factory and f.has_device_kw and "device" not in kwargs:
        return torch.get_default_device().type == st.target
    return False


def _reason_for_unrecordable(st, f, args, kwargs) -> str:
    """Why ``_record`` declined an op that touches the target device (for metrics and logs)."""
    for t in _tensors(args, kwargs):
        if t.layout is not _strided:
            return "sparse"  # Note [Tensors the mode leaves alone] in _state
    for t in _tensors(args, kwargs):
        if not _on_target(st, t) and not (t.dim() == 0 and t.is_cpu):
            return "device_copy"
    dv = kwargs.get("device")
    if dv is not None and torch.device(dv).type != st.target:
        return "device_copy"
    return f.reason


_FUNCTIONALIZE = torch._C.DispatchKey.Functionalize
_key_included = torch._C._dispatch_tls_is_dispatch_key_included
_key_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_set_key_excluded = torch._C._dispatch_tls_set_dispatch_key_excluded


def run_untouched(f, args, kwargs):
    """An op of no tensor the mode records, run as eager runs it (Note [Tensors the mode leaves
    alone] in _state). The Python key's fallback excludes the keys above it, functionalization
    among them, for what the mode calls; for an op with tensors that is right (their keys were
    handled above the mode), but a factory reads the exclusion itself: ``lazy``'s returns a tensor
    without its functional wrapper, whose views then fail (``as_strided`` has no lazy kernel). So a
    factory runs with functionalization not excluded, unless the program itself runs functionalized."""
    if f.factory and _key_excluded(_FUNCTIONALIZE) and not _key_included(_FUNCTIONALIZE):
        _set_key_excluded(_FUNCTIONALIZE, False)
        try:
            return f.func(*args, **kwargs)
        finally:
            _set_key_excluded(_FUNCTIONALIZE, True)
    return f.func(*args, **kwargs)
