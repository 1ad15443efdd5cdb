"""Run a finished window op by op on the real device (the cold tier, and the reference).

Replay runs exactly the ops eager would have run, in program order, on the same tensor objects,
so values are bitwise eager. It skips dead work (see ``mark_needed``) and writes every live result
into the placeholder the program holds (see Note [Placeholders] in ``fuser.window``).
"""

from __future__ import annotations

import sys

import torch

from .window import ALIAS, FRESH, VIEW, Node, Out, Window

_storage_use_count = torch._C._storage_Use_Count
_untyped_storage = torch._C.TensorBase.untyped_storage  # unpatched: see adaptive_eager._patches
_getrefcount = sys.getrefcount


def placeholder_is_dead(out: Out) -> bool:
    """Whether nothing but this window can observe ``out``'s placeholder.

    Weak references are not enough: autograd saves an op's *output* as a new TensorImpl sharing the
    storage (no Python object survives), so a value the backward pass needs can look unreferenced.
    The storage use count sees those; the Python refcount sees the program's own references.
    """
    t = out.tensor
    # references: out.tensor, the local ``t``, getrefcount's argument, plus windows' extra holds
    if _getrefcount(t) > 3 + out.held:
        return False
    if t._use_count() > 1:  # another TensorImpl owner (a view's base link, an autograd input save)
        return False
    if not t.requires_grad:
        # only autograd (saving an output) or a view shares a placeholder's storage; views made
        # under the mode pin their root (Note [Out kinds])
        return True
    # one count for the placeholder's TensorImpl, one for the storage's Python object
    return _storage_use_count(_untyped_storage(t)._cdata) <= 2


def settle_pins(window: Window) -> None:
    """Pin exactly the FRESH values that a recorded view still alive shows (Note [Out kinds]).

    A view the program (or autograd) still holds reads its root's placeholder, so that placeholder
    must be written; a root whose views all died is judged on its own liveness."""
    views = window.views
    for vo in views:
        vo.root.pinned = False
    for vo in views:
        if vo.ref() is not None:
            vo.root.pinned = True


def mark_needed(window: Window) -> int:
    """Mark the nodes whose results can be observed; return how many compute nodes are dead.

    A node is needed if it mutates something (the program sees its arguments), if one of its fresh
    values is still referenced or pinned by a view, or if a needed node reads one of its values.
    """
    if window.views:
        settle_pins(window)
    dead = 0
    for node in reversed(window.nodes):
        if node.is_view:
            needed = any(o.needed for o in node.outs)
        else:
            # a mutating op is always needed, but its fresh outputs (BatchNorm's) still need their
            # liveness: it decides whether they are written to their placeholders
            needed = node.mutates
            for o in node.outs:
                if o is None or o.kind != FRESH:
                    continue
                o.live = o.pinned or not placeholder_is_dead(o)
                if o.live or o.needed:
                    needed = True
        node.needed = needed
        if needed:
            for inp in node.inputs:
                inp.needed = True
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
        if torch.is_autocast_enabled("cpu") or (torch.cuda.is_available() and torch.is_autocast_enabled("cuda")):
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


def _bind(out: Out, result: torch.Tensor) -> int:
    """Make ``result`` the value of ``out``'s placeholder; return the copy launches it took."""
    placeholder = out.tensor
    if not out.live:  # only later ops of this window read it: never written to the placeholder
        out.value = result
        return 0
    if (
        result.dtype is placeholder.dtype
        and not out.pinned
        and _storage_use_count(_untyped_storage(placeholder)._cdata) <= 2
    ):
        # Nobody else shares the placeholder's (never written) storage: adopt the result's storage
        # instead of copying it. Every holder of this TensorImpl sees the new storage.
        placeholder.set_(_untyped_storage(result), result.storage_offset(), result.size(), result.stride())
        out.value = placeholder
        return 0
    # Views of the placeholder, or autograd's saved copy of an output, share its storage.
    if _swap_storages(placeholder, result):
        out.value = placeholder
        return 0
    placeholder.copy_(result)
    out.value = placeholder
    return 1


_swap_data_ptr = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)


def _swap_storages(placeholder: torch.Tensor, result: torch.Tensor) -> bool:
    """Give ``placeholder``'s storage the memory of ``result``'s, when that is the same as copying.

    Note [Storage swap]
    A placeholder whose storage is shared (views the program holds, autograd's saved copy of an
    output, a gradient ``AccumulateGrad`` stole) cannot adopt the result's storage with ``set_``:
    only its own TensorImpl would follow. Swapping the two storages' memory moves every sharer at
    once, with no copy. That is the copy exactly when the result has the placeholder's dtype,
    size, strides and offset, its storage is as large and nothing else uses it (after the swap it
    holds the placeholder's unwritten memory and is dropped). Nobody can have seen the
    placeholder's address before: ``data_ptr`` and every other raw read flushes first (Note
    [Placeholders]). Torch releases without ``UntypedStorage._swap_data_ptr_`` copy."""
    if _swap_data_ptr is None or result.dtype is not placeholder.dtype:
        return False
    if (result.size() != placeholder.size() or result.stride() != placeholder.stride()
            or result.storage_offset() != placeholder.storage_offset()):
        return False
    ps, rs = _untyped_storage(placeholder), _untyped_storage(result)
    # the result's TensorImpl and the storage object ``rs``: nothing else holds that memory
    if ps.nbytes() != rs.nbytes() or _storage_use_count(rs._cdata) > 2 or ps.device != rs.device:
        return False
    _swap_data_ptr(ps, rs)
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
        if node.is_view:
            # the window holds views weakly (Note [Out kinds]): a later op reading one gets it
            # made again from its input's value (a live root's value is its placeholder, so
            # that is the memory a view the program holds sees)
            args = [a.value if type(a) is Out else a for a in node.args]
            res = node.func(*args, **node.kwargs)
            for o, r in zip(node.outs, res if isinstance(res, (list, tuple)) else (res,)):
                o.value = r
            continue
        try:
            args = [a.value if type(a) is Out else (_resolve(a) if type(a) is list else a) for a in node.args]
            if node.kwargs:
                result = node.func(*args, **{k: _resolve(v) for k, v in node.kwargs.items()})
            else:
                result = node.func(*args)
        except Exception as e:
            raise ReplayError(node, e) from e
        launched += 1
        outs = node.outs
        if len(outs) == 1 and not isinstance(result, (list, tuple)):
            if outs[0] is not None:
                launched += _finish(outs[0], result)
        else:
            for o, r in zip(outs, result):
                if o is not None:
                    launched += _finish(o, r)
    return launched


__all__ = ["replay_window", "mark_needed", "settle_pins", "placeholder_is_dead", "ReplayError", "FRESH", "ALIAS", "VIEW"]
