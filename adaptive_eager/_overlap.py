"""Writes eager refuses from metadata alone (Note [Overlapping writes])."""

from __future__ import annotations

import torch
from fuser.window import FRESH, Window

from ._args import _tensors
from ._kernel_warnings import kernel_warnings  # the stand-ins' warnings are not eager's

_Tensor = torch.Tensor
_untyped_storage = torch._C.TensorBase.untyped_storage  # unpatched (adaptive_eager._patches)
_storage_use_count = torch._C._storage_Use_Count

# Note [Overlapping writes]
# Eager refuses some writes from metadata alone, before any kernel runs: a written tensor whose
# elements share memory (an expanded tensor: "more than one element of the written-to tensor
# refers to a single memory location"), or one that partly shares memory with an input
# (``x[1:].add_(x[:-1])``, ``x.add_(x.t())``: "some elements of the input tensor and the written-to
# tensor refer to a single memory location"). Which ops check is the kernel's own choice (``fill_``
# of an expanded tensor is fine, ``add_`` is not), so the op is run on zero stand-ins with the same
# geometry and, for the second case, the same sharing of storage among its arguments; if that run
# raises eager's overlap error, so does the op, at its line, with nothing recorded (``_record``).
# The stand-in run happens only when the metadata says eager could refuse: a written tensor with
# internal overlap (a function of its sizes and strides, so found once per signature at a
# meta-cache miss and kept as a ``_Raises`` entry), or another tensor argument over the written
# one's storage whose memory range meets it (checked per op, for mutating ops only, and only when
# another TensorImpl holds the written storage: its use count counts each TensorImpl and its one
# Python storage object, which the lookup of its id has made, as ``fuser.replay._bind`` reads it;
# so one use-count read per written tensor, then one storage lookup per further tensor argument;
# in a hot window, an op where they meet is recorded as in any window, which decides).
_has_internal_overlap = torch._debug_has_internal_overlap  # 0: no, 1: yes, 2: too hard to tell


class _Raises:
    """A meta-cache entry for a signature eager rejects from metadata: raise its error at each op."""

    __slots__ = ("exception",)

    def __init__(self, exception: BaseException):
        self.exception = exception

    def error(self) -> BaseException:
        e = self.exception
        return type(e)(*e.args)


def _extent(t: torch.Tensor) -> int:
    """Elements from a tensor's first to its last, past its storage offset."""
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0) if t.numel() else 0


def _shares_written(window: Window, args, kwargs, written: list) -> bool:
    """Whether a tensor argument, other than a written one itself, lies in the memory of a written
    one: eager's overlap status FULL or PARTIAL (``get_overlap_status`` in ATen's MemoryOverlap.cpp:
    two non-empty, non-overlapping and dense tensors whose byte ranges in one storage meet; for
    any other pair eager cannot tell and does not check). Note [Overlapping writes]."""
    # a storage held only by the written tensor and its storage object is shared with no argument
    storages = {sid for _, sid in written if _storage_use_count(sid) > 2}
    for a in _tensors(args, kwargs):
        if any(a is t for t, _ in written) or not a.numel() or _has_internal_overlap(a) != 0:
            continue
        o = getattr(a, "_ae", None)
        # a FRESH value's handle is its storage's id; a hot window's has none (Note [Hot liveness] in _hot)
        sid = o.storage if o is not None and o.win is window.token and o.kind == FRESH else None
        if sid is None:
            sid = _untyped_storage(a)._cdata
        if sid not in storages:
            continue
        start = a.storage_offset() * a.element_size()
        for t, s in written:
            if s == sid and t.numel() and _has_internal_overlap(t) == 0:
                begin = t.storage_offset() * t.element_size()
                if start < begin + t.numel() * t.element_size() and begin < start + a.numel() * a.element_size():
                    return True
    return False


def _overlap_error(f, args, kwargs, shared: bool) -> BaseException | None:
    """Eager's overlap error for this op, from a run on zero stand-ins of its arguments' geometry
    (over one buffer per storage they share when ``shared``), or None (Note [Overlapping writes])."""
    tensors = list(_tensors(args, kwargs))
    key = (lambda t: _untyped_storage(t)._cdata) if shared else id
    sizes: dict = {}  # buffer key -> (bytes, device)
    for t in tensors:
        k = key(t)
        sizes[k] = (max(sizes.get(k, (0,))[0], (t.storage_offset() + _extent(t)) * t.element_size()), t.device)
    buffers = {k: torch.zeros(n, dtype=torch.uint8, device=d).untyped_storage() for k, (n, d) in sizes.items()}

    def stand_in(t):
        if not isinstance(t, _Tensor):
            return t
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(buffers[key(t)], t.storage_offset(), t.shape,
                                                                    t.stride())

    try:
        kernel_warnings(lambda: f.func(*[[stand_in(x) for x in a] if type(a) in (list, tuple) else stand_in(a)
                                         for a in args], **{k: stand_in(v) for k, v in kwargs.items()}))
    except RuntimeError as e:
        if str(e).startswith("unsupported operation:"):  # eager's overlap checks (MemoryOverlap.cpp)
            return type(e)(*e.args)
    except Exception:  # noqa: BLE001 - a failure of the stand-ins' values is not eager's answer
        pass
    return None
