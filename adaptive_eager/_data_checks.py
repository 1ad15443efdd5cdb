"""Errors an op's kernel finds in its arguments' values: an index out of range, a class target out of
range, an integer division by zero (Note [Errors from data])."""

from __future__ import annotations

import torch

from ._metrics import METRICS

_Tensor = torch.Tensor
_untyped_storage = torch._C.TensorBase.untyped_storage  # unpatched (adaptive_eager._patches)
_aminmax = torch.aminmax
_any = torch.any
_eq = torch.eq
_item = torch._C.TensorBase.item  # unpatched: these values are real (adaptive_eager._patches)

# device types whose ATen kernels are CPU's (emulate_neuron adds "neuron"): their values can be read
# here, and their dropout drawn at record time (Note [Dropout drawn at record time] in _ops)
CPU_KERNEL_DEVICES = {"cpu"}
# device type -> how to reach its tensors' data in host memory, for a device emulated there
# (registered by adaptive_eager.neuron_emulation, a layer above): its checks read that data
HOST_DATA: dict = {}

# Note [Errors from data]
# ~~~~~~~~~~~~~~~~~~~~~~~
# Some kernels check their arguments' values: an index out of range (``x[i]``, ``index_select``,
# ``gather``, ``scatter``, ``index_copy_``, ``embedding``...), a class target out of range
# (``nll_loss``, which ``cross_entropy`` calls), an integer division by zero. Eager raises at the
# op. Recorded, the op raised when its window ran, and never when its result was dropped: the
# flush computes only what can be observed (``fuser.replay.mark_needed``, a compiler's dead-code
# elimination). Those ops are ``CHECKED`` (``OpFacts.data_check``: which arguments hold the values
# and what bounds them); at each call, before anything is recorded, ``check`` looks at those values:
# - a real tensor (not a value of the open window, not written by a pending op), on a device whose
#   kernels are CPU's (which check at the op; a GPU's check on the device, later, in eager too): its
#   least and greatest values (one ``aminmax``) against the bound the metadata gives (the indexed
#   dimension's size, the number of classes). In range: the op is recorded. Else (``EAGER``) it
#   runs eagerly (reason ``index_check``, after a flush where it reads pending values), and eager's
#   kernel raises its own error (type, message, and what it wrote before it found the index), at
#   the line; or it does not raise where the test was wider than the kernel's, and is eager's all
#   the same. A target equal to ``ignore_index`` is in range;
# - a value still pending (or on another device): the op is recorded and its result held by the
#   window (``Window.kept``, ``KEEP``; an in-place op's result is the tensor it writes), so the
#   flush finds it live: the replay runs it and a compiled region computes it (Inductor checks
#   indirect indices), and its error comes at the next sync point, as DESIGN.md allows, never
#   dropped with a result the program let go of.
# The test costs an ``aminmax`` of each real index and two scalar reads per call (7 us for 256
# token ids, about what recording two ops costs), only for these ops: an embedding's real token
# ids and ``cross_entropy``'s real targets, once each a step. An op's
# other errors (metadata, dtypes, scalars) are found once per signature: Note [Errors at the
# statement] in _meta.
OK, KEEP, EAGER = 0, 1, 2

_INT_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
                         torch.uint16, torch.uint32, torch.uint64})
_INDEX_DTYPES = _INT_DTYPES - {torch.bool}
_MASKS = (torch.bool, torch.uint8)  # an index of these dtypes is a mask: its shape is its metadata


def _pending(st, t: _Tensor) -> bool:
    """Whether ``t``'s values are not the program's yet: a value of the open window (a recorded
    view of a real tensor is real: ``torch.tensor([1, 2])`` is one, ``lift_fresh``), of another
    thread's (which the recorder makes real first), or a tensor a pending op writes."""
    o = getattr(t, "_ae", None)
    window = st.window
    if o is not None and (o.win is not window.token or o.slot < 0):
        return True
    written = window.written
    return bool(written) and _untyped_storage(t)._cdata in written


def _within(t: _Tensor, lo: int, hi: int, allowed=None) -> bool:
    """Whether every value of ``t`` is in ``[lo, hi)`` (or equal to ``allowed``)."""
    if not t.numel():
        return True
    to_host = HOST_DATA.get(t.device.type) if type(t) is not _Tensor else None
    if to_host is not None:
        # the emulated device's CPU data: a real device runs no such check (not a CPU-kernel
        # device), so the check launches nothing there (Note [Emulated launches] in neuron_emulation)
        t = to_host(t)
    mn, mx = _aminmax(t)
    mn, mx = _item(mn), _item(mx)
    if to_host is None:
        METRICS.launches += 3  # on a device, each of these reaches it: counted as ops run eagerly are
    if lo <= mn and mx < hi:
        return True
    if allowed is None:
        return False
    # what is out of range may all be the allowed value (``ignore_index``, -100, among class ids)
    if mx >= hi and mx != allowed or mn < lo and mn != allowed:
        return False
    if to_host is None:
        METRICS.launches += 7
    return not _item(_any(((t < lo) | (t >= hi)) & (t != allowed)))


def _verdict(st, t, lo: int, hi: int, allowed=None) -> int:
    if not isinstance(t, _Tensor) or t.dtype not in _INDEX_DTYPES:
        return OK  # not an index: the op's own checks of dtypes raise (Note [Errors at the statement] in _meta)
    if t.device.type not in CPU_KERNEL_DEVICES or _pending(st, t):
        return KEEP
    return OK if _within(t, lo, hi, allowed) else EAGER


def _arg(args, kwargs, pos: int, name: str, default=None):
    return args[pos] if pos < len(args) else kwargs.get(name, default)


def _size(t: _Tensor, dim) -> int | None:
    """The size of ``t``'s dimension ``dim`` (a 0-dim tensor has one of size 1), or None where
    ``dim`` is not one of its dimensions (the op's own checks raise then)."""
    n = t.dim()
    if type(dim) is not int:
        return None
    if n == 0:
        return 1 if dim in (0, -1) else None
    if dim < 0:
        dim += n
    return t.shape[dim] if 0 <= dim < n else None


def _check_indices(st, c, args, kwargs) -> int:
    """``index``, ``index_put_``: a list of indices over ``self``'s leading dimensions."""
    self, indices = _arg(args, kwargs, *c[0]), _arg(args, kwargs, *c[1])
    if not isinstance(self, _Tensor) or type(indices) not in (list, tuple):
        return OK
    verdict = OK
    d = 0
    for t in indices:
        if not isinstance(t, _Tensor):
            d += 1
            continue
        if t.dtype in _MASKS:
            d += t.dim()
            continue
        n = self.shape[d] if d < self.dim() else None
        d += 1
        if n is None:
            return OK  # more indices than dimensions: its own error, from metadata
        v = _verdict(st, t, -n, n)
        if v == EAGER:
            return EAGER
        verdict = max(verdict, v)
    return verdict


def _check_dim(st, c, args, kwargs) -> int:
    """``index_select``, ``gather``, ``scatter``, ``index_copy_``...: an index along ``dim`` of ``self``."""
    self, dim, index = _arg(args, kwargs, *c[0]), _arg(args, kwargs, *c[1]), _arg(args, kwargs, *c[2])
    if not isinstance(self, _Tensor):
        return OK
    n = _size(self, dim)
    if n is None:
        return OK
    return _verdict(st, index, -n if c[3] else 0, n)


def _check_numel(st, c, args, kwargs) -> int:
    """``take``, ``put_``: an index into ``self`` as a flat tensor."""
    self, index = _arg(args, kwargs, *c[0]), _arg(args, kwargs, *c[1])
    if not isinstance(self, _Tensor):
        return OK
    n = self.numel()
    return _verdict(st, index, -n, n)


def _check_embedding(st, c, args, kwargs) -> int:
    weight, indices = _arg(args, kwargs, *c[0]), _arg(args, kwargs, *c[1])
    if not isinstance(weight, _Tensor) or not weight.dim():
        return OK
    return _verdict(st, indices, 0, weight.shape[0])


def _check_target(st, c, args, kwargs) -> int:
    """``nll_loss``: class ids in ``[0, C)``, or ``ignore_index``."""
    self, target = _arg(args, kwargs, *c[0]), _arg(args, kwargs, *c[1])
    ignore = _arg(args, kwargs, *c[2], default=-100)
    if not isinstance(self, _Tensor) or not self.dim():
        return OK
    n = self.shape[1] if self.dim() >= 2 else self.shape[0]
    return _verdict(st, target, 0, n, ignore if type(ignore) is int else None)


def _check_divisor(st, c, args, kwargs) -> int:
    """Integer ``floor_divide``, ``remainder``, ``fmod``, ``div`` with a rounding mode: no zero divisor."""
    self, other = _arg(args, kwargs, *c[0]), _arg(args, kwargs, *c[1])
    if c[2] is not None and kwargs.get(c[2]) is None:
        return OK  # true division: a float result, no error
    if not isinstance(other, _Tensor) or other.dtype not in _INT_DTYPES:
        return OK
    if isinstance(self, _Tensor):
        if self.dtype not in _INT_DTYPES:
            return OK
    elif type(self) is not int and type(self) is not bool:
        return OK
    if other.device.type not in CPU_KERNEL_DEVICES or _pending(st, other):
        return KEEP
    return EAGER if other.numel() and _item(_any(_eq(other, 0))) else OK


# overload packet -> (checker, the names of the arguments it reads, the one whose values it checks,
# and its flag)
_PACKETS = {}
for _name in ("index", "index_put", "index_put_", "_index_put_impl", "_index_put_impl_", "_unsafe_index",
              "_unsafe_index_put"):
    _PACKETS[_name] = (_check_indices, ("self", "indices"), "indices")
for _name in ("index_select", "index_add", "index_add_", "index_copy", "index_copy_", "index_reduce",
              "index_reduce_", "gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce",
              "scatter_reduce_"):
    _PACKETS[_name] = (_check_dim, ("self", "dim", "index"), "index", False)
for _name in ("index_fill", "index_fill_"):
    _PACKETS[_name] = (_check_dim, ("self", "dim", "index"), "index", True)  # a negative index counts from the end
for _name in ("take", "put", "put_"):
    _PACKETS[_name] = (_check_numel, ("self", "index"), "index")
_PACKETS["embedding"] = (_check_embedding, ("weight", "indices"), "indices")
# not their backward: it reads the target its forward read, checked there (autograd refuses a
# saved target changed since)
for _name in ("nll_loss_forward", "nll_loss2d_forward"):
    _PACKETS[_name] = (_check_target, ("self", "target", "ignore_index"), "target")
for _name in ("floor_divide", "floor_divide_", "remainder", "remainder_", "fmod", "fmod_"):
    _PACKETS[_name] = (_check_divisor, ("self", "other"), "other", None)
for _name in ("div", "div_"):
    _PACKETS[_name] = (_check_divisor, ("self", "other"), "other", "rounding_mode")


def data_check_for(func, base: str):
    """``(checker, config)`` for an op whose kernel checks values ``check`` can look at, or None:
    the config holds each argument's (position, name), found in the op's schema."""
    entry = _PACKETS.get(base)
    if entry is None:
        return None
    checker, names, values, *flag = entry
    schema = [a.name for a in func._schema.arguments]
    if values not in {a.name for a in func._schema.arguments if "Tensor" in str(a.type)}:
        # a Python number (``remainder.Scalar``): a check of it is found from the signature (Note
        # [Errors at the statement] in _meta)
        return None
    if checker is _check_divisor and flag[0] is not None and flag[0] not in schema:
        return None  # ``div.Tensor``: true division
    positions = []
    for name in names:
        if name not in schema:
            return None
        positions.append((schema.index(name), name))
    return checker, (*positions, *flag)


def check(st, f, args, kwargs) -> int:
    """``OK``, ``KEEP`` or ``EAGER`` for this call of a ``CHECKED`` op (Note [Errors from data])."""
    checker, config = f.data_check
    return checker(st, config, args, kwargs or {})
