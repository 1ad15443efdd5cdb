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

Note [When torch-neuronx differs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The ``_C`` calls are private. Where one of them is missing, or its signature differs (a
``TypeError`` from calling it), the region goes through torch-neuronx's public path instead:
``torch.compile(gm, backend="neuron")``, its TorchDynamo backend (AOTAutograd, its own lowering,
its own NEFF cache). Counted per region loaded (``metrics()["neuron_fallbacks"]``) and logged once.
The artifact then holds the region's graph (the replay backend's JSON: no pickle, no stored
code), and ``load`` hands it to Dynamo, which compiles at the region's first run; a warm process
traces it again, and its NEFF comes from torch-neuronx's disk cache (keyed by the IR), not ours.
A region's GraphModule has a code object of its own, so Dynamo's recompile limit is per region.

Note [Aliased outputs]
~~~~~~~~~~~~~~~~~~~~~~
A region that writes its inputs (Note [Regions that write their inputs] in
``fuser.backends._stablehlo_lowering``) runs as one NEFF that writes them in place, as
torch-neuronx's own in-place kernels do (its fused AdamW, ``torch_neuronx/python_ops/xla_ops/
fused_adamw_xla.py``: the StableHLO donates the written arguments and the preallocated outputs are
the original tensors): each written input is marked ``tf.aliasing_output`` with its new value's
result in the StableHLO (what jax emits for a donated argument), so the compiler knows the two
share memory and orders reads before the writes, and ``execute_compiled_graph`` is given the input
tensor itself as that result's output. Otherwise each new value would be a device copy the fuser
counts (one launch per parameter, optimizer moment and buffer). An input that cannot alias its
result (narrowed to 32 bits, not contiguous, a result another output shares) makes ``compile``
refuse the in-place graph (``BackendCompileError.inplace``): the fuser compiles it again with
counted write-backs. The stores happen on the device within the NEFF, so a run that fails on the
device may leave some inputs written: in-place regions are compiled only from windows that cannot
fail at run time (Note [In-place regions] in fuser.compilable). NOT RUN ON HARDWARE either: whether
``execute_compiled_graph`` honours the aliasing as ``_submit_xla_task_to_pipeline`` does is what the
Trainium test checks first.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
from collections.abc import Callable

import torch

from ..stats import STATS
from ._common import BackendCompileError, below_autograd
from ._stablehlo_lowering import _declare_aliases, _dtype
from .replay import ReplayBackend
from .stablehlo import _FORMAT, StablehloBackend, _pack, _unpack

log = logging.getLogger("adaptive_eager.fuser")

_MAGIC = b"adaptive-eager neuron\n"
_FALLBACK_MAGIC = b"adaptive-eager neuron torch.compile\n"  # Note [When torch-neuronx differs]
_REQUIREMENTS = {"torch_mlir": "torch-mlir", "torch_neuronx": "torch-neuronx"}
_CALLS = ("compile_graph", "execute_compiled_graph", "get_neff_info", "put_neff_cache")
_warned: list[str] = []  # the fallback is logged once per process (Note [When torch-neuronx differs])


class _ApiDiffers(BackendCompileError):
    """torch-neuronx's private calls are not the ones this backend was written for (Note [When
    torch-neuronx differs])."""


def _neuronx():
    """torch-neuronx's private bindings; ``_ApiDiffers`` when one of the calls this backend uses is
    missing (Note [When torch-neuronx differs])."""
    import torch_neuronx

    c = torch_neuronx._C
    missing = [name for name in _CALLS if not hasattr(c, name)]
    if missing:
        raise _ApiDiffers(f"this torch-neuronx ({_version('torch-neuronx')}) has no {', '.join(missing)}")
    return c


def _differs(e: TypeError) -> _ApiDiffers:
    return _ApiDiffers(f"torch-neuronx {_version('torch-neuronx')}'s private calls take other arguments ({e})")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class NeuronBackend(StablehloBackend):
    """StableHLO from the shared lowering, NEFFs from torch-neuronx (see the module notes)."""

    name = "neuron"
    stores_after_run = False  # the NEFF writes its inputs as it runs (Note [Aliased outputs])
    device_types = ("neuron",)
    requirements = _REQUIREMENTS
    magic = _MAGIC

    def __init__(self, device_type: str) -> None:
        super().__init__(device_type, narrow_64bit=True)

    def _identity(self) -> list[str]:
        return [f"torch-neuronx-{_version('torch-neuronx')}", f"neuronx-cc-{_version('neuronx-cc')}"]

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> bytes:
        try:
            return super().compile(gm, example_inputs)
        except _ApiDiffers as e:
            return self._through_dynamo(gm, example_inputs, e)

    def load(self, artifact: bytes) -> Callable[[list[torch.Tensor]], tuple[torch.Tensor, ...]]:
        if not artifact.startswith(_FALLBACK_MAGIC):
            return super().load(artifact)
        header, graph = _unpack(artifact, _FALLBACK_MAGIC, self.name)
        if header.get("fingerprint") != self._fingerprint:
            raise BackendCompileError(
                f"{self.name}: artifact was made for {header.get('fingerprint')!r}, this process is {self._fingerprint!r}"
            )
        compiled = torch.compile(ReplayBackend(self.device_type).graph_module(graph), backend="neuron", dynamic=False)
        STATS.neuron_fallbacks += 1
        return below_autograd(lambda inputs: tuple(compiled(*inputs)))

    def _through_dynamo(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor], why: _ApiDiffers) -> bytes:
        """The fallback artifact: the region's graph, for ``torch.compile(backend="neuron")`` at load
        (Note [When torch-neuronx differs])."""
        if not _warned:
            _warned.append(str(why))
            log.warning("adaptive_eager: %s; regions are compiled with torch.compile(backend='neuron') instead "
                        "(metrics()['neuron_fallbacks']). Please report the torch-neuronx version.", why)
        graph = ReplayBackend(self.device_type).compile(gm, example_inputs)
        return _pack({"format": _FORMAT, "fingerprint": self._fingerprint, "via": "torch.compile"}, graph,
                     _FALLBACK_MAGIC)

    def _build(self, text: str, results: list[dict], writes: list[int], aliases: dict[int, int]) -> tuple[bytes, dict]:
        if len(aliases) != len(writes):
            error = BackendCompileError(f"neuron: written inputs {sorted(set(writes) - set(aliases))} cannot share "
                                        "memory with their new values (Note [Aliased outputs])")
            error.inplace = True  # the fuser compiles it again with write-backs
            raise error
        if aliases:
            text = _declare_aliases(text, aliases)
        c = _neuronx()
        source = text.encode()
        base = "adaptive_eager_" + hashlib.sha256(source).hexdigest()[:32]
        try:
            key = c.compile_graph(base, source, False)
            torch.neuron.synchronize()  # the compile is lazy: the NEFF exists once the stream is done
            info = c.get_neff_info(key)
        except TypeError as e:
            raise _differs(e) from e
        except Exception as e:
            raise BackendCompileError(f"neuron: torch-neuronx cannot compile the region: {type(e).__name__}: "
                                      f"{str(e)[:800]}") from e
        if info is None:
            raise BackendCompileError(f"neuron: torch-neuronx compiled {key!r} but gives no NEFF for it")
        persistent_key, neff = info
        return bytes(neff), {"base_key": base, "neff_key": persistent_key, "stablehlo": text,
                             "aliases": sorted(aliases.items())}

    def prepare_load(self) -> None:
        """Nothing: torch-neuronx, which ``load`` calls, came with the device (not XLA's client)."""

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
        aliases = header.get("aliases", [])  # (input, the result whose memory it is)
        aliased = {k for _, k in aliases}
        shapes = [None if k in aliased else (tuple(r["shape"]), _dtype(r["wire"]))
                  for k, r in enumerate(header["results"])]
        execute = c.execute_compiled_graph
        empty = torch.empty

        def results(args: list[torch.Tensor]) -> list[torch.Tensor]:
            args = [t if t.is_contiguous() else t.contiguous() for t in args]
            device = args[0].device if args else torch.device("neuron")
            outs = [None if s is None else empty(s[0], dtype=s[1], device=device) for s in shapes]
            for slot, k in aliases:  # Note [Aliased outputs]
                outs[k] = args[slot]
            execute(header["base_key"], key, args, outs, False)  # in stream order, like any neuron op
            return outs

        return results

    def _store(self, inputs: list[torch.Tensor], writes: list[tuple[int, torch.Tensor]]) -> None:
        """The NEFF wrote each input itself (Note [Aliased outputs]); only an input that was not
        contiguous at this call (it was when compiled) got a contiguous temporary, copied back."""
        for slot, value in writes:
            if value is not inputs[slot]:
                inputs[slot].copy_(value)
