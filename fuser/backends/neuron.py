"""The neuron backend: a region lowered to StableHLO (as the stablehlo backend does), compiled to a
NEFF by torch-neuronx's compiler, run on the ``neuron`` device.

NOT RUN ON HARDWARE. torch-neuronx is not on PyPI, and no Trainium host has run this file. It is
written against the calls read from torch-neuronx's source (``../shared/TRAINIUM.md`` in the design
docs: ``torch_neuronx._C.compile_graph``, ``execute_compiled_graph``, ``get_neff_info``,
``put_neff_cache``), which are private and may differ in a release. Everything that can be shared
with the stablehlo backend is: the lowering, the ops that run alone, the output plan, the 64-bit
narrowing (always on here: Neuron has no float64, and runs int64 as int32) and the artifact
format. What is left here is the part that cannot run without torch-neuronx. Its tests
(tests/test_neuron_backend.py) drive it through a stand-in for ``torch_neuronx._C`` that compiles
the StableHLO with XLA's CPU client, so the protocol below is tested on every machine; only the
real compiler and runtime are not.

Note [NEFFs in our cache]
~~~~~~~~~~~~~~~~~~~~~~~~~
``compile`` submits the StableHLO to ``compile_graph`` (asynchronous, in stream order), waits for
the device (``torch.neuron.synchronize``: its compile is lazy) and takes the NEFF bytes with
``get_neff_info``; the artifact holds the StableHLO text and the NEFF. ``execute_compiled_graph``
only runs keys compiled in this process, so ``load`` in a warm process first puts the NEFF into
torch-neuronx's own cache (``put_neff_cache``) and then calls ``compile_graph`` on the same text,
which finds it there and runs no ``neuronx-cc``. A load whose ``get_neff_info`` key differs from the
artifact's means another toolchain: refused (the region recompiles), never run.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from collections.abc import Callable

import torch

from ._common import BackendCompileError
from ._stablehlo_lowering import _dtype
from .stablehlo import StablehloBackend

_MAGIC = b"adaptive-eager neuron\n"
_REQUIREMENTS = {"torch_mlir": "torch-mlir", "torch_neuronx": "torch-neuronx"}
_CALLS = ("compile_graph", "execute_compiled_graph", "get_neff_info", "put_neff_cache")


def _neuronx():
    """torch-neuronx's private bindings; a clear error when one of the calls this backend uses is
    missing (its API is private: Note [NEFFs in our cache])."""
    import torch_neuronx

    c = torch_neuronx._C
    missing = [name for name in _CALLS if not hasattr(c, name)]
    if missing:
        raise BackendCompileError(
            f"neuron: this torch-neuronx ({_version('torch-neuronx')}) has no {', '.join(missing)}; the neuron "
            "backend was written for the calls of its April 2026 source. Use backend='replay' (one NEFF per "
            "op, as plain eager) and report the torch-neuronx version."
        )
    return c


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class NeuronBackend(StablehloBackend):
    """StableHLO from the shared lowering, NEFFs from torch-neuronx (see the module notes)."""

    name = "neuron"
    device_types = ("neuron",)
    requirements = _REQUIREMENTS
    magic = _MAGIC

    def __init__(self, device_type: str) -> None:
        super().__init__(device_type, narrow_64bit=True)

    def _identity(self) -> list[str]:
        return [f"torch-neuronx-{_version('torch-neuronx')}", f"neuronx-cc-{_version('neuronx-cc')}"]

    def _build(self, text: str, results: list[dict]) -> tuple[bytes, dict]:
        c = _neuronx()
        source = text.encode()
        base = "adaptive_eager_" + hashlib.sha256(source).hexdigest()[:32]
        try:
            key = c.compile_graph(base, source, False)
            torch.neuron.synchronize()  # the compile is lazy: the NEFF exists once the stream is done
            info = c.get_neff_info(key)
        except Exception as e:
            raise BackendCompileError(f"neuron: torch-neuronx cannot compile the region: {type(e).__name__}: "
                                      f"{str(e)[:800]}") from e
        if info is None:
            raise BackendCompileError(f"neuron: torch-neuronx compiled {key!r} but gives no NEFF for it")
        persistent_key, neff = info
        return bytes(neff), {"base_key": base, "neff_key": persistent_key, "stablehlo": text}

    def _callable(self, blob: bytes, header: dict) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
        c = _neuronx()
        source = header["stablehlo"].encode()
        c.put_neff_cache(header["neff_key"], blob)
        key = c.compile_graph(header["base_key"], source, False)  # finds the NEFF: no neuronx-cc
        torch.neuron.synchronize()
        info = c.get_neff_info(key)
        if info is None or info[0] != header["neff_key"]:
            raise BackendCompileError(
                f"neuron: the NEFF cached under {header['neff_key']!r} is not the one torch-neuronx compiles this "
                f"StableHLO to ({None if info is None else info[0]!r}): another toolchain; recompiling"
            )
        shapes = [(tuple(r["shape"]), _dtype(r["wire"])) for r in header["results"]]
        execute = c.execute_compiled_graph
        empty = torch.empty

        def results(args: list[torch.Tensor]) -> list[torch.Tensor]:
            args = [t if t.is_contiguous() else t.contiguous() for t in args]
            device = args[0].device if args else torch.device("neuron")
            outs = [empty(shape, dtype=dtype, device=device) for shape, dtype in shapes]
            execute(header["base_key"], key, args, outs, False)  # in stream order, like any neuron op
            return outs

        return results
