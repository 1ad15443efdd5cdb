"""Per-op facts, computed once per ``OpOverload`` from its schema and tags (STYLE habit 2).

The record path looks an op up in ``FACTS`` and never parses a schema, walks a pytree or builds a
string. ``OpFacts.kind`` says what the tracer does with the op:

RECORD          defer it into the window (output metadata from the meta cache)
VIEW            run it now on the real/placeholder tensors (views read no data); record it only
                when its input is pending, so the fuser sees the dataflow
ALLOC           ``empty*``: allocation only, no launch and no data: run now (and the profiler's
                ``record_function`` ops)
RANDOM_FILL     in-place random fill (``uniform_``, ``normal_``, ``bernoulli_.float``...): draw into a
                temporary now, in program order, and record a ``copy_`` (Note [RNG])
RANDOM_NEW      random factory / ``*_like``: run now, in program order (Note [RNG])
FLUSH           needs real data or changes tensor metadata: flush the window, then run eagerly
BATCH_NORM      ``native_batch_norm`` writes the running stats in training mode although its schema
                does not say so; that case is recorded as ``_native_batch_norm_legit`` (annotated)
INLINE          an op made of ATen ops the recorder takes: its decomposition runs with the mode on
                (``OpFacts.decomposition``), and the ops it dispatches are recorded (Note [Ops run
                inline])
HOST_READ       a composite whose kernel reads an argument's memory (Note [Composites that read
                memory]): the values it reads are made real, then it runs as INLINE does
CHECKED         RECORD, for an op whose kernel checks values (an index out of range): they are
                looked at first where they are real (Note [Errors from data] in _data_checks)

Collectives (``torch.distributed``) are FLUSH with reason "collective" (Note [Collectives]).

Note [RNG]
Eager consumes a generator in program order, at the op. Deferring a random op would let anything
that runs in between (a CPU op, ``manual_seed``, ``get_rng_state``) see a different generator
state, so random draws are never deferred: ops whose draws depend only on shapes run at record
time, exactly as eager runs them, and the rest flush first. The window only ever holds
deterministic ops.
"""

from __future__ import annotations

import functools

import torch
from fuser.backends._common import ALLOCATORS

from ._args import _tensors
from ._data_checks import CPU_KERNEL_DEVICES, data_check_for

RECORD, VIEW, ALLOC, RANDOM_FILL, RANDOM_NEW, FLUSH, BATCH_NORM, INLINE, HOST_READ, CHECKED = range(10)  # RECORD 0: the dispatch mode tests ``not kind``

# ops that change a tensor's metadata (shape, strides, storage) in place: the placeholder's
# metadata must never move under a pending write, so they run eagerly after a flush.
_METADATA_MUTATORS = {
    "t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_", "resize_", "resize_as_", "set_",
    "swapaxes_", "swapdims_", "_resize_output_", "detach_", "_coalesced_", "share_memory_",
}

# flush reasons named after what the user wrote, so ``metrics()['flushes']`` reads like the program
_SYNC_REASONS = {
    "_local_scalar_dense": "item",
    "is_nonzero": "bool",
    "equal": "data_dependent",
    "allclose": "data_dependent",
}


# Note [Collectives]
# ``torch.distributed`` reaches the dispatcher as ops of these namespaces: ``c10d::allreduce_``,
# ``broadcast_``, ``recv_``, ``barrier``... (``dist.*`` and DDP's C++ Reducer both call them) and
# the functional ``_c10d_functional::all_reduce`` / ``wait_tensor``. The process group reads and
# writes the tensors' memory directly, on its own threads, after the op returns (``async_op``), so
# the window is flushed before every collective: its inputs must hold their values, and a pending
# op must not read a tensor the collective then overwrites. The c10d schemas mark no argument as
# written (``allreduce_(Tensor[] tensors, ...)``), so ``mutates`` is set here: the tracer flushes
# any non-empty window before an op that writes. After the flush the window is empty, so nothing
# pending targets the tensors the collective fills; they are real, and later ops read them after
# the program's ``wait()``, as eager does. ``wait_tensor`` launches nothing: it flushes only when
# its input is pending.
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"})
_COLLECTIVE_NON_WRITERS = frozenset({"wait_tensor"})

# Note [Ops run inline]
# ~~~~~~~~~~~~~~~~~~~~~
# A custom op (not ``aten``) is a FLUSH: its schema and meta kernel are all we know of it, and
# neither need say what it reads, writes or aliases. The ones below are FSDP2's copy-in/copy-out
# ops (``torch.distributed.fsdp._fully_shard._fsdp_collectives``), one of each per all-gather and
# reduce-scatter. Each backend's kernel is the same Python function of ATen ops (``narrow`` and
# ``split`` + ``_foreach_copy_``; ``split_with_sizes_copy.out``; ``_chunk_cat.out``), registered per
# device key, not as CompositeImplicitAutograd, so ``OpOverload.decompose()`` does not reach it.
# ``all_gather_copy_in``'s schema returns fresh tensors although it writes into its
# ``all_gather_output`` and returns views of it: recorded as one op, that write and those aliases
# would be lost. So they are INLINE: the backend kernel runs with the mode on (``_backend_kernel``;
# ``_mode._run_inline``), and the ATen ops it dispatches are recorded as eager runs them, with
# their own schemas' writes and views; the collective that follows is the sync point (Note
# [Collectives]). ``split_with_sizes_copy.out`` (which FSDP2's copy-out calls) writes a list of
# tensors passed as the ``out=`` keyword, which the recorder does not take: it runs as
# ``torch._decomp``'s decomposition, a ``split_with_sizes`` view and a ``copy_`` per output, which is
# what its CPU kernel computes (bitwise: copies).
_INLINE_CUSTOM_OPS = frozenset({"fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy", "fsdp::chunk_cat"})
_INLINE_DECOMPOSED = frozenset({"aten.split_with_sizes_copy.out"})
_BELOW_PYTHON = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)

# Note [Composites that read memory]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Some CompositeImplicitAutograd kernels of ATen read a tensor argument's memory in C++
# (``const_data_ptr``, ``accessor``) and turn it into sizes: ``tensor_split`` with a 1-d tensor of
# indices, a PackedSequence's ``batch_sizes`` (``_pad_packed_sequence``, its backward, the
# ``.data`` overloads of the RNNs), the size ``sparse_coo_tensor`` infers from its indices (from
# an ``indices.max()`` it computes itself, which the mode would record) and the checks of
# ``_validate_sparse_coo_tensor_args``. Such a kernel runs above the dispatch mode (it is the op's
# kernel for the autograd keys; the mode sees only the ops it calls), so with a pending argument
# it split at whatever the placeholder's memory held: a wrong value, no error. A Python wrapper
# of ``torch.tensor_split`` missed every reference bound before it (``from torch import
# tensor_split``, torch's own Python code). So while adaptive eager is on, each of these ops has
# a kernel of ours for the autograd keys of the devices it records on (``_patches._host_reader``;
# registered for AutogradCPU, AutogradCUDA, AutogradPrivateUse1 directly: the ``Autograd`` alias
# loses to the composite). Where a value it reads is pending, the value's window runs first
# (reason ``host_indices``; for the ops that read a value they compute, the whole window, and the
# op then runs with the mode off); then the op's own C++ composite runs (``composite_kernel``),
# its ops going through autograd and the mode as before. Registered when a thread first turns
# adaptive eager on, and kept for the process (registering them at each outermost block and
# removing them at its exit made entering and leaving a block 0.25 -> 0.7-0.9 ms); a thread
# without the mode, and the program outside a block, get what the key gives without them: the
# composite, with one Python call more, or under the Python dispatcher (Dynamo's and make_fx's
# fake tensors) the op's Python decomposition (the C++ composite would read a fake tensor's
# memory: torch.compile of ``tensor_split`` with tensor indices failed after a block). Under ``inference_mode`` the autograd keys are skipped and the op
# itself reaches the mode (the Python key is not one of the composite's): a HOST_READ op, for
# which the mode does the same, its composite's ops coming back to the mode as INLINE ones do.
# The list is what reading ATen's composites for such reads found (TensorShape, PackedSequence,
# RNN, SparseTensor, LossCTC), each case tested (tests/test_host_reads.py). A sweep checks it
# against torch's OpInfo database (``test_no_composite_of_the_opinfo_database_reads_memory_unlisted``,
# slow): every op with a composite overload runs every sample on functional wrappers, whose memory
# access raises while their ops dispatch as usual; in torch 2.13 it finds ``tensor_split`` alone
# (the others here have no OpInfo entry). Not in it, because
# their reads go through the dispatcher: ``ctc_loss`` (hands its lengths to ``_ctc_loss.Tensor``,
# an op the mode sees), ``narrow`` with a tensor start and 0-dim ``tensor_split`` sections
# (``item()``), ``repeat_interleave`` (its repeats go to a kernel the mode sees),
# ``pack_padded_sequence`` (its own kernel).
HOST_READERS = {  # op: the arguments it reads on the host; None: it reads what it computes
    "aten.tensor_split.tensor_indices_or_sections": ("tensor_indices_or_sections",),
    "aten._pad_packed_sequence.default": ("batch_sizes",),
    "aten._pack_padded_sequence_backward.default": ("batch_sizes",),
    "aten.lstm.data": ("batch_sizes",),
    "aten.gru.data": ("batch_sizes",),
    "aten.rnn_tanh.data": ("batch_sizes",),
    "aten.rnn_relu.data": ("batch_sizes",),
    "aten.sparse_coo_tensor.indices": None,
    "aten._validate_sparse_coo_tensor_args.default": None,
}


def composite_kernel(op):
    """``op``'s C++ CompositeImplicitAutograd kernel, the one eager runs: not ``op.decompose``,
    which prefers a Python decomposition where torch has one (``tensor_split``'s reads its indices
    with ``tolist`` and more ops, unlike eager)."""
    return functools.partial(op._op_dk, torch._C.DispatchKey.CompositeImplicitAutograd)


def host_read_args(op):
    """The (position, name) of each argument ``op`` reads on the host; None: what it computes."""
    names = HOST_READERS[str(op)]
    if names is None:
        return None
    return tuple((i, a.name) for i, a in enumerate(op._schema.arguments) if a.name in names)


def _backend_kernel(func):
    """``func``'s kernel for its first tensor's device, below the dispatch mode."""

    def kernel(*args, **kwargs):
        t = next(_tensors(args, kwargs))
        return func.redispatch(torch._C._dispatch_keys(t) & _BELOW_PYTHON, *args, **kwargs)

    return kernel


class OpFacts:
    __slots__ = (
        "func", "call", "name", "kind", "reason", "tensor_pos", "list_pos", "scalar_pos", "seq_pos", "tensor_kw", "write_pos", "liftable", "scalarlist_pos", "pointwise",
        "alias_ret", "mutates", "factory", "returns_list", "nrets", "has_device_kw", "one_out", "writes_first", "one_ret", "fresh_one", "tensor_at",
        "arity_varies",
        "dropout_arg", "unseeded", "decomposition", "host_read", "data_check", "lists_or_writes",
    )

    def __repr__(self) -> str:
        return f"OpFacts({self.name}, kind={self.kind})"


def _type_class(t: str) -> str:
    if t in ("Tensor", "Optional[Tensor]"):
        return "tensor"
    if t in ("List[Tensor]", "List[Optional[Tensor]]"):
        return "list"
    if t in ("number", "Optional[number]", "float", "Optional[float]"):
        return "scalar"
    return "other"


# Note [Scalar recording]
# ~~~~~~~~~~~~~~~~~~~~~~~
# The recording side of Note [Scalar lifting] (in fuser.scalars, which says why and what the fuser
# does with the values):
# - a float argument of a liftable op (``OpFacts.liftable``) is ``float`` in the op's
#   meta-cache key and signature (its value cannot change output metadata, except for the ops
#   whose floats decide output shapes: ``_SHAPE_FROM_FLOATS``, never liftable), and its value is
#   appended to ``Window.scalars``; the node keeps where it took it from (``Node.fbase``/``fpos``:
#   an argument position, a keyword name, or (list position, index)). Other numbers stay in the
#   signature by type and value: ``1``, ``1.0`` and ``True`` hash alike but promote differently.
_SHAPE_FROM_FLOATS = ("arange", "linspace", "logspace", "range", "upsample", "interpolate", "histogram")


def classify(func: torch._ops.OpOverload, seeded: bool = True) -> OpFacts:
    """``seeded=False``: the facts of a call that draws nothing (Note [Dropout probability])."""
    f = OpFacts()
    f.dropout_arg = f.unseeded = f.decomposition = f.host_read = f.data_check = None
    schema = func._schema
    f.func = func
    # ``func(*args)`` less the Python frame of ``OpOverload.__call__``, which only forwards to it
    # (0.34 of 1.57 us for a ``t``): what a hot view calls (Note [Hot view cost] in _hot)
    f.call = getattr(func, "_op", func)
    f.name = str(func)
    base = func._overloadpacket.__name__ if hasattr(func, "_overloadpacket") else schema.name.split("::")[-1]
    tensor_pos, list_pos, scalar_pos, seq_pos, tensor_kw, scalarlist_pos = [], [], [], [], [], []
    arg_alias_write: dict[str, tuple[int | str, bool]] = {}
    mutates = False
    write_pos = []
    has_tensor_arg = False
    for i, a in enumerate(schema.arguments):
        cls = _type_class(str(a.type))
        if cls in ("tensor", "list"):
            has_tensor_arg = True
            if a.kwarg_only:
                tensor_kw.append(a.name)
            else:
                (tensor_pos if cls == "tensor" else list_pos).append(i)
        elif cls == "scalar" and not a.kwarg_only:
            scalar_pos.append(i)
        elif cls == "other" and "List[" in str(a.type) and not a.kwarg_only:
            seq_pos.append(i)  # int[] sizes arrive as lists: hashable keys need tuples
            if str(a.type) == "List[number]":
                scalarlist_pos.append(i)
        info = a.alias_info
        if info is not None:
            for s in info.before_set:
                arg_alias_write[s] = (a.name if a.kwarg_only else i, info.is_write)
            mutates = mutates or info.is_write
            if info.is_write:
                write_pos.append(a.name if a.kwarg_only else i)
    f.tensor_pos = tuple(tensor_pos)
    # the tensor positions a call with n arguments has (a call may leave out trailing defaults), by n
    f.tensor_at = tuple(tuple(i for i in tensor_pos if i < n) for n in range(len(schema.arguments) + 1))
    # whether calls differ in how many arguments they pass: only where a positional argument has a
    # default (the dispatcher leaves out trailing defaults; it passes every other positional one)
    f.arity_varies = any(a.has_default_value() and not a.kwarg_only for a in schema.arguments)
    f.list_pos = tuple(list_pos)
    f.scalar_pos = tuple(scalar_pos)
    f.seq_pos = tuple(seq_pos)
    f.scalarlist_pos = frozenset(scalarlist_pos)
    f.liftable = not any(word in base for word in _SHAPE_FROM_FLOATS)
    f.tensor_kw = frozenset(tensor_kw)
    f.mutates = mutates
    f.write_pos = frozenset(write_pos)
    f.factory = not has_tensor_arg
    f.has_device_kw = any(a.name == "device" for a in schema.arguments)
    rets = schema.returns
    f.returns_list = len(rets) == 1 and str(rets[0].type).startswith("List[")
    f.nrets = len(rets)
    f.one_ret = f.nrets == 1 and not f.returns_list  # one tensor returned: most ops
    alias_ret = []
    is_view = False
    for r in rets:
        info = r.alias_info
        target = None
        if info is not None:
            for s in info.before_set:
                if s in arg_alias_write:
                    target, write = arg_alias_write[s]
                    if not write:
                        is_view = True
            if not info.before_set and not info.is_write:
                is_view = True  # e.g. split: Tensor(a)[] returns, alias set on the argument
        alias_ret.append(target if (info is not None and info.is_write) else None)
    f.alias_ret = tuple(alias_ret)
    f.fresh_one = f.one_ret and not mutates and f.alias_ret == (None,)  # one fresh tensor returned: most ops
    tags = func.tags
    f.pointwise = torch.Tag.pointwise in tags and not mutates
    f.reason = "fallback"
    ns = schema.name.split("::")[0]
    if ns in _COLLECTIVE_NAMESPACES:
        f.kind, f.reason = FLUSH, "collective"  # Note [Collectives]
        f.mutates = base not in _COLLECTIVE_NON_WRITERS
    elif schema.name in _INLINE_CUSTOM_OPS:
        f.kind, f.decomposition = INLINE, _backend_kernel(func)  # Note [Ops run inline]
    elif f.name in _INLINE_DECOMPOSED:
        from torch._decomp import decomposition_table

        f.kind, f.decomposition = INLINE, decomposition_table[func]
    elif f.name in HOST_READERS:  # Note [Composites that read memory]
        f.kind, f.host_read, f.decomposition = HOST_READ, host_read_args(func), composite_kernel(func)
    elif ns == "profiler":
        # ``record_function``'s enter and exit (``Optimizer.step`` opens one each step): names and
        # handles, no tensor of the target's; run at once, as an allocation is
        f.kind = ALLOC
    elif ns != "aten":
        f.kind, f.reason = FLUSH, "fallback"  # custom ops: no meta we can trust
    elif base in _SYNC_REASONS or torch.Tag.data_dependent_output in tags:
        f.kind, f.reason = FLUSH, _SYNC_REASONS.get(base, "data_dependent")
    elif base in _METADATA_MUTATORS:
        f.kind, f.reason = FLUSH, "metadata_mutation"
    elif base in ALLOCATORS:
        f.kind = ALLOC
    elif f.name == "aten.native_batch_norm.default":
        f.kind = BATCH_NORM
    elif seeded and torch.Tag.nondeterministic_seeded in tags:
        if f.factory or base.endswith("_like"):
            f.kind = RANDOM_NEW
        elif mutates and tensor_pos == [0] and not list_pos and not tensor_kw and f.alias_ret == (0,):
            f.kind = RANDOM_FILL
        else:
            f.kind, f.reason = FLUSH, "random"
            for i, a in enumerate(schema.arguments):
                if a.name == "dropout_p" and str(a.type) == "float":  # Note [Dropout probability]
                    f.dropout_arg = (i, a.name)
                    f.unseeded = classify(func, seeded=False)
    elif is_view and not mutates:
        f.kind = VIEW
    else:
        f.kind = RECORD
        if torch.Tag.dynamic_output_shape in tags:
            f.reason = "dynamic_shape"
        elif "sparse" in base or "mkldnn" in base:
            f.reason = "sparse"  # it makes one (``_to_sparse``): Note [Tensors the mode leaves alone] in _state
    # the two kinds of op a template position holds besides views (Note [Hot windows] in
    # adaptive_eager._hot): one fresh output, positional tensors and numbers only, nothing written
    f.one_out = (
        f.kind == RECORD and not f.list_pos and not f.tensor_kw and not f.mutates and f.nrets == 1
        and not f.returns_list and f.alias_ret == (None,) and not f.factory and not f.scalarlist_pos
    )
    # and an op that writes and returns its first argument (``mul_``, ``addcdiv_``); other
    # arguments are positional tensors, numbers and non-tensor keywords (``alpha=``, ``value=``)
    f.writes_first = (
        f.kind == RECORD and not f.list_pos and not f.tensor_kw and f.write_pos == frozenset({0}) and f.nrets == 1
        and not f.returns_list and f.alias_ret == (0,) and not f.factory and not f.scalarlist_pos
        and f.tensor_pos[:1] == (0,) and not f.has_device_kw
    )
    if f.kind == RECORD:
        f.data_check = data_check_for(func, base)
        if f.data_check is not None:
            f.kind = CHECKED  # recorded as RECORD is
    f.lists_or_writes = bool(f.list_pos) or f.mutates  # neither for most ops: one test in ``_record``
    return f


# Note [Dropout probability]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The fused attention kernels (``_scaled_dot_product_flash_attention_for_cpu``, ``_efficient_attention``,
# ``_cudnn_attention``...) carry ``nondeterministic_seeded`` because they draw a dropout mask, but
# only when their ``dropout_p`` is not 0: in ``eval()`` and in models without attention dropout
# (Llama) a call reads no generator and is an ordinary op, recorded with the facts ``unseeded``
# holds (the op classified as if untagged). A call with dropout ends the window as other random ops
# that cannot be drawn at record time do (Note [RNG]); the CPU kernel never takes that path
# (``F.scaled_dot_product_attention`` with dropout on CPU runs the math decomposition, whose mask is
# a ``bernoulli_`` fill drawn at record time). The check costs nothing on the record path: only ops
# that would flush look at their arguments (``unseeded_facts``).


# Note [Dropout drawn at record time]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# On cpu ``F.dropout`` decomposes into a ``bernoulli_`` fill (drawn at record time, Note [RNG]); on
# a PrivateUse1 device (``neuron``) it is ``aten.native_dropout``, a random op that would end the
# window (eight flushes a step in examples/finetune_transformer.py). Its draw depends only on the
# input's geometry, not its values, so where we know how the device's kernel draws, the mask is
# drawn at record time as that kernel draws it and the rest is recorded:
# - CPU's kernel (``native_dropout_cpu``, ``CPU_KERNEL_DEVICES`` in _data_checks): a bool mask laid
#   out as ``empty_like(input)``, filled with ``bernoulli_(1 - p)`` on the device, then
#   ``input.mul(mask).mul_(scale)``, ``mul_.Scalar`` as the kernel calls it (for bfloat16 it rounds
#   unlike ``mul.Tensor`` with the same number). An input whose layout ``empty_like`` would not
#   keep runs the kernel, after a flush.
# - torch-neuronx's kernel (``neuron``, ``HOST_DRAWN_DROPOUT``; its source's
#   ``python_ops/jax/ops/native_dropout.py``, ../shared/TRAINIUM.md): the mask is drawn on the
#   host, from CPU's default generator, ``torch.bernoulli(torch.empty(shape, dtype=torch.bool),
#   1 - p)``, contiguous whatever the input's layout, then moved to the device, and the kernel
#   computes ``x * mask.astype(x.dtype) * scale`` in JAX, where a Python float multiplies in the
#   array's dtype. So ``host_dropout_masks`` draws with that very call (the generator consumed as
#   eager's kernel consumes it, in program order), moves the masks in one copy, and
#   ``mul(x, mask)`` then ``mul`` by ``host_dropout_scale`` (the scale rounded to x's dtype) are
#   recorded. The emulated device's ``native_dropout`` is torch-neuronx's (Note [Emulated dropout]
#   in adaptive_eager.neuron_emulation), so tests compare with its eager bit for bit, bfloat16 and
#   strided inputs included; a captured forward's masks are drawn the same way (Note [Masks drawn
#   by the call] in adaptive_eager._capture). On hardware this rests on the source read, not run.
# ``train=False`` and an empty input run the kernel, after a flush. Other kernels (CUDA's Philox)
# draw in ways that cannot be reproduced here, so on those devices the op still ends the window
# (a captured forward on them draws by calling eager's ``F.dropout``). ``adaptive_eager._mode.
# _dropout_now`` does the drawing.
HOST_DRAWN_DROPOUT = frozenset({"neuron"})


def host_dropout_masks(draws, device) -> list:
    """torch-neuronx's dropout masks for ``draws`` ((shape, p) each, in program order), drawn on the
    host as its kernel draws them and moved to ``device`` in one copy (Note [Dropout drawn at record
    time])."""
    masks = [torch.bernoulli(torch.empty(shape, dtype=torch.bool), 1.0 - p) for shape, p in draws]
    if len(masks) == 1:
        return [masks[0].to(device)]
    flat = torch.cat([m.reshape(-1) for m in masks]).to(device)
    return [part.view(m.shape) for part, m in zip(flat.split([m.numel() for m in masks]), masks)]


def host_dropout_scale(p: float, dtype: torch.dtype) -> float:
    """torch-neuronx's dropout scale, ``1 / (1 - p)`` as its kernel multiplies by it: in ``dtype``."""
    return float(torch.tensor(1.0 / (1.0 - p), dtype=dtype))


def unseeded_facts(f: OpFacts, args: tuple, kwargs: dict) -> OpFacts | None:
    """The facts to record this call of a FLUSH op with, when it draws no random numbers."""
    pos, name = f.dropout_arg
    p = args[pos] if len(args) > pos else kwargs.get(name, 0.0)
    return f.unseeded if p == 0 else None


FACTS: dict = {}


def facts_for(func) -> OpFacts:
    """The facts of op ``func``, classified at its first sight. They are kept on the op too
    (``OpOverload._ae_facts``), where the dispatch mode reads them: an attribute load, where a
    dict of ops hashes each in Python (``OpOverload.__hash__``)."""
    f = FACTS.get(func)
    if f is None:
        f = FACTS[func] = classify(func)
        try:
            func._ae_facts = f
        except (AttributeError, TypeError):  # an op object without a ``__dict__``: looked up here each time
            pass
    return f
