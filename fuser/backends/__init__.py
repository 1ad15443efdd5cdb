"""Compile backends: turn one region's ATen FX graph into stored bytes, and the bytes into a callable.

The fuser hands ``compile`` a functional ATen graph (see ``Backend``), stores the returned bytes in
``neff_cache`` under a key that includes ``fingerprint()``, and later, possibly in another process,
turns them back into a callable with ``load``. Backends are imported lazily: ``import fuser.backends``
costs nothing, and Inductor (about 1.3 s of imports) is only imported when the inductor backend
compiles or loads something.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Protocol

import torch

from ._common import BackendCompileError

# name -> (module, class); the module is imported on first use (see the module docstring)
_BACKENDS: dict[str, tuple[str, str]] = {
    "inductor": ("fuser.backends.inductor", "InductorBackend"),
    "replay": ("fuser.backends.replay", "ReplayBackend"),
    "stablehlo": ("fuser.backends.stablehlo", "StablehloBackend"),  # needs the [neuron] extra
    "neuron": ("fuser.backends.neuron", "NeuronBackend"),  # needs torch-neuronx too; not run on hardware
}


class Backend(Protocol):
    """What the fuser needs from a compiler.

    The graph given to ``compile``: ``call_function`` nodes call ATen ``OpOverload``s (plus
    ``operator.getitem`` for multi-output ops), one ``placeholder`` per input tensor in
    ``example_inputs`` order, one ``output`` node returning a tuple of tensors. It is functional: no
    in-place ops, no output aliases an input. Scalars are baked into node args.

    The callable from ``load`` takes a list of tensors with the example inputs' shapes, strides and
    dtypes and returns a tuple with the shapes, dtypes, strides and storage offsets that running the
    graph eagerly gives; outputs that are views of one another in eager share storage here too (they
    may be the same tensor object). It runs the ops as they were recorded, below autograd and
    autocast: outputs carry no autograd history, and autocast does not cast a second time. Call it
    with no ``TorchDispatchMode`` active.

    A backend with ``dynamic_shapes = True`` also compiles graphs traced symbolically (placeholders'
    ``meta["val"]`` have SymInt sizes): its callable then takes inputs of other sizes too, and has a
    ``guards`` attribute (a code object over ``L['t0']``, ``L['t1']``, ... that must evaluate true for
    the inputs before the call; None for static graphs). See Note [Symbolic Inductor artifacts] in ``inductor``.
    A backend of static shapes with ``sizes_alone = True`` is given a window whose sizes vary as
    pieces no varying size reaches, the ops it reaches running alone (Note [Sizes that vary, run
    alone] in ``fuser.compile``).

    A backend that cannot compile some ops defines ``unsupported(node) -> str | None``: for an FX
    ``call_function`` node of a region's graph, the reason it cannot compile it ("not_lowerable"),
    or None. The fuser then hands ``compile`` only the pieces of the graph without such nodes and
    runs those nodes eagerly between the pieces (Note [Partitions] in ``fuser.partition``).
    """

    name: str

    def fingerprint(self) -> str:
        """Identity of the code this backend produces: identical in every process that would produce
        (and can load) the same artifacts. Part of every region key."""
        ...

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> bytes:
        """Compile ``gm`` for inputs like ``example_inputs``; never mutates ``gm``.

        Raises ``BackendCompileError`` (naming the backend and the first failing op) for any graph
        it cannot compile."""
        ...

    def load(self, artifact: bytes) -> Callable[[list[torch.Tensor]], tuple[torch.Tensor, ...]]:
        """Turn bytes from ``compile`` (this or another process) into a callable.

        Raises ``BackendCompileError`` for corrupt artifacts or ones made under another
        fingerprint."""
        ...


def get_backend(name: str, device_type: str) -> Backend:
    """The backend called ``name`` ("inductor", "replay", "stablehlo" or "neuron") for tensors on ``device_type``.

    Instances are shared: a backend holds no per-graph state.
    """
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; valid backends: {', '.join(sorted(_BACKENDS))}")
    return _make_backend(name, device_type)


def get_backend_class(name: str) -> type:
    """The class of the backend called ``name`` (its module imported)."""
    module_name, class_name = _BACKENDS[name]
    return getattr(importlib.import_module(module_name), class_name)


@functools.cache
def _make_backend(name: str, device_type: str) -> Backend:
    return get_backend_class(name)(device_type)


__all__ = ["Backend", "BackendCompileError", "get_backend", "get_backend_class"]
