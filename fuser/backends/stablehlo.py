"""The stablehlo backend: a region lowered to StableHLO by torch-mlir, compiled by XLA's CPU client.

This is the lowering the Trainium path uses (torch-neuronx builds on the same ``torch_mlir.fx``
importer, and StableHLO is what it hands to ``neuronx-cc``); where no Neuron compiler exists, XLA's
CPU client from ``jaxlib`` compiles the StableHLO instead, so the lowering runs and is tested on any
machine. It is a test vehicle, not a fast CPU backend: a call on tiny inputs costs ~60 us (DLPack
in and out, an XLA launch), against ~3 us for Inductor.

Needs the optional extra: ``pip install -e ".[neuron]"`` (torch-mlir and jax[cpu]).

The lowering, which the neuron backend shares, is ``fuser.backends._stablehlo_lowering`` (Notes
[StableHLO lowering], [Outputs that share storage], [64-bit types], [Ops that run alone]); this
module compiles and runs its StableHLO with XLA (``_build``, ``_callable``), gives the executable
the ``Backend`` calling convention (``caller``) and keeps the artifact format (``_pack``, ``_unpack``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import platform
import struct
import time
import weakref
import zlib
from collections.abc import Callable

import torch

from ._common import BackendCompileError, EagerWouldRaise, below_autograd, check_graph, op_name, restrided
from ._stablehlo_lowering import (
    OUT_OF_RANGE, _alone, _aliases, _checks_indices, _dtype, _examples, _functional, _input_key, _lower, _miscompiled,
    _output_plan, _returning, _signature, _wire, _write_back,
)

log = logging.getLogger(__name__)

# 2: a root laid out as a permutation of row-major is returned in that order, its outputs views of it
# (Note [Outputs that share storage]); format-1 artifacts copy it after the run, one launch more
_FORMAT = 2
# What the lowering lowers (Note [Our decompositions]): in the fingerprint, so a cached split region
# whose ops ran alone before a decomposition existed is compiled again, whole. Bump on such a change.
_LOWERING = 4
_MAGIC = b"adaptive-eager stablehlo\n"
_DEVICE_TYPES = ("cpu",)
_REQUIREMENTS = {"torch_mlir": "torch-mlir", "jax": "jax", "jaxlib": "jaxlib"}
INSTALL_HINT = 'pip install -e ".[neuron]"'

_DLPACK_CPU = 1  # DLDeviceType.kDLCPU

# Note [Host-memory devices]
# A device whose tensors hold their data in CPU memory (the emulated neuron device of
# ``adaptive_eager.neuron_emulation``, Note [Emulated storage] there) can run on XLA's CPU client:
# its code registers how to reach a tensor's CPU data and how to put a CPU result back on the
# device, and this backend then accepts that device type. Registered from above (the fuser never
# imports adaptive_eager: imports go one way), in every process that emulates the device
# (a compile worker emulates it at ``import torch`` too: NEURON_EAGER_EMULATE is inherited). The
# device is told of each executable run (``ran``), where a real one would launch it: the emulation
# counts its launches there, apart from the library's count (Note [Emulated launches] there).
_HOST_DEVICES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor],
                               Callable[[], None]]] = {}


def _nothing() -> None:
    pass


def register_host_device(device_type: str, to_cpu: Callable[[torch.Tensor], torch.Tensor],
                         from_cpu: Callable[[torch.Tensor], torch.Tensor], ran: Callable[[], None] = _nothing) -> None:
    """Let this backend compile for ``device_type``, whose tensors' data ``to_cpu`` reaches and
    ``from_cpu`` puts back; ``ran()`` is called once per executable run (Note [Host-memory devices])."""
    _HOST_DEVICES[device_type] = (to_cpu, from_cpu, ran)


def missing_requirements(requirements: dict[str, str] = _REQUIREMENTS) -> list[str]:
    """The distributions of ``requirements`` (module -> distribution; default: this backend's) that
    are not installed, found without importing them."""
    return [dist for module, dist in requirements.items() if importlib.util.find_spec(module) is None]


class StablehloBackend:
    """Lowers with torch-mlir, compiles with XLA's CPU client; the Notes this class cites are in
    ``fuser.backends._stablehlo_lowering``.

    The lowering (``unsupported``, the checks and the output plan of ``compile``) is shared with the
    neuron backend (``fuser.backends.neuron``), which overrides only what turns StableHLO text into
    an executable and runs it: ``_build``, ``_callable``, ``_identity``."""

    name = "stablehlo"
    writes_inputs = True  # Note [Regions that write their inputs]
    stores_after_run = True  # ... once the executable has finished: Note [In-place regions] in fuser.compilable
    joins_runs = True  # Note [Joined runs] in fuser.joined: an executable is a device launch
    sizes_alone = True  # static shapes only: Note [Sizes that vary, run alone] in fuser.compile
    device_types: tuple[str, ...] = _DEVICE_TYPES
    requirements: dict[str, str] = _REQUIREMENTS
    magic = _MAGIC

    def __init__(self, device_type: str, *, narrow_64bit: bool = False) -> None:
        if device_type not in self.device_types and device_type not in _HOST_DEVICES:
            raise ValueError(
                f"the {self.name} backend supports device types {', '.join(self.device_types)}, not {device_type!r}"
            )
        missing = missing_requirements(self.requirements)
        if missing:
            raise ImportError(
                f"the {self.name} backend needs {' and '.join(missing)}, which are not installed: {INSTALL_HINT}"
            )
        self.device_type = device_type
        self.narrow_64bit = narrow_64bit
        self._fingerprint = "|".join([
            f"{self.name}-{_FORMAT}",
            f"lowering-{_LOWERING}",
            f"torch-{torch.__version__}",
            f"torch-mlir-{importlib.metadata.version('torch-mlir')}",
            *self._identity(),
            "narrow64" if narrow_64bit else "exact64",
        ])
        # Note [Ops that run alone]: op signature -> reason or None; the last graph ``unsupported`` lowered
        self._lowerable: dict[tuple, str | None] = {}
        self._lowered: tuple | None = None

    def _identity(self) -> list[str]:
        """What else makes the executables this backend produces: the compiler and its target."""
        return [f"jaxlib-{importlib.metadata.version('jaxlib')}",
                f"{self.device_type}-{platform.machine()}-{_cpu_features()}"]  # XLA compiles for the host's ISA

    def fingerprint(self) -> str:
        """Format, torch / torch-mlir / compiler versions, the target, and the 64-bit option."""
        return self._fingerprint

    def unsupported(self, node: torch.fx.Node) -> str | None:
        """"not_lowerable" for a node torch-mlir cannot lower to StableHLO, "miscompiled" for one it
        lowers wrongly (Note [Ops that run alone])."""
        if _miscompiled(node):
            return "miscompiled"
        if _write_back(node):
            return None  # not an op: the region's store into an input (Note [Regions that write their inputs])
        key = _signature(node)
        if key not in self._lowerable:
            self._check(node.graph)
        return self._lowerable.get(key)

    def _check(self, graph: torch.fx.Graph) -> None:
        """Learn whether the ops of ``graph`` lower: the whole graph at once (kept for ``compile``),
        and only if that fails, each op not yet known alone (Note [Ops that run alone])."""
        nodes = [n for n in graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                 and not _write_back(n)]
        gm = graph.owning_module
        examples = _examples(gm) if gm is not None else None
        if examples is not None and not any(_miscompiled(n) for n in nodes):
            try:
                check_graph(self.name, gm, examples)
                self._lowered = (weakref.ref(gm), _input_key(examples), self._lower_region(gm, examples))
            except BackendCompileError:
                pass
            else:
                for n in nodes:
                    self._lowerable.setdefault(_signature(n), None)
                return
        for n in nodes:
            key = _signature(n)
            if key not in self._lowerable:
                self._lowerable[key] = self._probe(n)

    def _probe(self, node: torch.fx.Node) -> str | None:
        alone = _alone(node)
        if alone is None:
            return None  # no tensor metadata to build inputs from: let the region's compile decide
        gm, examples = alone
        try:
            _lower(gm, examples, self.narrow_64bit)
        except BackendCompileError as e:
            log.info("stablehlo: %s runs alone: %s", op_name(node.target), str(e).removeprefix("stablehlo: "))
            return "not_lowerable"
        return None

    def _culprit(self, gm: torch.fx.GraphModule):
        """The first op of ``gm`` that does not lower alone at its own sizes (Note [Ops that run
        alone]: an op whose lowering depends on sizes passes ``unsupported``), or None."""
        for node in gm.graph.nodes:
            if (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and not _write_back(node)
                    and self._probe(node)):
                return node.target
        return None

    def _lower_region(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]
                      ) -> tuple[list, list, list, str, bool]:
        """The output plan (Note [Outputs that share storage]), the inputs the region writes (Note
        [Regions that write their inputs]), the StableHLO of ``gm``, and whether its results end
        with the out-of-range flag (where ``gm`` reads indices: Note [Checked indices])."""
        gm, writes = _functional(gm)
        roots, results, outputs = _output_plan(gm, example_inputs, self.narrow_64bit)
        checked = _checks_indices(gm)
        text = _lower(_returning(gm, roots, checked), example_inputs, self.narrow_64bit)
        return results + [OUT_OF_RANGE] * checked, outputs, writes, text, checked

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> bytes:
        """Lower ``gm`` to StableHLO and compile it into a serialized XLA executable (Note [StableHLO lowering])."""
        check_graph(self.name, gm, example_inputs)
        for i, t in enumerate(example_inputs):
            # a lifted float is a 0-dim cpu tensor on every device (Note [Scalar lifting] in fuser.scalars)
            if t.device.type != self.device_type and not (t.device.type == "cpu" and t.dim() == 0):
                raise BackendCompileError(
                    f"stablehlo: example input {i} is on {t.device}, this backend compiles for {self.device_type}"
                )
        for node in gm.graph.nodes:
            why = _miscompiled(node)
            if why is not None:
                error = BackendCompileError(f"stablehlo: cannot compile {op_name(node.target)} (node {node.name}): "
                                            f"torch-mlir lowers it to wrong values ({why})")
                error.target = node.target
                raise error
        start = time.perf_counter()
        lowered, self._lowered = self._lowered, None
        if lowered is not None and lowered[0]() is gm and lowered[1] == _input_key(example_inputs):
            results, outputs, writes, text, bounds = lowered[2]  # lowered by ``unsupported`` a moment ago
        else:
            try:
                results, outputs, writes, text, bounds = self._lower_region(gm, example_inputs)
            except BackendCompileError as e:
                e.target = self._culprit(gm)  # the fuser compiles the rest with it run alone
                raise
        lowered = time.perf_counter()
        aliases = _aliases(results, outputs, writes, example_inputs, self.narrow_64bit) if writes else {}
        blob, extra = self._build(text, results, writes, aliases)
        header = {
            "format": _FORMAT,
            "fingerprint": self._fingerprint,
            "inputs": [_wire(t.dtype, self.narrow_64bit) for t in example_inputs],
            "results": results,
            "outputs": outputs,
            "writes": writes,
            "bounds": bounds,  # Note [Checked indices]
            **extra,
        }
        artifact = _pack(header, blob, self.magic)
        log.debug("%s: lowered %d nodes in %.2f s, compiled in %.2f s, %d bytes", self.name, len(gm.graph.nodes),
                  lowered - start, time.perf_counter() - lowered, len(artifact))
        return artifact

    def _build(self, text: str, results: list[dict], writes: list[int], aliases: dict[int, int]) -> tuple[bytes, dict]:
        """The executable of StableHLO ``text`` as bytes, and what else its header holds. ``writes``:
        the inputs the region writes, ``aliases``: those whose memory can be their result's (Note
        [Aliased outputs] in fuser.backends.neuron); unused here: XLA's CPU client cannot write a
        tensor's memory, so ``caller`` stores the new values (Note [Regions that write their inputs])."""
        client = _client()
        try:
            executable = client.compile_and_load(text, client.devices()[:1], _xla().CompileOptions())
            blob = client.serialize_executable(executable)
        except Exception as e:
            raise BackendCompileError(f"stablehlo: XLA cannot compile the region: {type(e).__name__}: {str(e)[:800]}") from e
        for i, layout in enumerate(executable.get_output_layouts()):
            rank = len(results[i]["shape"])
            if str(layout) != "{" + ",".join(str(d) for d in reversed(range(rank))) + "}":
                raise BackendCompileError(f"stablehlo: XLA returns result {i} in layout {layout}, not row-major")
        return blob, {}

    def prepare_load(self) -> None:
        """Import what ``load`` needs, XLA's client (Note [Loads prepared while the first compile
        runs] in fuser.artifacts)."""
        _client()

    def load(self, artifact: bytes) -> Callable[[list[torch.Tensor]], tuple[torch.Tensor, ...]]:
        """Load the executable (no compile) and wrap it in the ``Backend`` calling convention."""
        header, blob = _unpack(artifact, self.magic, self.name)
        if header.get("fingerprint") != self._fingerprint:
            raise BackendCompileError(
                f"{self.name}: artifact was made for {header.get('fingerprint')!r}, this process is {self._fingerprint!r}"
            )
        try:
            return below_autograd(caller(self._callable(blob, header), header, self._store))
        except BackendCompileError:
            raise
        except Exception as e:
            raise BackendCompileError(f"{self.name}: artifact does not load: {type(e).__name__}: {e}") from e

    def _store(self, inputs: list[torch.Tensor], writes: list[tuple[int, torch.Tensor]]) -> None:
        """Store each new value into the input it belongs to, after the run (Note [Regions that write
        their inputs]); on a host-memory device into its CPU data (Note [Host-memory devices])."""
        host = _HOST_DEVICES.get(self.device_type)
        for slot, value in writes:
            if host is None:
                inputs[slot].copy_(value)
            else:
                host[0](inputs[slot]).copy_(host[0](value))

    def _callable(self, blob: bytes, header: dict) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
        """``blob`` loaded: a function from the inputs (in the wire dtypes) to the results (root values
        in the wire dtypes, row-major), Note [Outputs that share storage]."""
        client = _client()
        executable = client.deserialize_executable(blob, client.devices()[:1], _xla().CompileOptions())
        device = client.devices()[0]
        # jaxlib's own DLPack calls: jax.dlpack.from_dlpack would make int64 int32 (jax's default
        # dtypes), and jax.Array.__dlpack__ costs ~20 us of Python checks per result
        to_buffer = _xla().dlpack_managed_tensor_to_buffer
        to_capsule = _xla().buffer_to_dlpack_managed_tensor
        from_dlpack = torch.from_dlpack
        execute = executable.execute

        def results(args: list[torch.Tensor]) -> list[torch.Tensor]:
            buffers = []
            for t in args:
                if t.requires_grad:  # DLPack refuses tensors that require grad; the call runs below autograd
                    t = t.detach()
                if not t.is_contiguous():
                    t = t.contiguous()
                buffers.append(to_buffer(t.__dlpack__(), device, None, None, _DLPACK_CPU))
            # exporting a result waits for the execution to finish (it reads the inputs in place until then)
            return [from_dlpack(to_capsule(r)) for r in execute(buffers)]

        if self.device_type in _HOST_DEVICES:  # XLA runs on the CPU data (Note [Host-memory devices])
            cpu_data, on_device, ran = _HOST_DEVICES[self.device_type]
            on_cpu = results

            # the out-of-range flag stays on the host: the callable reads it (Note [Checked indices])
            n_device = len(header["results"]) - header.get("bounds", False)

            def results(args: list[torch.Tensor]) -> list[torch.Tensor]:
                ran()
                roots = on_cpu([cpu_data(t) for t in args])
                return [on_device(r) for r in roots[:n_device]] + roots[n_device:]

        return results


# ---------------------------------------------------------------------------------------- XLA client


@functools.cache
def _xla():
    from jaxlib import _jax

    return _jax


@functools.cache
def _client():
    from jax.extend.backend import get_backend

    return get_backend("cpu")


# ----------------------------------------------------------------------------------------- calling


def caller(execute: Callable[[list[torch.Tensor]], list[torch.Tensor]], header: dict,
           store: Callable[[list[torch.Tensor], list[tuple[int, torch.Tensor]]], None]
           ) -> Callable[[list[torch.Tensor]], tuple[torch.Tensor, ...]]:
    """``execute`` (inputs in wire dtypes -> row-major roots in wire dtypes) in the ``Backend``
    calling convention (Notes [Outputs that share storage], [64-bit types], [Regions that write
    their inputs] in ``fuser.backends._stablehlo_lowering``); ``store`` writes the inputs the
    region writes."""
    as_strided = torch.as_strided

    casts_in = [(i, _dtype(wire)) for i, (dtype, wire) in enumerate(header["inputs"]) if dtype != wire]
    casts_out = [(k, _dtype(r["dtype"])) for k, r in enumerate(header["results"]) if r["wire"] != r["dtype"]]
    # per output: (from an input?, index, view (shape, stride, storage offset) or None)
    outputs = [(kind == "input", k, None if view is None else (tuple(view[0]), tuple(view[1]), view[2]))
               for kind, k, view in header["outputs"]]

    def results(args: list[torch.Tensor]) -> list[torch.Tensor]:
        """The executable's results as tensors of eager's dtypes, in the row-major layout."""
        roots = execute(args)
        for k, dtype in casts_out:
            roots[k] = roots[k].to(dtype)
        return roots

    if header.get("bounds"):  # Note [Checked indices]: the last result says whether an index was out of range
        computed = results

        def results(args: list[torch.Tensor]) -> list[torch.Tensor]:
            roots = computed(args)
            if roots.pop().item():
                raise EagerWouldRaise("the region reads a value its eager op refuses (an index out of range): its "
                                      "ops run eagerly, whose kernel raises eager's error (Note [Checked indices])")
            return roots
    fixes = [(k, r["shape"], r["stride"]) for k, r in enumerate(header["results"]) if r["stride"] is not None]
    if fixes:  # results eager lays out otherwise: copied into eager's strides
        results = restrided(results, fixes)

    writes = header.get("writes", [])
    n_out = len(outputs) - len(writes)
    # The stores run in order, each reading its new value then: a new value that is a view of an
    # input is cloned first only where an earlier store or its own writes that input (distinct
    # slots are distinct storages: a window whose written input shares storage with another input
    # is not compiled, Note [In-place regions] in fuser.compilable)
    from_input = [of_input and k in writes[:i + 1] for i, (of_input, k, _) in enumerate(outputs[n_out:])]

    def run(inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        args = inputs
        if casts_in:
            args = list(inputs)
            for i, wire in casts_in:
                args[i] = args[i].to(wire)
        roots = results(args)
        outs = tuple(
            as_strided(inputs[k], view[0], view[1], inputs[k].storage_offset() + view[2]) if of_input
            else roots[k] if view is None else as_strided(roots[k], *view)
            for of_input, k, view in outputs
        )
        if writes:
            values = [v.clone() if overwritten else v for v, overwritten in zip(outs[n_out:], from_input)]
            store(inputs, list(zip(writes, values)))
            return outs[:n_out]
        return outs

    # Note [Launches of a compiled callable]: the executable, and each cast, copy into eager's
    # strides and clone before a store (the stores are the executable's: Note [Regions that write their inputs])
    run.launches = 1 + len(casts_in) + len(casts_out) + len(fixes) + sum(from_input)
    return run


# ---------------------------------------------------------------------------------------- artifact


def _pack(header: dict, executable: bytes, magic: bytes = _MAGIC) -> bytes:
    """magic, header length, JSON header, executable; the header holds the executable's CRC-32."""
    header = {**header, "executable_crc32": zlib.crc32(executable), "executable_size": len(executable)}
    data = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return magic + struct.pack("<I", len(data)) + data + executable


def _unpack(artifact: bytes, magic: bytes = _MAGIC, name: str = "stablehlo") -> tuple[dict, bytes]:
    """The header and the executable; checks that they are whole (a damaged executable must never
    reach ``deserialize_executable``, which trusts its input)."""
    try:
        if not artifact.startswith(magic):
            raise ValueError(f"no {name} magic")
        start = len(magic) + 4
        (size,) = struct.unpack_from("<I", artifact, len(magic))
        header = json.loads(artifact[start:start + size])
        executable = artifact[start + size:]
        if not isinstance(header, dict) or header.get("format") != _FORMAT:
            raise ValueError(f"not format {_FORMAT}")
        if len(executable) != header["executable_size"] or zlib.crc32(executable) != header["executable_crc32"]:
            raise ValueError("the executable is damaged (size or CRC-32)")
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise BackendCompileError(f"{name}: artifact is corrupt or not a {name} artifact: {e}") from e
    return header, executable


@functools.cache
def _cpu_features() -> str:
    """A short digest of the CPU's feature flags: XLA's CPU code uses every extension the host has."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return hashlib.sha256((flags or platform.processor()).encode()).hexdigest()[:12]
