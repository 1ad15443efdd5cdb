"""Dropout masks computed inside the compiled code, ``dropout='compiled'`` (Note [Dropout in the
compiled code])."""

from __future__ import annotations

import functools

import torch

# Note [Dropout in the compiled code]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# By default dropout keeps eager's random numbers (Note [Dropout drawn at record time] in _ops,
# Note [Masks drawn by the call] in _capture). On ``neuron`` that means torch-neuronx's own way:
# every mask is drawn on the host, from CPU's generator, and copied onto the device. Its bits
# cannot come from compiled code: they are the host's Mersenne Twister stream consumed element by
# element by ``bernoulli_``, a sequential recurrence on the host's generator state. So a training
# step with dropout launches one copy more than the step's executables (4 for the stock GPT-2 and
# BERT, against 3 without dropout: benchmarks/RESULTS.md), and the host draws and moves a byte per
# element of every mask: 50 ms of host time for one mask of GPT-2's hidden states at batch 8 x 1024
# tokens on this machine's core, ~25 such masks a step.
#
# ``dropout='compiled'`` (off by default: it keeps eager's distribution, not its numbers) computes
# each mask in the graph instead, from a counter-based hash (no generator state in the graph): a
# 0-dim int32 ``state`` tensor kept on the device, and for the k-th mask of a call
# ``keep = mix((state + k) * GOLDEN + arange(numel)) & 0xFFFFFF < round((1 - p) * 2**24)``, where
# ``mix`` is a 32-bit integer finalizer (xor-shift-multiply, "lowbias32"), all in int32 ATen ops
# that wrap as XLA's and Inductor's integers do (the logical shifts as floor divisions: torch-mlir
# lowers no shift by a scalar), so every backend lowers it and the op-by-op run gives the same masks
# as the compiled one. The mask then multiplies as eager's kernel does (the scale in the input's
# dtype on ``neuron``). The state starts from ``torch.initial_seed()`` and restarts at each
# ``torch.manual_seed`` (wrapped once the first such mask is made), so a seeded run repeats; no
# generator is consumed, so the program's other random numbers stay eager's. It advances by the
# number of masks: a recorded window threads it through its ops (mask k of the window from the
# state after k masks, then ``state + 1``), a captured forward takes it as an input, computes
# mask k from ``state + k`` and writes ``state + n`` back in place; so the hot window, the
# captured call and the op-by-op run make the same masks from the same seed.
# Only ``native_dropout`` is drawn so, the op a device with a fused dropout kernel (``neuron``,
# ``cuda``) dispatches (a strided input on ``cuda``, and an input of 2**31 elements or more, whose
# index would not fit in int32, keep eager's masks); on cpu ``F.dropout`` is
# a ``bernoulli_`` fill, drawn as eager draws it, and a captured call on cpu draws as eager too.
# Measured (benchmarks/neuron_launches.py, RESULTS.md): the stock GPT-2 and BERT with dropout 0.1
# make 3 launches a step on the emulated device, against 4 with eager's masks.
MODES = ("eager", "compiled")
MAX_NUMEL = 1 << 31  # an int32 index per element: a larger input's mask is eager's
_MASK_BITS = 24
_GOLDEN = -1640531527  # 0x9E3779B9 as an int32
_M1 = 0x7FEB352D
_M2 = -2073254261  # 0x846CA68B as an int32

_aten = torch.ops.aten
_states: dict = {}  # device -> (the initial seed it started from, its current state tensor)


def _int32(n: int) -> int:
    n &= 0xFFFFFFFF
    return n - (1 << 32) if n >= 1 << 31 else n


def current_state(device: torch.device):
    """The device's state tensor, made (one copy onto the device) at first use, after
    ``torch.manual_seed`` or where the initial seed changed; ``(tensor, made)``."""
    seed = torch.initial_seed()
    held = _states.get(device)
    if held is not None and held[0] == seed:
        return held[1], False
    _restart_on_reseed()
    with torch.no_grad():
        state = torch.tensor(_int32(seed ^ (seed >> 32)), dtype=torch.int32).to(device)
    _states[device] = (seed, state)
    return state, True


def _restart_on_reseed() -> None:
    """``torch.manual_seed`` restarts the masks from its seed, as it restarts eager's draws (the
    initial seed alone does not tell a second seed of the same value)."""
    original = torch.random.manual_seed
    if getattr(original, "restarts_dropout", False):
        return

    @functools.wraps(original)
    def manual_seed(seed):
        _states.clear()
        return original(seed)

    manual_seed.restarts_dropout = True
    torch.manual_seed = torch.random.manual_seed = manual_seed


def advance(device: torch.device, state) -> None:
    """The state after a recorded mask (a pending tensor of the window)."""
    _states[device] = (_states[device][0], state)


def keep_mask(call, state, shape, p: float, k: int, device):
    """The bool mask of ``shape`` that keeps each element with probability ``1 - p``, computed with
    ``call(op, args, kwargs)`` (records, emits graph nodes or runs) from ``state`` and ``k``."""
    numel = 1
    for n in shape:
        numel *= n

    def shifted_xor(x, by):  # x ^ (x >>> by): a floor division (torch-mlir lowers no shift by a scalar), masked
        high = call(_aten.bitwise_and.Scalar, (call(_aten.div.Tensor_mode, (x, 1 << by), {"rounding_mode": "floor"}),
                                               (1 << (32 - by)) - 1), {})
        return call(_aten.bitwise_xor.Tensor, (x, high), {})

    key = call(_aten.mul.Tensor, (call(_aten.add.Tensor, (state, k), {}) if k else state, _GOLDEN), {})
    x = call(_aten.arange.start, (0, numel), {"dtype": torch.int32, "device": device})
    x = call(_aten.add.Tensor, (x, key), {})
    x = call(_aten.mul.Tensor, (shifted_xor(x, 16), _M1), {})
    x = call(_aten.mul.Tensor, (shifted_xor(x, 15), _M2), {})
    x = call(_aten.bitwise_and.Scalar, (shifted_xor(x, 16), (1 << _MASK_BITS) - 1), {})
    keep = call(_aten.lt.Scalar, (x, round((1.0 - p) * (1 << _MASK_BITS))), {})
    return call(_aten.view.default, (keep, list(shape)), {})
