"""Sync points that the dispatcher never sees.

Some ways of reading a tensor go straight to its memory (``numpy``, ``tolist``, ``data_ptr``,
pickling, ``repr``), and some ways of observing the program do not touch tensors at all (builtin
``print``, ``breakpoint()``). While any thread has adaptive eager on, these are wrapped so that the
window the tensor is pending in is flushed first, whichever thread's (see Note [Placeholders] in
``fuser.window`` and Note [Reads from other threads] in ``_threads``), and ``print`` flushes the
calling thread's window: the value read is the eager value, and printed text keeps its eager order
relative to errors. Readers that dispatch ops (``item``, ``float``, formatting) are seen by the
calling thread's own mode; they are wrapped for reads of values pending in other threads. ``.data``,
which makes an alias without dispatching, passes a pending value's mark on to the alias.

Note [Storage sharers]
~~~~~~~~~~~~~~~~~~~~~~
A few C++ entry points give a tensor a pending value's storage without dispatching an op (so no
mode sees them) and without keeping the pending tensor's own Python object: ``_make_subclass``
(``nn.Parameter(t)``, ``nn.Buffer(t)``: a detach with every dispatch mode stashed), the ``.data``
setter (``a.data = t``: ``a``'s TensorImpl takes ``t``'s storage; ``Module._apply`` does it) and
``torch.utils.dlpack.to_dlpack`` (a capsule with the memory's address). The new tensor carries
no mark, so an op on it would read the placeholder's memory before the window computed it; and a
hot window decides a value's liveness by its Python tensor (Note [Hot liveness] in ``_hot``),
which may die while the sharer lives. So each of them flushes the window its tensor is pending
in first (and the setter also when the tensor it sets is pending: it is given other memory).
``a.data -= x``, which sets ``a.data`` to a tensor already over ``a``'s storage with ``a``'s
geometry, changes nothing and does not flush. ``as_subclass`` stashes the modes too, but its
alias is a view whose base keeps the pending tensor alive.

The wrappers are installed when the first thread turns adaptive eager on and removed when the
last one turns it off; with nothing pending they cost one thread-local read.
"""

from __future__ import annotations

import builtins
import functools
import sys
import threading

import torch
from torch.utils._python_dispatch import _disable_current_modes

from . import _optim
from ._flush import flush
from ._state import current_state
from ._threads import pending_mark, sync_value

_untyped_storage = torch._C.TensorBase.untyped_storage  # unpatched (the patched one flushes)

# Tensor methods that read memory without dispatching, with the flush reason each one counts as.
_TENSOR_READERS = {
    "numpy": "numpy",
    "tolist": "tolist",
    "__array__": "numpy",
    "__dlpack__": "numpy",
    "data_ptr": "data_ptr",
    "untyped_storage": "storage",
    "storage": "storage",
    "_typed_storage": "storage",
    "__reduce_ex__": "pickle",
    "__deepcopy__": "pickle",
    "__bool__": "bool",
}
# Readers that dispatch ops (``_local_scalar_dense``; ``__format__`` reads a ``detach()``ed alias,
# ``__iter__`` views from ``unbind``), which the calling thread's own mode sees; in a thread
# without the mode those ops reach memory (or an unmarked alias) directly.
_DISPATCHING_READERS = ("item", "__float__", "__int__", "__index__", "__complex__", "__format__", "__iter__")

_lock = threading.Lock()
_active = 0
_saved: dict = {}


def _flush_current(reason: str) -> None:
    st = current_state()
    if st is not None and st.window.nodes:
        flush(st, reason)


def _reader(reason: str, original, other_threads_only: bool = False):
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        sync_value(self, reason, other_threads_only)
        return original(self, *args, **kwargs)

    return wrapper


def _repr_wrapper(original):
    @functools.wraps(original)
    def __repr__(self, *args, **kwargs):
        sync_value(self, "repr")
        st = current_state()
        if st is None or st.mode is None:
            return original(self, *args, **kwargs)
        # The values are real now; format them eagerly instead of recording the formatting ops.
        with _disable_current_modes():
            return original(self, *args, **kwargs)

    return __repr__


def _data_property(original):
    """``t.data`` makes a TensorImpl over ``t``'s storage without dispatching. Of a pending value,
    that alias is pending too: it carries ``t``'s mark, so ops on it are recorded as reading
    ``t``'s value, and the flush writes that value where the alias sees it (its storage keeps the
    value live: Note [Weak window] in ``fuser.window``). Unmarked, an op on the alias would read
    the placeholder's memory before the window computed it."""
    get, put = original.__get__, original.__set__

    def getter(self):
        alias = get(self)
        o = getattr(self, "_ae", None)
        if o is not None and pending_mark(o):
            alias._ae = o
        return alias

    def setter(self, value):
        # Note [Storage sharers]: unless nothing changes (``a.data -= x``)
        if isinstance(value, torch.Tensor) and not _same_tensor_memory(self, value):
            sync_value(value, "storage")
            sync_value(self, "storage")
        put(self, value)

    return property(getter, setter, doc=original.__doc__)


def _same_tensor_memory(a, b) -> bool:
    """Whether ``b`` is a tensor over ``a``'s storage with ``a``'s geometry (``a.data = b`` keeps ``a`` as it is)."""
    try:
        return (_untyped_storage(a)._cdata == _untyped_storage(b)._cdata and a.storage_offset() == b.storage_offset()
                and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)
    except (RuntimeError, NotImplementedError):  # no storage (a wrapper subclass): not the same
        return False


def _storage_sharer(original, reason: str, static: bool = False):
    """``original(cls, data, ...)`` (``static``: ``_make_subclass``) or ``original(data, ...)`` makes
    something over ``data``'s memory without dispatching: ``data`` is computed first (Note [Storage sharers])."""

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        data = args[1 if static else 0] if len(args) > (1 if static else 0) else kwargs.get("data", kwargs.get("tensor"))
        if isinstance(data, torch.Tensor):
            sync_value(data, reason)
        return original(*args, **kwargs)

    return staticmethod(wrapper) if static else wrapper


def _print_wrapper(original):
    @functools.wraps(original)
    def print(*args, **kwargs):
        _flush_current("print")
        return original(*args, **kwargs)

    return print


def _breakpointhook_wrapper(original):
    @functools.wraps(original)
    def breakpointhook(*args, **kwargs):
        _flush_current("breakpoint")
        return original(*args, **kwargs)

    return breakpointhook


def _optimizer_step_hook(optimizer, args, kwargs) -> None:
    # Note [Step alignment]: a training loop that never syncs would otherwise be cut only by the
    # window cap, at a different op every step, so no window would ever repeat and nothing would
    # be compiled. Ending the window where ``optimizer.step()`` ends makes every step the same
    # window (and a step longer than the cap is cut at the same offsets every time).
    _flush_current("optimizer_step")


def _opaque(original, reason: str, uses=None):
    """C++ entry points that read tensor memory without dispatching (DDP's parameter check and
    bucket rebuild) or run ATen ops of their own on raw storage (the copy into shared memory of
    ``share_memory_`` and of ``torch.multiprocessing``'s pickling: recorded, it would be lost when
    the storage then takes the new memory): flush, then run them eagerly. ``uses(window, *args)``:
    whether the open window needs the flush (default: whenever it has ops)."""

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        st = current_state()
        if st is None or st.mode is None:
            return original(*args, **kwargs)
        if st.window.nodes and (uses is None or uses(st.window, *args)):
            flush(st, reason)
        with _disable_current_modes():
            return original(*args, **kwargs)

    return wrapper


def _index_reader(original):
    """``tensor_split(x, indices)`` with a 1-d tensor of indices reads them in C++ straight from
    memory, without dispatching (a 0-dim one goes through ``item()``, which dispatches): recorded
    with a pending tensor of indices, it would split at whatever the placeholder's memory held. So
    a pending one is computed first."""

    @functools.wraps(original)
    def tensor_split(*args, **kwargs):
        indices = args[1] if len(args) > 1 else kwargs.get(
            "tensor_indices_or_sections", kwargs.get("indices", kwargs.get("sections")))
        if isinstance(indices, torch.Tensor):
            sync_value(indices, "host_indices")
        return original(*args, **kwargs)

    return tensor_split


# Note [Storage resize]
# ~~~~~~~~~~~~~~~~~~~~~
# FSDP2 frees each parameter's unsharded storage after its forward and backward
# (``UntypedStorage.resize_(0)``) and allocates it again before the next all-gather
# (``resize_(nbytes)`` of the empty storage), both eagerly. A pending op that reads or writes the
# storage's memory must run before that memory goes (or moves: a growing storage copies its bytes
# into new memory); no other pending op can see the resize, which changes no tensor's metadata.
# The window's real tensors are all the real memory its ops read or write (``Window.real_inputs``,
# Note [Placeholders] in fuser.window), and ``Window.written`` every storage they write; a pending
# value's own storage cannot reach ``resize_`` unflushed (``untyped_storage()`` of it flushes). So
# ``resize_`` flushes only a window that holds the storage, and the other windows go on past it.


def _holds_storage(window, storage, *_) -> bool:
    sid = storage._cdata
    return sid in window.written or any(_untyped_storage(t)._cdata == sid for t in window.real_inputs)


def _opaque_entry_points():
    """(owner, attribute name, flush reason, ``uses`` or None) of every C++ function that must run eagerly."""
    points = [(torch.UntypedStorage, name, "storage", None) for name in ("_share_fd_cpu_", "_share_filename_cpu_")]
    points.append((torch.UntypedStorage, "resize_", "storage", _holds_storage))  # Note [Storage resize]
    try:
        import torch.distributed as dist
    except ImportError:
        return points
    if not dist.is_available():
        return points
    if hasattr(dist, "_verify_params_across_processes"):
        points.append((dist, "_verify_params_across_processes", "collective", None))
    reducer = getattr(torch._C._distributed_c10d, "Reducer", None)
    if reducer is not None and hasattr(reducer, "_rebuild_buckets"):
        points.append((reducer, "_rebuild_buckets", "collective", None))
    return points


def install() -> None:
    global _active
    with _lock:
        _active += 1
        if _active > 1:
            return
        for name, reason in (*_TENSOR_READERS.items(), *((n, "other_thread") for n in _DISPATCHING_READERS)):
            original = getattr(torch.Tensor, name)
            _saved[("tensor", name)] = torch.Tensor.__dict__.get(name, _MISSING)
            setattr(torch.Tensor, name, _reader(reason, original, name in _DISPATCHING_READERS))
        _saved[("tensor", "__repr__")] = torch.Tensor.__dict__.get("__repr__", _MISSING)
        torch.Tensor.__repr__ = _repr_wrapper(torch.Tensor.__repr__)
        _saved[("tensor", "data")] = torch.Tensor.__dict__.get("data", _MISSING)
        torch.Tensor.data = _data_property(torch._C.TensorBase.__dict__["data"])
        _saved["print"] = builtins.print
        builtins.print = _print_wrapper(builtins.print)
        _saved["breakpointhook"] = sys.breakpointhook
        sys.breakpointhook = _breakpointhook_wrapper(sys.breakpointhook)
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _saved["optimizer_hook"] = register_optimizer_step_post_hook(_optimizer_step_hook)  # Note [Step alignment]
        _optim.install()  # Note [Optimizer capture]
        for owner, name, reason, uses in _opaque_entry_points():
            original = getattr(owner, name)
            _saved[("attr", owner, name)] = owner.__dict__.get(name, _MISSING)  # _MISSING: inherited
            setattr(owner, name, _opaque(original, reason, uses))
        for owner in (torch, torch.Tensor):
            _saved[("attr", owner, "tensor_split")] = owner.__dict__.get("tensor_split", _MISSING)
            owner.tensor_split = _index_reader(owner.tensor_split)
        # Note [Storage sharers]
        _saved[("attr", torch.Tensor, "_make_subclass")] = torch.Tensor.__dict__.get("_make_subclass", _MISSING)
        torch.Tensor._make_subclass = _storage_sharer(torch.Tensor._make_subclass, "storage", static=True)
        import torch.utils.dlpack as dlpack

        for owner in (torch, dlpack):
            if hasattr(owner, "to_dlpack"):
                _saved[("attr", owner, "to_dlpack")] = owner.__dict__.get("to_dlpack", _MISSING)
                owner.to_dlpack = _storage_sharer(owner.to_dlpack, "numpy")


def uninstall() -> None:
    global _active
    with _lock:
        _active -= 1
        if _active > 0:
            return
        for key, value in list(_saved.items()):
            if key == "print":
                builtins.print = value
            elif key == "breakpointhook":
                sys.breakpointhook = value
            elif key == "optimizer_hook":
                value.remove()
                _optim.uninstall()
            elif key[0] == "attr":
                if value is _MISSING:
                    delattr(key[1], key[2])
                else:
                    setattr(key[1], key[2], value)
            else:
                name = key[1]
                if value is _MISSING:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, value)
        _saved.clear()


class _Missing:
    pass


_MISSING = _Missing()
