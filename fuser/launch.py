"""Running a compiled region on a window: its inputs, the checks of its outputs, binding them and
writing back the inputs it does not write itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .backends._common import launches_of, restrided
from .replay import _bind, as_recorded, release_placeholders, restore_placeholders
from .scalars import _scalar_tensor
from .stats import STATS
from .window import Out, Window

if TYPE_CHECKING:
    from .table import _Entry


class _Mismatch(Exception):
    """A symbolic region's output is not what the recorded placeholder says (Note [Dynamic shapes])."""


def _run_checked(sym: _Entry, window: Window, live: list[Out]):
    """``_run_compiled`` for the first window of an exact key on a symbolic region: every output's
    metadata is checked against the program's placeholders before anything is written. Returns
    the launches and the callable the exact key takes (``_adopt``)."""
    inputs = _inputs(sym, window)
    real = window.real_inputs
    restride: list = []

    def check(outs):
        _check_outputs(sym, window, live, outs, restride)

    copies = ()
    with as_recorded():
        checked = getattr(sym.run, "checked", None) if sym.inplace else None
        if checked is not None:  # a split region that stores its inputs last: Note [A check before the stores]
            outs = checked(inputs, check)
        else:
            copies = sym.mutated if sym.inplace else ()  # as _run_compiled's unverified first run
            for slot in copies:
                inputs[slot] = inputs[slot].clone()
            outs = sym.run(inputs)
            check(outs)
            for slot in copies:
                real[slot].copy_(inputs[slot])
        if restride:
            # Inductor does not always keep eager's layout for symbolic outputs (a transposed
            # result comes back contiguous): this exact key's callable copies those outputs into
            # eager's layout, so the program sees eager strides.
            STATS.not_dynamic["restrided_output"] += 1
            sym_run = restrided(sym.run, restride)
            outs = sym_run.fix(outs)
        else:
            sym_run = sym.run
        return _write(sym, window, live, outs) + len(restride) + 2 * len(copies), sym_run


def _run_compiled(entry: _Entry, window: Window, live: list[Out], check: bool = False) -> int:
    # What can fail is the call (a compiled kernel's check, e.g. an out-of-range index) and, with
    # ``check``, the check of its outputs' metadata (Note [Artifacts from disk]). Outputs are bound
    # only after both, so a failure leaves the window's pending values to the replay, which raises
    # eager's own error. A region compiled in place writes its inputs during the call; it is
    # compiled so only for windows that cannot fail at run time (Note [In-place regions]), and at
    # its unverified first run it writes copies of them (below), so the replay never applies an
    # update twice.
    inputs = _inputs(entry, window)
    copies = entry.mutated if check and entry.inplace else ()
    with as_recorded():
        for slot in copies:
            inputs[slot] = inputs[slot].clone()
        released: list = []
        try:
            release_placeholders(live, released)  # Note [Placeholder memory at a compiled run]
            outs = entry.run(inputs)
            if check:
                _check_outputs(entry, window, live, outs)
            real = window.real_inputs
            for slot in copies:
                real[slot].copy_(inputs[slot])
            return _write(entry, window, live, outs) + 2 * len(copies)  # a clone and a copy back each
        except BaseException:  # the replay, or the NaN of a failed flush, writes the placeholders
            restore_placeholders(released)
            raise


def _inputs(entry: _Entry, window: Window) -> list[torch.Tensor]:
    """What ``entry.run`` takes: the real inputs by slot, then the lifted floats (Note [Scalar lifting])."""
    inputs = list(window.real_inputs)
    if entry.lifted_inputs:
        scalars = window.scalars
        inputs += [_scalar_tensor(scalars[i], dtype=dt) for i, dt in entry.lifted_inputs]
    return inputs


def _write(entry: _Entry, window: Window, live: list[Out], outs) -> int:
    """Bind a compiled run's outputs and write back the inputs it does not write itself; return
    the launches (the run's, Note [Launches of a compiled callable] in fuser.backends._common, and
    its copies). Called under ``as_recorded``."""
    copies = 0
    for o, r in zip(live, outs):
        copies += _bind(o, r)
    # unless the kernels wrote parameters, optimizer state and buffers in place (their version
    # counters were bumped when the in-place ops were recorded, as eager bumps them)
    if not entry.inplace:
        real = window.real_inputs
        for slot, r in zip(entry.mutated, outs[entry.n_live:]):
            real[slot].copy_(r)  # write-back of parameters, optimizer state, buffers
        copies += len(entry.mutated)  # the copies are launches too
    STATS.compiled_runs += 1
    return launches_of(entry.run) + copies


def _check_outputs(entry: _Entry, window: Window, live: list[Out], outs, restride: list | None = None) -> None:
    """Raise ``_Mismatch`` unless ``outs`` are what the window's placeholders and written inputs
    say. With ``restride``, an output in other strides is listed there, ``(index, shape, stride)``,
    for a copy into eager's layout (``_run_checked``), not a mismatch."""
    n = entry.n_live + (0 if entry.inplace else len(entry.mutated))
    if len(outs) != n:
        raise _Mismatch(f"{len(outs)} outputs for {n}")
    for i, (o, r) in enumerate(zip(live, outs)):
        shape, stride, dtype = tuple(o.meta[0]), tuple(o.meta[1]), o.meta[2]
        if tuple(r.shape) != shape or r.dtype != dtype or (restride is None and tuple(r.stride()) != stride):
            raise _Mismatch(f"output {tuple(r.shape)} {tuple(r.stride())} {r.dtype} for placeholder "
                            f"{shape} {stride} {dtype}")
        if tuple(r.stride()) != stride:
            restride.append((i, shape, stride))
    real = window.real_inputs
    for slot, r in zip(entry.mutated, outs[entry.n_live:]):
        if r.shape != real[slot].shape or r.dtype != real[slot].dtype:
            raise _Mismatch(f"written input {slot}: {tuple(r.shape)} {r.dtype} for {tuple(real[slot].shape)} "
                            f"{real[slot].dtype}")


def _adopt(entry: _Entry, source: _Entry, run) -> None:
    """Register ``run`` (``source``'s compiled callable, or a wrapper of it) as ``entry``'s.

    Note [Derived entries]
    An entry's ``run`` is called, and its outputs written, by what the compile of ``run`` decided,
    not by the program the entry was recorded with: which scalars it takes (``lifted_inputs``), how
    many outputs are live values (``n_live``), which inputs follow them (``mutated``), and whether
    the kernels write those inputs themselves (``inplace``: a symbolic region never does, the static
    program of the same window may). An entry that takes a callable it did not compile takes all
    of these with it, here; one that compiles or loads its own gets the compile's answers with
    ``run`` (``_collect``), and ``n_live``/``mutated`` from its program (``_describe``). A symbolic
    region starts from the structure of the entry that made it (``_run_dynamic``): its class key
    holds the live outputs and written inputs, so they are the same for every exact key it serves.
    """
    entry.run = run
    entry.lifted_inputs = source.lifted_inputs
    entry.n_live, entry.mutated = source.n_live, source.mutated
    entry.inplace = source.inplace
    entry.region = source.region
