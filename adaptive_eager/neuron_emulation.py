"""A ``neuron`` device on a machine without Trainium: ``emulate_neuron()`` (``NEURON_EAGER_EMULATE=1``).

PrivateUse1 is renamed ``neuron`` (what torch-neuronx does) and a tensor on it is a wrapper
subclass holding its data in a CPU tensor: every ATen op on it unwraps, runs on cpu and wraps the
results back on ``neuron``. Plain eager on it therefore runs op by op as on Trainium, and counts
each op as one NEFF launch (``launches()``), so a user sizes what adaptive eager saves before
renting a Trn2, and CI runs the ``neuron`` code path (device type, default backend, placeholders
allocated on the device) on any machine. Values are CPU's, exactly, but for dropout,
which draws and scales as torch-neuronx's kernel does (Note [Emulated dropout]).

Note [Emulated neuron tensors]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The data lives in the CPU tensor of a wrapper subclass (``_make_wrapper_subclass`` with
``device="neuron"``), which every op, ``detach`` included, carries over to its result: so
``nn.Parameter`` and ``Module.to`` (which swaps a subclass parameter's tensors) keep it, where a
0-byte PrivateUse1 tensor with its data in a Python attribute lost it. Factories with
``device="neuron"`` reach the PrivateUse1 kernels registered here (``empty.memory_format``,
``empty_strided``; the others decompose to these and then dispatch on the result);
``cpu_tensor.to("neuron")`` is ``empty`` + ``copy_``, which lands in ``__torch_dispatch__``.

Note [Emulated storage]
~~~~~~~~~~~~~~~~~~~~~~~
A wrapper's own (outer) storage holds no memory, but adaptive eager reasons about storages: which
tensors alias (its written sets), whether a placeholder's storage is shared (``_storage_use_count``)
before it adopts a result's storage with ``set_``. So the outer storages mirror the CPU data's:
a view's wrapper uses its base's outer storage (and keeps the base alive, so a placeholder outlives
its views), and ``set_`` to a wrapper's outer storage also points the data at that wrapper's CPU
storage (``_OWNERS`` finds it). ``UntypedStorage._swap_data_ptr_`` of two outer storages would
swap two empty pointers and move no data, so the fuser's storage swap (Note [Storage swap] in
fuser.replay: a placeholder's memory given a result's, every view moving with it, no copy) swaps
the CPU storages behind them instead (``_host_storages``); it copied, a launch a real device
does not make (a captured backward's tangent bound under a view of it, in
examples/finetune_transformer.py). Nor can a storage be made on the device
(``torch.UntypedStorage(n, device="neuron")``, which ``untyped_storage().clone()`` and loading onto
the device do): PrivateUse1 has no allocator here and torch crashes the process, so the emulation
refuses it with NeuronEmulationError (``_storage_new``). A compiled region runs on the CPU data (the stablehlo
backend unwraps its inputs and wraps its results). Fake tensors of a wrapper are plain ``neuron``
fake tensors (the class has no ``__tensor_flatten__``), so a region's graph is on ``neuron``
throughout, factories included, as on the real device.

Note [Emulated launches]
~~~~~~~~~~~~~~~~~~~~~~~~
On Trainium each eager op that computes is one NEFF launch; views, metadata and allocations are
not (they change no device memory). ``launches()`` counts what reaches the device: the ops reaching
``__torch_dispatch__`` that are none of these (``ops_run()``), and each run of a compiled executable
(``executables_run()``), which the stablehlo backend reports at the boundary where it runs one on the
CPU data (``_ran``, passed to ``register_host_device``). The ops a compiled executable runs never
reach ``__torch_dispatch__`` (they run on the CPU data: ``cpu_data`` / ``on_device``), while
everything adaptive eager does around them does, as it would launch on the device: replayed ops,
ops a split region runs alone, copies into placeholders and written inputs, clones, casts, random
draws. This count is the device's, taken without the library's: a test holds
``metrics()["launches"]`` to it.
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from ._threads import sync_value
from .config import EMULATION_INSTALLED, pass_to_children

DEVICE = "neuron"
_lock = threading.Lock()
_installed = False
_launches = 0
_executables = 0


class NeuronEmulationError(RuntimeError):
    """The emulated device cannot be installed in this process."""


class EmulatedNeuronTensor(torch.Tensor):
    """A tensor on the emulated ``neuron`` device (Note [Emulated neuron tensors]); its data is the
    CPU tensor ``_data``."""

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            layout=data.layout, device=torch.device(DEVICE, 0),
        )
        t._data = data
        # the lazy conjugate and negative bits are the tensor's, not its data's: torch's composites
        # read them on the wrapper to resolve a view before a kernel that cannot take one (hfftn)
        if data.is_conj():
            torch._C._set_conj(t, True)
        if data.is_neg():
            torch._C._set_neg(t, True)
        return t

    # Note [Emulated host reads]
    # C++ refuses ``tolist``/``numpy`` of a subclass, and torch's repr
    # would format with ops on the device (launches); these read the CPU data, which a real device
    # copies to the host. A read of a pending value's memory: its window runs first, the reason
    # counted as for a plain tensor (adaptive eager's readers on ``torch.Tensor`` are shadowed here).
    def __repr__(self, *, tensor_contents=None):
        sync_value(self, "repr")
        with _disable_current_modes():
            text = repr(self._data)
        return text[:-1] + f", device='{self.device}'" + (", requires_grad=True" if self.requires_grad else "") + ")"

    def tolist(self):
        sync_value(self, "tolist")
        return self._data.tolist()

    def __coerce_same_metadata_as_tangent__(self, expected_metadata, expected_type=None):
        """A tangent of a captured graph (Note [Emulated tensors under Dynamo]) is a plain tensor
        on the device, which this is."""
        return self

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        global _launches
        kwargs = kwargs or {}
        target = kwargs.get("device")
        to_device = target is None or torch.device(target).type == DEVICE
        if target is not None and to_device:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        if func in _SET_STORAGE:
            return _set_storage(*args, **kwargs)
        if func is _NATIVE_DROPOUT:
            return _dropout(*args, **kwargs)
        wrappers = {id(a._data): a for a in pytree.tree_leaves((args, kwargs)) if type(a) is EmulatedNeuronTensor}
        out = func(*pytree.tree_map(cpu_data, args), **pytree.tree_map(cpu_data, kwargs))
        if func in _BATCH_NORMS:
            out = _device_batch_norm_stats(func, args, kwargs, out)
        view = func.is_view
        bases = None
        if not view and func not in _NO_LAUNCH:
            _launches += 1  # Note [Emulated launches]

        def wrap(r):
            if type(r) is not torch.Tensor:
                return r
            held = wrappers.get(id(r))
            if held is not None:  # in place or out=: the wrapper the program holds
                if held.shape != r.shape or held.stride() != r.stride() or held.storage_offset() != r.storage_offset():
                    _resized(held)  # resize_, or an out= op that resized its output
                return held
            if not to_device:
                return r
            base = args[0] if view else None
            if not view:
                # Note [Emulated aliases]: a result that is no view by schema may still share an input's memory
                nonlocal bases
                if bases is None:
                    bases = {_storage_of(a._data)._cdata: a for a in wrappers.values()}
                base = bases.get(_storage_of(r)._cdata) if bases else None
                if base is None:
                    return on_device(r)
            t = EmulatedNeuronTensor(r)
            _share_storage(t, base)  # Note [Emulated storage]
            return t

        return pytree.tree_map(wrap, out)


# Note [Emulated dropout]
# ~~~~~~~~~~~~~~~~~~~~~~~
# torch-neuronx's ``native_dropout`` is not CPU's kernel: it draws its mask on the host, contiguous
# whatever the input's layout, moves it to the device and multiplies there by the scale in the
# input's dtype (Note [Dropout drawn at record time] in adaptive_eager._ops). The emulated device
# does the same, so its plain eager draws, rounds and lays out dropout as the real device's, and a
# test against it holds adaptive eager to that device's kernel, not CPU's. Two launches, as there:
# the mask's copy onto the device (or its fill, without a draw) and the kernel.
_NATIVE_DROPOUT = torch.ops.aten.native_dropout.default


def _dropout(x, p, train=None):
    global _launches
    if train is None:
        train = True
    if train and not 0.0 <= p <= 1.0:
        raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {p}")
    data = cpu_data(x)
    if not train or p == 0.0:
        mask, scale = torch.ones(data.shape, dtype=torch.bool), 1.0
    elif p == 1.0:
        mask, scale = torch.zeros(data.shape, dtype=torch.bool), 0.0
    else:
        mask, scale = torch.bernoulli(torch.empty(data.shape, dtype=torch.bool), 1.0 - p), 1.0 / (1.0 - p)
    _launches += 2  # Note [Emulated launches]
    return on_device(data * mask.to(data.dtype) * torch.tensor(scale, dtype=data.dtype)), on_device(mask)


# Note [Emulated aliases]
# ~~~~~~~~~~~~~~~~~~~~~~~
# ``unsafe_split`` / ``unsafe_chunk`` are not views by schema (autograd does not track them as
# views) but their results share the input's memory, on CPU and on a real device. A result of
# such an op whose CPU data shares an input's storage is wrapped as a view of that input (its
# outer storage, Note [Emulated storage]), so the emulated device's plain eager aliases as a real
# one does (before, the wrappers had storages of their own, and eager disagreed with a compiled
# region, whose outputs share the input's storage as on a real device).
#
# Note [Emulated batch-norm statistics]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# In evaluation (``training=False``, ``_native_batch_norm_legit_no_training``) CPU's batch-norm
# kernels return empty ``save_mean``/``save_invstd`` (shape [0]); on any other device, and in the
# meta kernels that fake tensors (our recorded metadata) run for every device but CPU, they are
# the running mean and 1 / sqrt(running_var + eps) (shape [C]; torch's decomposition does the same
# for a device that is not CPU). The emulated device runs CPU's kernels, so it gives the device's
# statistics instead: its eager then agrees with the recorded shapes and with a compiled region.
_BATCH_NORMS = (torch.ops.aten.native_batch_norm.default, torch.ops.aten._native_batch_norm_legit.default,
                torch.ops.aten._native_batch_norm_legit_no_training.default)


def _device_batch_norm_stats(func, args, kwargs, out):
    """``out`` with an evaluation's statistics as a device that is not CPU returns them (Note
    [Emulated batch-norm statistics])."""
    bound = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
    if bound.get("training", False) or bound.get("running_mean") is None or bound.get("running_var") is None:
        return out
    x = cpu_data(bound["input"])
    dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    mean = cpu_data(bound["running_mean"]).to(dtype, copy=True)
    invstd = 1 / torch.sqrt(cpu_data(bound["running_var"]).to(dtype) + bound["eps"])
    return (out[0], mean, invstd)


_storage_of = torch._C.TensorBase.untyped_storage  # unpatched (adaptive_eager._patches flushes on it)
# outer storage (StorageImpl address) -> a live wrapper over it: Note [Emulated storage]
_OWNERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_SET_STORAGE = (torch.ops.aten.set_.source_Storage_storage_offset, torch.ops.aten.set_.source_Storage)
# Note [Emulated launches]: ops that change no device memory: allocations, and questions about a
# tensor's layout that torch and adaptive eager ask (``_debug_has_internal_overlap``: before each
# recorded in-place op), which read metadata, not data
_NO_LAUNCH = frozenset((
    torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default, torch.ops.aten.empty_permuted.default,
    torch.ops.aten._debug_has_internal_overlap.default, torch.ops.aten.is_same_size.default,
    torch.ops.aten.is_set_to.default, torch.ops.aten._has_compatible_shallow_copy_type.default,
    # a view that autograd does not track: a reshape, which AOTAutograd's runtime wrapper makes of a
    # captured graph's output
    torch.ops.aten._unsafe_view.default,
    # a size read as an op (a split region's plan computes an op's size argument from an input's:
    # Note [Sizes that vary, run alone] in fuser.compile): metadata, on a real device too
    torch.ops.aten.sym_size.int,
))


def _share_storage(view: EmulatedNeuronTensor, base: EmulatedNeuronTensor) -> None:
    """Make ``view`` use ``base``'s (outer) storage, as a view on a real device does, and keep
    ``base`` alive while it lives (Note [Emulated storage])."""
    _set_outer(view, _storage_of(base), view._data.storage_offset(), view._data.shape, view._data.stride())
    view._base_wrapper = base


def _resized(t: EmulatedNeuronTensor) -> None:
    """Give ``t`` an outer storage as large as its resized data (a fresh wrapper's)."""
    fresh = EmulatedNeuronTensor(t._data)
    _set_outer(t, _storage_of(fresh), t._data.storage_offset(), t._data.shape, t._data.stride())
    _OWNERS[_storage_of(t)._cdata] = t


def _host_storages(storage, result):
    """The CPU storage behind the placeholder storage ``storage`` and ``result``'s CPU tensor, which the
    fuser's storage swap swaps (Note [Emulated storage]); None where there are none."""
    owner = _OWNERS.get(storage._cdata)
    if owner is None or type(result) is not EmulatedNeuronTensor:
        return None
    return _storage_of(owner._data), result._data


def _set_outer(t: EmulatedNeuronTensor, storage, offset, size, stride) -> None:
    # the CPU kernel of set_ on the wrapper itself: the storage and its device are the wrapper's
    torch.ops.aten.set_.source_Storage_storage_offset.redispatch(_CPU, t, storage, offset, size, stride)


def _set_storage(t, source, offset=None, size=None, stride=()):
    """``t.set_(storage, ...)`` for an (outer) storage of this device: ``t`` and its data both move
    to it (Note [Emulated storage])."""
    owner = _OWNERS.get(source._cdata) if source.device.type == DEVICE else None
    if owner is None:
        raise NeuronEmulationError(
            f"set_ to a storage on {source.device} that no live emulated neuron tensor uses: the emulation "
            "keeps a tensor's data in its CPU tensor, so a bare storage of it cannot be reattached")
    if offset is None:
        offset, size, stride = 0, (source.nbytes() // t.element_size(),), (1,)
    t._data.set_(_storage_of(owner._data), offset, size, stride)
    _set_outer(t, source, offset, size, stride)
    t._base_wrapper = owner
    return t


_StorageBase_new = torch._C.StorageBase.__new__


def _storage_new(cls, *args, device=None, **kwargs):
    """``torch.UntypedStorage.__new__``: a storage on the emulated device cannot be made (Note
    [Emulated storage]); torch would crash the process allocating it."""
    if device is not None and torch.device(device).type == DEVICE:
        raise NeuronEmulationError(
            "a storage on the emulated neuron device holds no memory (the emulation keeps a tensor's data in its "
            "CPU tensor), so it cannot be made or cloned: copy the tensor (t.clone()) or read "
            "t.cpu().untyped_storage()")
    return _StorageBase_new(cls, *args, **({"device": device} if device is not None else {}), **kwargs)


def cpu_data(x):
    """The CPU tensor behind an emulated ``neuron`` tensor; anything else as it is."""
    return x._data if type(x) is EmulatedNeuronTensor else x


def on_device(x):
    """A CPU tensor wrapped as an emulated ``neuron`` tensor; anything else as it is."""
    if type(x) is not torch.Tensor or x.device.type != "cpu":
        return x
    t = EmulatedNeuronTensor(x)
    _OWNERS[_storage_of(t)._cdata] = t
    return t


# Note [Emulated tensors under Dynamo]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A captured module or optimizer step (Note [Captured modules] in ``_capture``) is traced by
# TorchDynamo, which wraps a tensor as one only if its class has no ``__torch_dispatch__`` of its
# own or is a traceable subclass (``__tensor_flatten__``); it made the wrapper an opaque object and
# the trace failed at the first op. On Trainium a parameter is a plain tensor on ``neuron``, so
# Dynamo is told to wrap this class as it wraps ``torch.Tensor`` (its exact-type table,
# ``VariableBuilder._type_dispatch``): its fake tensors are plain ``neuron`` fake tensors, as a
# region's are (Note [Emulated storage]), so AOTAutograd's graphs and the fuser Programs made of
# them are on ``neuron`` throughout, as on the real device, and the stablehlo backend runs them on
# the CPU data. Dynamo guards the class itself (``TYPE_MATCH``), which only this device makes.
# Not ``__tensor_flatten__``: a traceable subclass is desugared into its inner CPU tensor by
# fake-tensor conversion everywhere (a region's graph would then be on cpu), and AOTAutograd would
# trace the CPU data, not the device. AOTAutograd asks a tangent of a subclass to match the plain
# tensor it traced (``__coerce_same_metadata_as_tangent__``): it does, as it is.
def dynamo_sees_plain_tensors() -> None:
    """Let Dynamo trace emulated tensors as plain ``neuron`` tensors (Note [Emulated tensors under
    Dynamo]); called before a capture, idempotent."""
    from torch._dynamo.variables.builder import VariableBuilder

    for trace_numpy in (False, True):  # one table per value of ``config.trace_numpy``
        table = VariableBuilder._type_dispatch_impl(trace_numpy)
        if EmulatedNeuronTensor not in table:
            table[EmulatedNeuronTensor] = VariableBuilder.wrap_tensor


def launches() -> int:
    """NEFF launches on the emulated device since the process started: ops that ran on it and
    compiled executables run (Note [Emulated launches])."""
    return _launches + _executables


def ops_run() -> int:
    """Ops that ran on the emulated device outside compiled executables, each one NEFF launch on
    Trainium (Note [Emulated launches])."""
    return _launches


def executables_run() -> int:
    """Compiled executables run on the emulated device (Note [Emulated launches])."""
    return _executables


def _ran() -> None:
    """A compiled executable ran on the device's data (the stablehlo backend's report)."""
    global _executables
    _executables += 1


def is_emulated() -> bool:
    """Whether this process's ``neuron`` device is the emulation."""
    return _installed


def real_device_present() -> bool:
    """Whether torch-neuronx's ``neuron`` device is registered in this process (it is, after
    ``import torch``, where torch-neuronx is installed)."""
    return not _installed and torch._C._get_privateuse1_backend_name() == DEVICE


def sizing_report(m: dict, steps: int, eager_launches: int | None = None, device_launches: int | None = None) -> str:
    """Per training step: NEFF launches eagerly and under adaptive eager, compiles, compile
    seconds, cache hits, and ops the backend could not lower. ``m`` is ``adaptive_eager.metrics()``
    of ``steps`` steps; ``eager_launches``, the emulation's count for the same steps run eagerly
    (else the tracer's estimate, ``eager_equivalent_launches``, is used); ``device_launches``, the
    emulation's count (``launches()``) of the adaptive steps, printed beside the library's."""
    eager = m["eager_equivalent_launches"] if eager_launches is None else eager_launches
    rows = [
        ("NEFF launches, eager" + ("" if eager_launches is not None else " (estimated)"), eager / steps),
        ("NEFF launches, adaptive eager", m["launches"] / steps),
        *([("  counted by the emulated device", device_launches / steps)] if device_launches is not None else []),
        ("compiles", m.get("compiles", 0) / steps),
        ("compile seconds", m.get("compile_seconds", 0.0) / steps),
        ("cache hits", (m.get("cache_hits_memory", 0) + m.get("cache_hits_disk", 0)) / steps),
        ("ops not lowered (run alone)", sum(m.get("run_alone", {}).values()) / steps),
        ("ops run eagerly (fallbacks)", m["ops_eager"] / steps),
    ]
    lines = [f"sizing report, per step ({steps} steps)", "=" * 48]
    lines += [f"{name:<36}{value:>12.2f}" for name, value in rows]
    if m["launches"]:
        lines.append(f"{'launches saved':<36}{eager / m['launches']:>11.1f}x")
    return "\n".join(lines)


def emulate_neuron() -> None:
    """Give this process a ``neuron`` device backed by CPU memory (see the module docstring).

    Idempotent. Child processes started afterwards (compile workers, DataLoader workers) get it too,
    through ``NEURON_EAGER_EMULATE=1`` in their environment. Raises ``NeuronEmulationError`` where a
    real ``neuron`` device (torch-neuronx) is registered, or PrivateUse1 already has another name."""
    global _installed
    with _lock:
        if _installed:
            return
        name = torch._C._get_privateuse1_backend_name()
        if real_device_present() or getattr(torch, DEVICE, None) is not None:
            raise NeuronEmulationError(
                "a real neuron device is registered (torch-neuronx): run on it, or in a process without "
                "torch-neuronx to emulate it")
        if name != "privateuseone":
            raise NeuronEmulationError(
                f"PrivateUse1 is already the {name!r} device in this process; the neuron emulation needs it")
        # PrivateUse1's device guard and hooks (``.to("neuron")`` needs the guard; ``torch.accelerator`` the hooks)
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(rename=DEVICE, backend_module=_DeviceModule())
        lib = torch.library.Library("aten", "IMPL")  # kept alive by _LIBRARIES
        lib.impl("empty.memory_format", _empty, "PrivateUse1")
        lib.impl("empty_strided", _empty_strided, "PrivateUse1")
        lib.impl("_copy_from", _copy_from, "PrivateUse1")
        _LIBRARIES.append(lib)
        torch.UntypedStorage.__new__ = _storage_new  # Note [Emulated storage]
        # torch.optim and clip_grad_norm_ take their foreach path on a device of the foreach list (PrivateUse1's
        # name is on it) only for tensors of these types: an emulated tensor is one, as a real device's is
        from torch.optim.optimizer import _foreach_supported_types as optim_types
        from torch.utils._foreach_utils import _foreach_supported_types as util_types

        for types in (optim_types, util_types):
            if EmulatedNeuronTensor not in types:
                types.append(EmulatedNeuronTensor)
        # Note [Module conversions keep parameters]
        torch.nn.Module._apply = _apply
        torch.nn.Module.to = _onto_device(_module_to)
        torch.nn.Module.neuron = _onto_device(torch.nn.Module.neuron)
        from fuser.backends.stablehlo import register_host_device

        register_host_device(DEVICE, cpu_data, on_device, _ran)  # Note [Host-memory devices] there
        from fuser.backends._common import HOST_SWAPS

        if hasattr(torch.UntypedStorage, "_swap_data_ptr_"):  # torch >= 2.12 (Note [Storage swap])
            HOST_SWAPS[DEVICE] = _host_storages
        from ._data_checks import CPU_KERNEL_DEVICES, HOST_DATA

        HOST_DATA[DEVICE] = cpu_data

        CPU_KERNEL_DEVICES.add(DEVICE)  # its values can be read on the host (Note [Errors from data])
        pass_to_children("emulate", "1")
        EMULATION_INSTALLED[0] = True
        _installed = True


_LIBRARIES: list = []


# Note [Module conversions keep parameters]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``model.to("cuda")`` keeps each parameter object (``Module._apply`` sets ``param.data``: a CPU and
# a CUDA tensor have compatible TensorImpls), so a weight tied between two modules (GPT-2's
# embedding and LM head, BERT's decoder) stays one parameter, and an optimizer made before the move
# holds the moved parameters. A tensor of the emulated device is a wrapper subclass, not compatible
# with a CPU tensor (``torch._has_compatible_shallow_copy_type``) and not traceable (no
# ``__tensor_flatten__``: Note [Emulated storage]), so ``_apply`` made a new Parameter per module:
# a tied weight became two (GPT-2 29 parameters instead of 28), trained apart, and the losses left
# CPU's by 1e-3..1e-2. A conversion onto the device (``Module.to``, ``Module.neuron``) or of a module
# holding its tensors therefore runs with torch's swap path
# (``torch.__future__.set_swap_module_params_on_conversion``, ``torch.utils.swap_tensors``), which
# keeps every parameter object, as the real device's conversion does; other conversions are untouched.
# Under adaptive eager such a conversion runs eagerly, after a flush: the swap refuses a tensor with
# weak references, and a recorded result has them (the window's placeholders); moving a model is a
# setup step, where one sync point costs nothing that matters.
_module_apply = torch.nn.Module._apply
_module_to = torch.nn.Module.to
_conversion = threading.local()


def _holds_device_tensors(module: torch.nn.Module) -> bool:
    return any(type(t) is EmulatedNeuronTensor for t in (*module.parameters(), *module.buffers()))


def _apply(self, fn, recurse=True):
    """``Module._apply`` keeping parameter objects where the emulated device is involved (Note
    [Module conversions keep parameters])."""
    if getattr(_conversion, "swapping", False) or torch.__future__.get_swap_module_params_on_conversion() or not (
            getattr(_conversion, "onto", False) or _holds_device_tensors(self)):
        return _module_apply(self, fn, recurse)
    from ._flush import flush
    from ._state import current_state

    st = current_state()
    if st is not None and st.window.nodes:
        flush(st, "sync")  # the conversion reads and swaps the parameters' data
    _conversion.swapping = True
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with _disable_current_modes():
            return _module_apply(self, fn, recurse)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
        _conversion.swapping = False


def _onto_device(convert):
    """``convert`` (``Module.to``, ``Module.neuron``) with its ``_apply`` told when it moves onto the device."""

    def converted(self, *args, **kwargs):
        if convert is _module_to:
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
            if device is None or device.type != DEVICE:
                return convert(self, *args, **kwargs)
        onto = getattr(_conversion, "onto", False)
        _conversion.onto = True
        try:
            return convert(self, *args, **kwargs)
        finally:
            _conversion.onto = onto

    converted.__doc__ = convert.__doc__
    return converted


def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return on_device(torch.empty(size, dtype=dtype, layout=layout, memory_format=memory_format))


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return on_device(torch.empty_strided(size, stride, dtype=dtype, layout=layout))


def _copy_from(src, dst, non_blocking=False):
    """A copy between devices that reaches the PrivateUse1 kernel instead of ``__torch_dispatch__``:
    ``torch.tensor(data, device="neuron")`` builds a CPU tensor and moves it with the Python key
    excluded. One launch, as a copy in ``__torch_dispatch__`` is."""
    global _launches
    cpu_data(dst).copy_(cpu_data(src), non_blocking)
    _launches += 1  # Note [Emulated launches]
    return dst


class _DeviceModule:
    """``torch.neuron`` of the emulation: the calls of torch-neuronx's that a training script makes."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device) -> None:
        index = device if isinstance(device, int) else torch.device(device).index
        if index not in (0, None):
            raise ValueError(f"the emulated neuron device has one device, not {device!r}")

    @staticmethod
    def synchronize(device=None) -> None:
        """Ops on the emulated device run when called; nothing is in flight."""

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        """Random draws on the emulated device use cpu's generator, which ``torch.manual_seed`` (the
        caller of this) seeds."""
