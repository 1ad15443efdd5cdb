"""What the kernels a function runs warn, seen where the library can keep or drop it.

Note [Kernel warnings]
~~~~~~~~~~~~~~~~~~~~~~
A C++ kernel's warning (``TORCH_WARN``) goes to the handler of the innermost Python binding of
torch it runs under, which hands it to ``warnings`` when that binding returns, attributed to the
Python frame that called the binding. An op the mode runs itself (an ``OpOverload`` call: no
binding of its own) is under the binding of the op the program called, so what it warns reaches
the program at the program's line when that op returns: right for the op eager would run (a
fallback's warning lands where eager's does), wrong for the library's own runs on stand-ins (the
layout probe of Note [Eager layouts], the overlap probe of Note [Overlapping writes], the resize
probe of Note [Out resizing]), whose warnings ``warnings.catch_warnings`` cannot stop: they are
not Python warnings until that outer binding returns. ``autograd.Function.apply`` is a binding
that calls back into Python, so a probe run under it (``kernel_warnings``) has its kernels'
warnings handed over when ``apply`` returns, inside the capture around it (``caught_warnings``).

What eager's kernel warns must still reach the program, once per run of the op, at eager's line.
A signature's warnings are learnt when it first misses the meta cache: the meta run's and the
layout probe's (or, with no probe, the meta run's alone), then the same run once more. What the
second run gives again is a warning of every run (``TORCH_WARN``: ``std`` of one element): the
entry is ``_Warns``, and the op runs eagerly each time (reason ``kernel_warning``, after a flush
when it reads pending values), so eager's own kernel warns, at eager's line, under the program's
filters, and no window holds it: a replay, a compiled region or a hot window never warns for it
again, and never twice. Recording it and issuing its warnings by hand was tried: the window's run
warns again, and to drop that the flush must capture warnings, which costs every flush and, with
``catch_warnings``, clears the program's ``"default"`` registries (below). Such ops are a user's
bug or a deprecation: correct and slow is the right trade. What only the first run gave is a
``TORCH_WARN_ONCE`` (``searchsorted`` of a non-contiguous boundary) that the runs used up: it is
issued then, at eager's line (``_source.warn(as_kernel=True)``), and the op is recorded.

Warnings that depend on the values (the probe's inputs are stand-ins) are not learnt: they come
when the window runs, where its run hands them over (a reader's line, or stderr for a flush with
no binding around it).

``warnings.catch_warnings`` bumps the filters' version on entry and exit, which empties every
module's warning registry: a program's ``"default"`` filter then shows again a warning it had
shown. So ``caught_warnings`` puts an ``"always"`` filter in front of ``warnings.filters`` in
place and points ``warnings.showwarning`` (documented as replaceable) at ``_show``: no version
bump. Unlike ``catch_warnings`` (before Python 3.14's context-aware warnings) it is not
process-wide: the filter's message pattern (``_Capturing``) matches only in a thread that is
capturing, and ``_show`` appends to that thread's innermost capture and hands any other thread's
warning to the program's ``showwarning``. So a warning a program's thread raises meanwhile (a
logging thread, a DataLoader's) meets the program's filters and is shown where it was raised: it
was caught with the probe's and dropped before (570 of 17,000 in a test with one meta-cache miss
per step). ``_show`` stays installed while any thread captures (two threads' captures end in any
order), and the program's ``showwarning`` comes back when the last one ends, unless the program
replaced ``_show`` meanwhile.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings

import torch


class _Capturing:
    """The message pattern of ``_ALWAYS``: it matches in a thread that is capturing (Note [Kernel
    warnings]); ``warnings`` calls its ``match`` as it would a compiled pattern's."""

    __slots__ = ()

    def match(self, text) -> bool:
        return bool(getattr(_local, "captures", None))


_ALWAYS = ("always", _Capturing(), Warning, None, 0)  # a ``warnings.filters`` entry, found by identity
_local = threading.local()  # .captures: this thread's open captures, innermost last
_lock = threading.Lock()
_open = 0  # captures open in all threads
_program_show = None  # the program's ``warnings.showwarning`` while ``_show`` stands in for it


def _show(message, category, filename, lineno, file=None, line=None):
    captures = getattr(_local, "captures", None)
    if captures:
        captures[-1].append(warnings.WarningMessage(message, category, filename, lineno, file, line))
    else:  # another thread's warning, past the program's filters: the program's to show
        (_program_show or warnings._showwarning_orig)(message, category, filename, lineno, file, line)


@contextlib.contextmanager
def caught_warnings():
    """This thread's warnings (``warnings.WarningMessage``s) while it runs the block, with an
    ``"always"`` filter, without its cost to the program's own ``"default"`` and ``"module"``
    filters or to other threads' warnings (Note [Kernel warnings])."""
    if getattr(sys.flags, "context_aware_warnings", False):  # Python 3.14's per-context filters
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
        return
    global _open, _program_show
    caught: list = []
    captures = getattr(_local, "captures", None)
    if captures is None:
        captures = _local.captures = []
    with _lock:
        if _open == 0:
            if warnings.showwarning is not _show:
                _program_show = warnings.showwarning
            warnings.showwarning = _show
            warnings.filters.insert(0, _ALWAYS)
        _open += 1
    captures.append(caught)
    try:
        yield caught
    finally:
        captures.pop()
        with _lock:
            _open -= 1
            if _open == 0:
                if warnings.showwarning is _show:
                    warnings.showwarning = _program_show
                filters = warnings.filters
                for i, f in enumerate(filters):
                    if f is _ALWAYS:
                        del filters[i]
                        break


class _Raised:
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


class _Binding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, box):
        # an exception is handed out in ``box``, not raised through ``apply``: what a kernel warned
        # is lost when an error passes through that binding, and a kernel warns from its
        # arguments' dtypes before it fails on a stand-in's values (``index_put_`` with a uint8 mask)
        try:
            box.append(run())
        except Exception as e:  # noqa: BLE001 - raised again by ``kernel_warnings``
            box.append(_Raised(e))

    @staticmethod
    def backward(ctx, *grads):  # never reached: nothing it returns requires grad
        return None, None


def kernel_warnings(run, seen: list | None = None):
    """``(run(), the warnings it gave)``: Python's and its kernels' (Note [Kernel warnings]); an
    exception ``run`` raises propagates as it was raised, after the warnings it gave until then
    are added to ``seen``."""
    box = []
    with caught_warnings() as caught:
        try:
            _Binding.apply(run, box)
        except RuntimeError as e:
            # functorch's transforms route ``apply`` elsewhere: run it bare (its kernels' warnings
            # then reach the program, as they did before)
            if box or "setup_context" not in str(e):
                raise
            box.append(run())
    res = box[0]
    if res.__class__ is _Raised:
        if seen is not None:
            seen.extend(caught)
        raise res.error
    return res, caught


def warnings_of(run) -> list:
    """The warnings ``run`` gives, whether it returns or raises (``kernel_warnings``)."""
    seen: list = []
    try:
        return kernel_warnings(run, seen)[1]
    except Exception:  # noqa: BLE001 - what it warned before it failed is the answer
        return seen
