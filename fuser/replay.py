"""Run a finished window op by op on the real device (the cold tier, and the reference).

Replay runs exactly the ops eager would have run, in program order, on the same tensor objects,
so values are bitwise eager. It skips dead work (see ``mark_needed``) and writes every live result
into the placeholder the program holds (see Note [Placeholders] in ``fuser.window``).
"""

from __future__ import annotations

from itertools import compress
from operator import not_

import torch

from .backends._common import HOST_SWAPS, launches_op
from .window import ALIAS, FRESH, VIEW, Node, Out, Window, storage_bytes

_storage_use_count = torch._C._storage_Use_Count
_untyped_storage = torch._C.TensorBase.untyped_storage  # unpatched: see adaptive_eager._patches
_expired = torch.UntypedStorage._expired
_from_weak = torch.UntypedStorage._new_with_weak_ptr
_any_autocast = torch._C._is_any_autocast_enabled


_nbytes = torch._C.StorageBase.nbytes  # the C method (adaptive_eager wraps UntypedStorage.nbytes)

def value_is_dead(out: Out) -> bool:
    """Whether nothing can observe FRESH ``out`` any more: its placeholder's storage is gone.

    The window holds no strong reference to it (Note [Weak window] in ``fuser.window``), so the
    storage lives exactly as long as something of the program's does: the placeholder, a view,
    ``.data``, or autograd's saved copy of an output (a TensorImpl of its own, no Python object)."""
    return _expired(out.storage)


def placeholder_of(out: Out, storage=None) -> torch.Tensor:
    """The program's placeholder of FRESH ``out`` if it still holds it, else a tensor over the
    same storage with the placeholder's shape and strides (what its sharers see)."""
    t = out.ref()
    if t is not None:
        return t
    if storage is None:
        storage = _from_weak(out.storage)
    shape, stride, dtype = out.meta[0], out.meta[1], out.meta[2]
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, 0, shape, stride)


def read_liveness(window: Window) -> list[Out]:
    """Set ``Out.live`` of every FRESH value and return the live ones in window order (also
    ``Window.live``, for the release: Note [Window release]). A compiled region's outputs.

    Only values are visited, never nodes, so a flush that hits a compiled region costs per value,
    not per op. A value is live while its placeholder's storage is (Note [Weak window]).

    Note [Liveness during a flush]
    Liveness is read once, at the start of the flush, but a value read live can still die before
    it is bound: when only a reference cycle held it (a frame kept by a traceback, an object that
    points at itself), the garbage collector frees it whenever it runs, and it runs on any
    allocation, which the ops replayed or the compile of the window's region make plenty of.
    Nothing can observe such a value any more, so ``_bind`` drops it (its result stays the
    ``Out``'s value for the window's later ops). It must not fail: a compiled region that writes
    its inputs in place (Note [In-place regions] in ``fuser.compilable``) has already written them
    when its outputs are bound, and the replay that follows a failed run would write them twice."""
    live = window.live = list(compress(window.fresh, map(not_, map(_expired, window.handles))))
    for o in live:  # the others keep ``Out.live`` False, as they were made
        o.live = True
    return live


def mark_needed(window: Window) -> int:
    """Mark the nodes whose results can be observed; return how many compute nodes are dead.

    A node is needed if it mutates something (the program sees its arguments), if one of its fresh
    values can still be observed (``Out.live``, as ``read_liveness`` found it: read once per flush,
    before this), or if a needed node reads one of its values.
    """
    dead = 0
    for node in reversed(window.nodes):
        if node.is_view:
            needed = any(o.needed for o in node.outs)
        else:
            # a mutating op is always needed (its fresh outputs, BatchNorm's, are written to their
            # placeholders only if live)
            needed = node.mutates
            for o in node.outs:
                if o is not None and o.kind == FRESH and (o.live or o.needed):
                    needed = True
        node.needed = needed
        if needed:
            index = node.index
            for inp in node.inputs:
                inp.needed = True
                if inp.last < index:  # the walk is backwards: the first needed reader is the last
                    inp.last = index
        elif not node.is_view:
            dead += 1
    return dead


def _resolve(x):
    if type(x) is Out:
        return x.value
    if type(x) is list:
        return [_resolve(a) for a in x]
    return x


class as_recorded:
    """Run ops the way they were recorded: below autograd (the graph was built at record time;
    running them above it again would build a second one and bump version counters) and with
    autocast off (autocast sits above the dispatch mode, so recorded ops are already cast)."""

    __slots__ = ("guards",)

    def __enter__(self):
        self.guards = [torch._C._AutoDispatchBelowADInplaceOrView()]
        if _any_autocast():  # one call, where asking cpu and cuda cost ~7 us a flush
            self.guards.append(
                torch._C._ExcludeDispatchKeyGuard(
                    torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
                    | torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA)
                )
            )
        for g in self.guards:
            g.__enter__()

    def __exit__(self, *exc):
        for g in reversed(self.guards):
            g.__exit__(*exc)


class ReplayError(Exception):
    """Internal: wraps the failure of one node so the caller can re-raise it with user context."""

    def __init__(self, node: Node, error: BaseException):
        super().__init__(str(error))
        self.node = node
        self.error = error


_resize_storage = torch._C.StorageBase.resize_
RELEASE_BYTES = 1 << 20  # Note [Placeholder memory at a compiled run]
_RELEASING = ("cpu", "cuda")

# Note [Placeholder memory at a compiled run]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A placeholder holds real memory from the op that recorded it (Note [Placeholders]); a compiled
# region allocates its outputs anew, and binding adopts each output's storage and frees the
# placeholder's. Left so, every flush holds each live value twice while its region runs and frees
# one copy after: on CPU, glibc's malloc returns the freed top of its heap to the system (its
# trim threshold), and the next step's allocations fault those pages in again. The MLP step
# (3x Linear(1024), batch 64, SGD: its three 4 MiB weight gradients are the window's live values)
# took ~960 minor page faults per step under adaptive eager against eager's 0.
# So before the run, the storage of each live placeholder that holds at least ``RELEASE_BYTES``
# and that nothing but the placeholder uses (no view, no ``.data``, no autograd copy, no stolen
# gradient: the use count ``_bind``'s adoption reads) is resized to 0: its memory goes back to the
# allocator, and the region's outputs take it. Nothing reads a placeholder while its window runs
# (every Python-level read waits for the run: Note [Reads from other threads]); ``_bind`` then
# adopts the result's storage, or, where it copies or swaps (a result in another layout), gives
# the placeholder its memory back first; a run, a check or a binding that raises gives back all
# of it (``restore_placeholders``) before the replay or the NaN of a failed flush writes there.
# Smaller storages are left: each release is a call, and malloc serves small sizes from its bins.
# Only the CPU and CUDA allocators are asked (``_RELEASING``): the emulated ``neuron`` device's
# wrapper storage refuses a resize (its region was blacklisted at the first try), and a real
# device's allocator is not known here.
# (An ATen op in a thread without the mode reads a pending placeholder's memory unguarded: not
# covered, Note [Reads from other threads]. During the run it meets an empty storage and may fail
# or crash, where it read unwritten memory before.)


def release_placeholders(live: list[Out], released: list) -> None:
    """Before a compiled run: give back the memory of each large placeholder that nothing else
    shares (Note [Placeholder memory at a compiled run]), listed in ``released`` before its resize
    (a Ctrl-C between the two leaves nothing for ``restore_placeholders`` to miss)."""
    for o in live:
        storage = _from_weak(o.storage)
        if storage is None:
            continue
        n = _nbytes(storage)
        # this storage object and the placeholder's TensorImpl: no view, no autograd copy; and an
        # allocator that takes the memory back (not a wrapper's empty storage: Note [Emulated storage])
        if n >= RELEASE_BYTES and _storage_use_count(storage._cdata) <= 2 and storage.device.type in _RELEASING:
            released.append((storage, n))
            _resize_storage(storage, 0)


def restore_placeholders(released: list) -> None:
    """A compiled run that released placeholders failed: their memory back before a replay."""
    for storage, n in released:
        if _nbytes(storage) < n:
            _resize_storage(storage, n)


def _bind(out: Out, result: torch.Tensor) -> int:
    """Make ``result`` the value of ``out``'s placeholder; return the copy launches it took."""
    if not out.live:  # only later ops of this window read it: never written to the placeholder
        out.value = result
        return 0
    storage = _from_weak(out.storage)
    if storage is None:  # it died during this flush: Note [Liveness during a flush]
        out.value = result
        return 0
    if not _nbytes(storage) and result.numel():  # released for the run, and not adopted: back first
        _resize_storage(storage, storage_bytes(out.meta))
    placeholder = out.ref()
    if result.dtype is out.meta[2]:
        # the storage object ``storage`` and each TensorImpl over it count one; a result in
        # another layout (a compiled kernel's choice) is copied: the program saw the placeholder's
        # strides, which are eager's (Note [Eager layouts] in adaptive_eager._meta)
        if placeholder is not None and _storage_use_count(storage._cdata) <= 2 and result.stride() == out.meta[1]:
            # Only the placeholder uses its (never written) storage: adopt the result's storage
            # instead of copying it. Every holder of this TensorImpl sees the new storage.
            placeholder.set_(_untyped_storage(result), result.storage_offset(), result.size(), result.stride())
            out.value = placeholder
            return 0
        # Views of the placeholder, a stolen gradient, or autograd's saved copy of an output
        # share its storage: Note [Storage swap].
        if _swap_storages(storage, result, out.meta):
            out.value = placeholder_of(out, storage)
            return 0
    out.value = placeholder_of(out, storage).copy_(result)
    return 1


_swap_data_ptr = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)


def _swap_storages(storage, result: torch.Tensor, meta) -> bool:
    """Give a placeholder's ``storage`` the memory of ``result``'s, when that is the same as copying.

    Note [Storage swap]
    A placeholder whose storage is shared (views the program holds, autograd's saved copy of an
    output, a gradient ``AccumulateGrad`` stole) cannot adopt the result's storage with ``set_``:
    only its own TensorImpl would follow. Swapping the two storages' memory moves every sharer at
    once, with no copy. That is the copy exactly when the result has the placeholder's dtype,
    size, strides and offset (0), its storage is as large and nothing else uses it (after the
    swap it holds the placeholder's unwritten memory and is dropped). Nobody can have seen the
    placeholder's address before: ``data_ptr`` and every other raw read flushes first (Note
    [Placeholders]). Torch releases without ``UntypedStorage._swap_data_ptr_`` (2.11) copy."""
    if _swap_data_ptr is None or result.dtype is not meta[2] or result.storage_offset() != 0:
        return False
    if type(result) is not torch.Tensor:
        # a wrapper subclass's storage holds no memory: its device swaps the memory behind it, or
        # nothing (Note [Emulated storage] in adaptive_eager.neuron_emulation)
        host = HOST_SWAPS.get(result.device.type)
        pair = None if host is None else host(storage, result)
        return pair is not None and type(pair[1]) is torch.Tensor and _swap_storages(*pair, meta)
    if tuple(result.size()) != tuple(meta[0]) or tuple(result.stride()) != tuple(meta[1]):
        return False
    rs = _untyped_storage(result)
    # the result's TensorImpl and the storage object ``rs``: nothing else holds that memory
    if _nbytes(storage) != _nbytes(rs) or _storage_use_count(rs._cdata) > 2 or storage.device != rs.device:
        return False
    _swap_data_ptr(storage, rs)
    return True


def _finish(out: Out, result) -> int:
    if out.kind == ALIAS:
        out.value = out.alias.value if type(out.alias) is Out else out.alias
        return 0
    return _bind(out, result)


def replay_window(window: Window) -> int:
    """Run the needed nodes of ``window`` in order; return how many ops were launched.

    Must be called with the tracer's mode disabled. Raises ``ReplayError`` for the first node that
    fails.
    """
    with as_recorded():
        return _replay(window)


def _replay(window: Window) -> int:
    launched = 0
    for node in window.nodes:
        if not node.needed:
            continue
        args = [a.value if type(a) is Out else (_resolve(a) if type(a) is list else a) for a in node.args]
        if node.is_view:
            # the window holds views weakly (Note [Weak window]): a later op reading one gets it
            # made again from its input's value (a live root's value is its placeholder, so
            # that is the memory a view the program holds sees)
            res = node.func(*args, **node.kwargs)
            for o, r in zip(node.outs, res if isinstance(res, (list, tuple)) else (res,)):
                o.value = r
            _drop_last_reads(node)
            continue
        try:
            if node.kwargs:
                result = node.func(*args, **{k: _resolve(v) for k, v in node.kwargs.items()})
            else:
                result = node.func(*args)
        except Exception as e:
            raise ReplayError(node, e) from e
        launched += launches_op(node.func)  # an ``_unsafe_view`` launches nothing
        outs = node.outs
        if len(outs) == 1 and not isinstance(result, (list, tuple)):
            if outs[0] is not None:
                launched += _finish(outs[0], result)
        else:
            for o, r in zip(outs, result):
                if o is not None:
                    launched += _finish(o, r)
        _drop_last_reads(node)
    return launched


def _drop_last_reads(node: Node) -> None:
    """Let go of the values ``node`` was the last needed reader of, as eager frees a temporary
    once nothing refers to it: replay's peak memory is eager's, not every intermediate of the
    window at once (which also made each new intermediate fresh, unfaulted memory: the suite's
    10-op chain on 4M floats replayed in 35 ms against eager's 15 ms). A live value stays: the
    program holds it, and ``value`` is its placeholder."""
    index = node.index
    for inp in node.inputs:
        if inp.last == index and not inp.live:
            inp.value = None


__all__ = ["replay_window", "mark_needed", "read_liveness", "value_is_dead", "placeholder_of", "ReplayError", "FRESH",
           "ALIAS", "VIEW"]
