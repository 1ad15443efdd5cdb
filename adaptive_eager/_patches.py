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
``_make_subclass`` flushes only in a hot window: outside one the value is live while its
storage is, which the Parameter holds, and ops on the Parameter read the value the window
computes into that storage (checked: ``nn.Parameter`` of a pending value, the value dropped, an
op on the Parameter: eager's value, no flush). FSDP2 makes a Parameter of each all-gathered
tensor: flushing there cost 4 flushes in 4 steps of tests/test_fsdp.py's model.
``a.data -= x``, which sets ``a.data`` to a tensor already over ``a``'s storage with ``a``'s
geometry, changes nothing and does not flush. ``as_subclass`` stashes the modes too, but its
alias is a view whose base keeps the pending tensor alive.

The wrappers are installed when the first thread turns adaptive eager on and removed when the
last one turns it off; with nothing pending they cost one thread-local read.
"""

from __future__ import annotations

import builtins
import importlib
import functools
import sys
import threading

import torch
from torch.utils._python_dispatch import _disable_current_modes

from fuser.window import FRESH

from . import _capture, _compile, _optim, _source
from ._flush import _DEFERRED, _storage_resize, apply_frees, flush
from ._ops import HOST_READERS, composite_kernel, host_read_args
from ._state import current_state
from ._threads import _flush_for_reader, pending_mark, read_on_host, sync_value

_untyped_storage = torch._C.TensorBase.untyped_storage  # unpatched (the patched one flushes)
_has_storage = torch._C._has_storage

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
    if original.__name__ in _WARNING_READERS:
        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            sync_value(self, reason, other_threads_only)
            if not self.requires_grad:
                return original(self, *args, **kwargs)
            return _warning_at_caller(original, self, args, kwargs)

        return wrapper

    if original.__name__ == "tolist":
        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            sync_value(self, reason, other_threads_only)
            if self.is_conj() or self.is_neg():
                # C++ resolves the bit with a dispatched op (recorded: a pending copy) and then reads
                # that copy's memory: resolve it here and compute it first
                self = self.resolve_conj().resolve_neg()
                sync_value(self, reason, other_threads_only)
            return original(self, *args, **kwargs)

        return wrapper

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        sync_value(self, reason, other_threads_only)
        return original(self, *args, **kwargs)

    return wrapper


# Note [Warnings of wrapped readers]
# A warning torch's C++ raises (``TORCH_WARN``) is attributed to the innermost Python frame: in
# eager the caller's line, but with a reader wrapped here, this file's ``wrapper``. The one such
# warning among the readers: ``float(t)`` (and ``complex(t)``) of a tensor that requires grad
# ("Converting a tensor with requires_grad=True to a scalar...", ``float(loss)`` in many loops).
# So for those, and only when ``t.requires_grad``, the call's warnings are caught and issued again
# at the caller's frame, where the program's own filters (``-W error``, ``once``) apply to them as
# in eager. The capture is this thread's: a warning another thread raises meanwhile is shown where
# it was raised, under the program's filters (Note [Kernel warnings] in ``_kernel_warnings``).
_WARNING_READERS = ("__float__", "__complex__")


def _warning_at_caller(original, self, args, kwargs):
    from ._kernel_warnings import caught_warnings

    with caught_warnings() as caught:
        result = original(self, *args, **kwargs)
    for w in caught:
        _source.warn(w.message, w.category, frame=sys._getframe(2))  # the caller of ``wrapper``
    return result


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
    if not _has_storage(a) or not _has_storage(b):  # asking a raw lazy tensor crashes: Note [Tensors the mode leaves alone] in _state
        return False
    try:
        return (_untyped_storage(a)._cdata == _untyped_storage(b)._cdata and a.storage_offset() == b.storage_offset()
                and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)
    except (RuntimeError, NotImplementedError):  # no storage (a wrapper subclass): not the same
        return False


def _in_hot_window(t) -> bool:
    o = getattr(t, "_ae", None)
    return o is not None and pending_mark(o) and o.win.owner.window.hot is not None


def _storage_sharer(original, reason: str, static: bool = False):
    """``original(cls, data, ...)`` (``static``: ``_make_subclass``) or ``original(data, ...)`` makes
    something over ``data``'s memory without dispatching: ``data`` is computed first (Note [Storage
    sharers]); for ``_make_subclass``, only where its window is hot."""

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        data = args[1 if static else 0] if len(args) > (1 if static else 0) else kwargs.get("data", kwargs.get("tensor"))
        if isinstance(data, torch.Tensor) and (not static or _in_hot_window(data)):
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


def _optimizer_step_pre_hook(optimizer, args, kwargs) -> None:
    # Note [Scalar lifting] in fuser.scalars: the floats the step records from here on (its
    # hyperparameters, its bias corrections from the step count, a schedule's learning rate) are
    # runtime inputs of the window's region from its first compile
    st = current_state()
    if st is not None and st.mode is not None and st.window.lift_from is None:
        st.window.lift_from = len(st.window.scalars)


def _optimizer_step_hook(optimizer, args, kwargs) -> None:
    # Note [Step alignment]
    # A training loop that never syncs would otherwise be cut only by the
    # window cap, at a different op every step, so no window would ever repeat and nothing would
    # be compiled. Ending the window where ``optimizer.step()`` ends makes every step the same
    # window (and a step longer than the cap is cut at the same offsets every time).
    _flush_current("optimizer_step")
    st = current_state()
    if st is not None:
        # a step that recorded nothing (captured: Note [Optimizer capture] in _optim; or stepped
        # with the mode off, the thread's state kept) flushed no window, and its mark would make
        # the next program's floats an optimizer's (Note [Scalar lifting])
        st.window.lift_from = None


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


# the autograd keys of the devices adaptive eager records on (cpu, cuda, neuron: PrivateUse1)
_AUTOGRAD_KEYS = ("AutogradCPU", "AutogradCUDA", "AutogradPrivateUse1")
_library = None  # the torch.library registration of the _host_reader kernels while installed


def _python_dispatcher_on() -> bool:
    return torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher)


def _host_reader(op, where):
    composite = composite_kernel(op)

    def kernel(*args, **kwargs):
        st = current_state()
        if st is None or st.mode is None:
            # what this key runs without us: the composite, or under the Python dispatcher (Dynamo,
            # make_fx, fake tensors) the op's Python decomposition where it has one
            if _python_dispatcher_on():
                return op.decompose(*args, **kwargs)
            return composite(*args, **kwargs)
        if read_on_host(op, where, args, kwargs):
            with _disable_current_modes():
                return composite(*args, **kwargs)
        return composite(*args, **kwargs)

    return kernel


def _register_host_readers() -> None:
    """Note [Composites that read memory] in _ops: once a process (registering them at every
    outermost ``adaptive_eager()`` and removing them at its exit cost ~0.5 ms a block); a thread
    without the mode, or the program after the block, runs the op's own composite through them."""
    global _library
    if _library is not None:
        return
    _library = torch.library.Library("aten", "IMPL")
    for name in HOST_READERS:
        _, packet, overload = name.split(".")
        op = getattr(getattr(torch.ops.aten, packet), overload)
        kernel = _host_reader(op, host_read_args(op))
        name = packet if overload == "default" else f"{packet}.{overload}"
        for key in _AUTOGRAD_KEYS:  # the alias key ``Autograd`` would lose to the composite kernel
            _library.impl(name, kernel, key)


# Note [Storage resize]
# ~~~~~~~~~~~~~~~~~~~~~
# FSDP2 frees each parameter's unsharded storage after its forward and backward
# (``UntypedStorage.resize_(0)``) and allocates it again before the next all-gather
# (``resize_(nbytes)`` of the empty storage, if ``storage.size()`` says it is empty), both
# eagerly. A pending op that reads or writes the storage's memory must run before that memory
# goes; no other pending op can see the resize, which changes no tensor's metadata. The window's
# real tensors are all the real memory its ops read or write (``Window.real_inputs``, Note
# [Placeholders] in fuser.window), and ``Window.written`` every storage they write; a pending
# value's own storage cannot reach ``resize_`` unflushed (``untyped_storage()`` of it flushes).
# - A free of a storage the open window holds waits for the window (``Window.frees``): the
#   storage keeps its memory until the window has run (``_flush.apply_frees``), then is freed as eager freed
#   it. Meanwhile it says what eager's would: ``nbytes()``, ``size()`` and ``len()`` are 0
#   (``_flush._DEFERRED``, read by every thread); nothing else of it is observable: its tensors are
#   views FSDP2 reads only after the next allocation, and ``data_ptr`` of a tensor flushes.
#   Flushing there instead cost a window per free: 4 of 11 a step in tests/test_fsdp.py's model
#   (17 in its 4 steps), each followed a few ops later by the next all-gather's (a collective).
# - FSDP2 takes the storage with ``tensor.untyped_storage()``, which flushes when pending ops
#   write that storage (a raw reader of it could read its memory). Inside FSDP2's own
#   ``free_storage``/``alloc_storage`` (``_fsdp_storage_helper``: they call ``size()`` and
#   ``resize_`` on it, nothing else) a real tensor's storage is handed out without that flush; a
#   placeholder's still flushes (its memory gets the value at the flush). They are patched when
#   adaptive eager turns on if FSDP2 is imported by then; if not, its frees flush as before.
# - An allocation of such a storage to the size it had (FSDP2's next all-gather) takes the free
#   back: the storage keeps its memory, which eager would have left uninitialized, and the ops
#   recorded before the free still read it (in eager they read it before the free too). Any other
#   resize of it runs the window first (the free happens), then the resize.
# - A free of a storage the window does not hold, and an allocation or growth, happen now; a
#   growth of a storage the window holds runs it first (the bytes move to new memory).
# Only the calling thread's window is considered (as for every entry point here); a free of a
# storage another thread's window holds is not deferred.
_storage_nbytes = torch.UntypedStorage.nbytes  # the C method (patched while installed)


def _holds_storage(window, storage, *_) -> bool:
    sid = storage._cdata
    return sid in window.written or any(_untyped_storage(t)._cdata == sid for t in window.real_inputs)


def _resize_wrapper(original):
    @functools.wraps(original)
    def resize_(self, size):
        sid = self._cdata
        window = _DEFERRED.get(sid)
        if window is not None:  # its free waits for ``window``
            st = current_state()
            if st is not None and st.window is window and sid in window.frees and size == _storage_nbytes(self):
                del window.frees[sid]  # allocated again as it was: the free is taken back
                del _DEFERRED[sid]
                return self
            owner = window.token.owner
            if owner is st:
                flush(st, "storage")
            else:
                _flush_for_reader(owner, None)
            apply_frees(window)  # it ran (or was running: its frees wait for nothing now)
        st = current_state()
        if st is None or st.mode is None:
            return original(self, size)
        window = st.window
        if window.nodes and _holds_storage(window, self):
            if size == 0 and _storage_nbytes(self):
                window.frees[sid] = self
                _DEFERRED[sid] = window
                return self
            flush(st, "storage")
        with _disable_current_modes():
            return original(self, size)

    return resize_


def _nbytes(self):
    return 0 if self._cdata in _DEFERRED else _storage_nbytes(self)


_handles = threading.local()  # ``only``: FSDP2's storage helper is running (Note [Storage resize])


def _fsdp_storage_helper(original):
    """FSDP2's ``free_storage(tensor)`` / ``alloc_storage(tensor)`` take ``tensor.untyped_storage()``
    for its ``size()`` and ``resize_`` only, reading no memory: while they run, the storage of a real
    tensor that pending ops write is handed out without the flush ``untyped_storage()`` makes for a
    raw reader, so that its free can wait for the window (Note [Storage resize]); a pending
    tensor's own storage still flushes."""

    @functools.wraps(original)
    def helper(tensor):
        _handles.only = True
        try:
            return original(tensor)
        finally:
            _handles.only = False

    return helper


def _storage_reader(original):
    """``Tensor.untyped_storage``: flushes as the other raw readers do (``_reader``), except for a
    real tensor inside FSDP2's storage helpers (``_fsdp_storage_helper``)."""
    @functools.wraps(original)
    def untyped_storage(self, *args, **kwargs):
        if getattr(_handles, "only", False):
            o = getattr(self, "_ae", None)
            # real memory: no mark, or the mark of an in-place write or a view of a real tensor
            # (``Out.slot``), not of a placeholder (Note [Out kinds] in fuser.window)
            if o is None or not pending_mark(o) or (o.kind != FRESH and o.slot >= 0):
                return original(self, *args, **kwargs)
        sync_value(self, "storage")
        return original(self, *args, **kwargs)

    return untyped_storage


# FSDP2's modules that look the storage helpers up by name (Note [Storage resize]); patched only if
# already imported when adaptive eager turns on (importing FSDP2 costs more than its flushes)
_FSDP_HELPERS = (("torch.distributed.fsdp._fully_shard._fsdp_param", ("free_storage", "alloc_storage")),
                 ("torch.distributed.fsdp._fully_shard._fsdp_param_group", ("alloc_storage",)))


def _fsdp_points():
    points = []
    for module_name, names in _FSDP_HELPERS:
        module = sys.modules.get(module_name)
        for name in names:
            original = getattr(module, name, None)
            if callable(original) and original.__name__ == name:
                points.append((module, name, _fsdp_storage_helper(original)))
    return points


def _opaque_entry_points():
    """(owner, attribute name, flush reason, ``uses`` or None) of every C++ function that must run eagerly."""
    points = [(torch.UntypedStorage, name, "storage", None) for name in ("_share_fd_cpu_", "_share_filename_cpu_")]
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
            if name == "untyped_storage":
                setattr(torch.Tensor, name, _storage_reader(original))  # Note [Storage resize]
                continue
            setattr(torch.Tensor, name, _reader(reason, original, name in _DISPATCHING_READERS))
        _saved[("tensor", "__repr__")] = torch.Tensor.__dict__.get("__repr__", _MISSING)
        torch.Tensor.__repr__ = _repr_wrapper(torch.Tensor.__repr__)
        _saved[("tensor", "data")] = torch.Tensor.__dict__.get("data", _MISSING)
        torch.Tensor.data = _data_property(torch._C.TensorBase.__dict__["data"])
        # Dynamo keeps the builtins it knows by identity when it is imported; imported later while
        # our print wrapper stands (autograd.Function.apply imports it at the first recorded op's
        # meta run), it knew the real print no more and warned at each graph break on a print.
        # Recording imports it in nearly every program anyway: import it first, with the real print.
        importlib.import_module("torch._dynamo")

        _saved["print"] = builtins.print
        builtins.print = _print_wrapper(builtins.print)
        _saved["breakpointhook"] = sys.breakpointhook
        sys.breakpointhook = _breakpointhook_wrapper(sys.breakpointhook)
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _saved["optimizer_hook"] = register_optimizer_step_post_hook(_optimizer_step_hook)  # Note [Step alignment]
        _saved["optimizer_pre_hook"] = register_optimizer_step_pre_hook(_optimizer_step_pre_hook)
        _optim.install((_optimizer_step_pre_hook, _optimizer_step_hook))  # Note [Optimizer capture]
        _capture.install()  # Note [Captured modules]
        _compile.install()  # Note [User torch.compile]: now if Dynamo is loaded, else at torch.compile's first call
        _saved[("attr", torch, "compile")] = torch.__dict__["compile"]
        torch.compile = _compile.watch_compile(torch.compile)
        for owner, name, reason, uses in _opaque_entry_points():
            original = getattr(owner, name)
            _saved[("attr", owner, name)] = owner.__dict__.get(name, _MISSING)  # _MISSING: inherited
            setattr(owner, name, _opaque(original, reason, uses))
        for name, patched in (("resize_", _resize_wrapper(_storage_resize)), ("nbytes", _nbytes),
                              ("__len__", _nbytes)):  # Note [Storage resize]
            _saved[("attr", torch.UntypedStorage, name)] = torch.UntypedStorage.__dict__.get(name, _MISSING)
            setattr(torch.UntypedStorage, name, patched)
        for module, name, patched in _fsdp_points():
            _saved[("attr", module, name)] = module.__dict__[name]
            setattr(module, name, patched)
        _register_host_readers()  # Note [Composites that read memory]
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
                _capture.uninstall()
            elif key == "optimizer_pre_hook":
                value.remove()
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
