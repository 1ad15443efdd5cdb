"""Decompositions of ops torch-mlir cannot lower to StableHLO into ops it can (Note [Our decompositions]).

Note [Our decompositions]
~~~~~~~~~~~~~~~~~~~~~~~~~
torch-mlir (20261001) has no StableHLO lowering for some ops every training step meets (the
backward of max and average pooling: every CNN; ``addmv``; ``erfc``, ``erfinv``; the cumulative
``cumprod``/``cummax``/``cummin``; ``avg_pool2d`` with ``divisor_override``) and lowers
``fmax``/``fmin`` only between tensors of one shape (its broadcast compare gets the wrong result
type). Each ran alone: one more launch on Trainium, and a split region. ``decompositions`` adds
these to torch-mlir's own table, applied by the same ``make_fx`` pass before the import (Note
[StableHLO lowering] in ``fuser.backends._stablehlo_lowering``); each returns eager's dtype and
shape, and where it gives up (``NotImplemented``) the op stays and runs alone, as before.

- ``addmv``: torch's own decomposition (``mv``, ``mul``, ``add``).
- ``all``/``any`` over a list of dimensions: one ``all.dim``/``any.dim`` per dimension.
- batch norm in evaluation: the normalization with the running statistics, pointwise; torch-mlir's
  lowering returned the statistics as [C] where CPU's eager gives [0] (so on CPU it failed to lower).
- ``fmax``/``fmin``: ``maximum``/``minimum`` with the NaN of one side replaced by the other: exact.
- ``cumprod``/``cummax``/``cummin``: an inclusive scan in log2(n) steps (Hillis-Steele: step k
  combines each element with the one 2^k before it), ops torch-mlir lowers (slices, ``cat``,
  ``mul``/``where``). ``cummax``/``cummin`` are exact: they keep eager's ties (the later index wins)
  and NaN (a NaN wins, the latest NaN's index), a max under a total order, which a scan may
  associate in any order. ``cumprod`` multiplies in another order than eager (which accumulates a
  float32 product in float64), so it differs by rounding: a few ulp, within float32 tolerances;
  float16/bfloat16 scan in float32, as eager's accumulator does.
- ``erfc``/``erfinv``: float32 formulas (eager computes in float32, float16/bfloat16 through it):
  ``erfc`` Numerical Recipes' Chebyshev fit (fractional error < 1.2e-7) with ``exp(-z*z)`` split so
  that the square is exact (measured against float64 erfc over [-12, 12]: relative error <= 4.4e-7
  where the value is a normal float32, where ``1 - erf`` loses every digit past x = 4); ``erfinv``
  Giles' single-precision polynomials (measured relative error <= 2.6e-7 over (-1, 1); +-1 give
  +-inf, beyond them NaN). Not float32-accurate enough for float64 eager: a float64 input keeps the
  op, unless the region computes in 32 bits anyway (``narrow_64bit``, Note [64-bit types]).
- Pooling as matrices: average pooling over (H, W) is ``A_h @ x @ A_w.T`` with a row of ``A`` per
  output position (the window's input positions over its divisor; the divisor of ``avg_pool2d`` is a
  row factor times a column factor, for every ``ceil_mode``/``count_include_pad``/
  ``divisor_override``, as eager's kernel computes it). So ``avg_pool2d_backward`` and
  ``_adaptive_avg_pool2d_backward`` are ``A_h.T @ g @ A_w``, and ``avg_pool2d`` with a
  ``divisor_override`` (the only form torch-mlir does not lower) the forward product. Two small
  matmuls of (output x input) per plane: more arithmetic than a windowed sum for large images, all
  of it on the matmul engine. ``A`` is built from ``arange`` and compares, constant-folded by the compiler.
- ``_foreach_*`` (functional overloads; an optimizer's foreach step, as Dynamo traces it for a
  captured step): the op per tensor of the lists, its list arguments (``Tensor[]``, ``Scalar[]``)
  taken element by element and the others as they are: what torch's foreach fallback runs. Not
  one op in StableHLO either way: the lists become the executable's many inputs.
- ``max_pool2d_with_indices_backward``: ``scatter_add`` of the gradient at the saved flat indices.
  XLA clamps an index out of range (Note [Checked indices]), but these come from the forward's
  ``max_pool2d_with_indices`` and are in range by construction (eager does not check them either).
"""

from __future__ import annotations

import functools
import math

import torch

from ._common import foreach_decompositions

aten = torch.ops.aten
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def decompositions(narrow_64bit: bool, theirs: dict) -> dict:
    """Our decompositions (Note [Our decompositions]), by op overload; ``narrow_64bit``: the region
    computes in 32 bits, so the float32 formulas serve float64 inputs too. ``theirs``: torch-mlir's
    table, which the 0-dim wrappers (Note [Reductions over a 0-dim tensor]) call for other inputs."""
    table = {op: _or_theirs(ours, theirs[op]) if op in theirs else ours for op, ours in _table(narrow_64bit)}
    for op in _zero_dim_ops():
        table[op] = _over_one_element(op, table.get(op, theirs.get(op)))
    return table


@functools.cache
def _table(narrow_64bit: bool) -> tuple:
    from torch._decomp import decomposition_table

    float_formula = functools.partial(_float32_formula, narrow_64bit=narrow_64bit)
    return (
        (aten.addmv.default, decomposition_table[aten.addmv.default]),
        (aten.all.dims, functools.partial(_over_dims, aten.all.dim)),
        (aten.any.dims, functools.partial(_over_dims, aten.any.dim)),
        (aten.fmax.default, functools.partial(_nan_ignoring, torch.maximum)),
        (aten.fmin.default, functools.partial(_nan_ignoring, torch.minimum)),
        (aten.cumprod.default, _cumprod),
        (aten.cummax.default, functools.partial(_cumulative_extreme, torch.ge)),
        (aten.cummin.default, functools.partial(_cumulative_extreme, torch.le)),
        (aten.erfc.default, functools.partial(float_formula, _erfc)),
        (aten.erfinv.default, functools.partial(float_formula, _erfinv)),
        (aten.unsqueeze.default, _unsqueeze),
        (aten.squeeze.dim, _squeeze),
        (aten.squeeze.dims, _squeeze),
        (aten.native_batch_norm.default, functools.partial(_batch_norm, None)),
        (aten._native_batch_norm_legit.default,
         functools.partial(_batch_norm, decomposition_table[aten._native_batch_norm_legit.default])),
        (aten._native_batch_norm_legit_no_training.default, _batch_norm_evaluation),
        (aten.avg_pool2d.default, _avg_pool2d),
        (aten.avg_pool2d_backward.default, _avg_pool2d_backward),
        (aten._adaptive_avg_pool2d_backward.default, _adaptive_avg_pool2d_backward),
        (aten.max_pool2d_with_indices_backward.default, _max_pool2d_with_indices_backward),
        *foreach_decompositions().items(),  # Note [Foreach ops] in fuser.backends._common
    )


# Note [Reductions over a 0-dim tensor]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch-mlir's passes crash the process on a reduction or a ``dim`` op over a 0-dim tensor, so
# ``_crashes_torch_mlir`` refuses such graphs (Note [Lowerings that crash] in _stablehlo_lowering)
# and the op ran alone: ``amax``, ``argmax``, ``max``/``min``, ``all``/``any``, ``softmax``, ``var``...
# of a scalar (a loss, a norm). Over a 0-dim tensor each is the same op over that one element as a
# 1-element vector (dim 0 or -1 is dim 0 there), reshaped back to 0-dim: which is what the wrappers
# below trace, for the ops of ``_ZERO_DIM_PACKETS`` (all their results are 0-dim for a 0-dim input).
# Any other input goes to torch-mlir's own decomposition of the op, or none. ``unsqueeze`` and
# ``squeeze`` of a 0-dim tensor are reshapes (``torch.stack`` of scalars unsqueezes each: one op run
# alone per step of examples/finetune_transformer.py, in ``clip_grad_norm_``). The graph check after
# decomposition still refuses whatever 0-dim reduction is left.
_ZERO_DIM_PACKETS = (
    "amax", "amin", "argmax", "argmin", "max", "min", "aminmax", "all", "any", "sum", "nansum", "mean", "prod",
    "var", "std", "var_mean", "std_mean", "logsumexp", "linalg_vector_norm", "cumsum", "_softmax",
    "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
)


@functools.cache
def _zero_dim_ops() -> tuple:
    ops = []
    for name in _ZERO_DIM_PACKETS:
        packet = getattr(aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            arguments = op._schema.arguments
            if (not overload.endswith("out") and arguments and str(arguments[0].type) == "Tensor"
                    and not any(a.is_out for a in arguments)):
                ops.append(op)
    return tuple(ops)


def _or_theirs(ours, theirs):
    """``ours``, and where it gives up (NotImplemented), torch-mlir's decomposition of the op."""

    def decomposed(*args, **kwargs):
        out = ours(*args, **kwargs)
        return theirs(*args, **kwargs) if out is NotImplemented else out

    return decomposed


def _unsqueeze(x: torch.Tensor, dim: int):
    """Of a 0-dim tensor (``torch.stack`` of scalars: clip_grad_norm_'s norms), a reshape to [1]."""
    return x.reshape(1) if x.dim() == 0 else NotImplemented


def _squeeze(x: torch.Tensor, dim):
    return x.reshape(()) if x.dim() == 0 else NotImplemented


def _over_one_element(op, theirs):
    names = [a.name for a in op._schema.arguments]

    def decomposed(*args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if not (isinstance(args[0], torch.Tensor) and all(t.dim() == 0 for t in tensors)):
            # (max.other of a 0-dim and a vector broadcasts: not over one element)
            return NotImplemented if theirs is None else theirs(*args, **kwargs)

        def vector(v, name):
            if isinstance(v, torch.Tensor) and v.dim() == 0:
                return v.reshape(1)
            if name == "dim" and isinstance(v, int):
                return 0
            if name == "dim" and isinstance(v, (list, tuple)):
                return [0] * len(v)
            return v

        out = op(*(vector(v, n) for v, n in zip(args, names)), **{k: vector(v, k) for k, v in kwargs.items()})
        if isinstance(out, torch.Tensor):
            return out.reshape(())
        return type(out)(t.reshape(()) if isinstance(t, torch.Tensor) else t for t in out)

    return decomposed


# ---------------------------------------------------------------------------------------- pointwise


def _nan_ignoring(extreme, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fmax / fmin: ``extreme`` (which propagates NaN), but a NaN on one side gives the other."""
    dtype = torch.result_type(a, b)
    a, b = a.to(dtype), b.to(dtype)
    out = extreme(a, b)
    if dtype.is_floating_point:
        out = torch.where(torch.isnan(a), b, torch.where(torch.isnan(b), a, out))
    return out


def _over_dims(reduce, x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """all.dims / any.dims as one ``reduce`` (all.dim / any.dim) per dimension, the last first; an
    empty list reduces nothing (eager's: x as bool), None every dimension."""
    if dim is None:
        dim = range(x.dim())
    dims = sorted({d % max(x.dim(), 1) for d in dim}, reverse=True)
    if not dims:
        return x != 0 if x.dtype != torch.uint8 else (x != 0).to(torch.uint8)
    out = x
    for d in dims:
        out = reduce(out, d, keepdim)
    return out


def _float32_formula(formula, x: torch.Tensor, *, narrow_64bit: bool):
    dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
    if dtype == torch.float64 and not narrow_64bit:
        return NotImplemented  # float32-accurate only: the op runs alone
    compute = torch.float32 if dtype in _LOW_PRECISION else dtype
    return formula(x.to(compute)).to(dtype)


# Numerical Recipes' erfcc: erfc(z) = t * exp(-z^2 + P(t)), t = 1 / (1 + z/2), z >= 0
_ERFC = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398,
         1.48851587, -0.82215223, 0.17087277)


def _erfc(x: torch.Tensor) -> torch.Tensor:
    z = x.abs().clamp(max=12.0)  # erfc(12) underflows float32; keeps inf out of the split below
    t = 1 / (1 + 0.5 * z)
    p = torch.full_like(t, _ERFC[-1])
    for c in reversed(_ERFC[:-1]):
        p = c + t * p
    hi = torch.floor(z * 256) / 256  # 12 significant bits: hi * hi is exact in float32
    tail = t * torch.exp(-hi * hi) * torch.exp((hi - z) * (z + hi) + p)
    return torch.where(x >= 0, tail, 2 - tail)


# Giles, "Approximating the erfinv function" (GPU Computing Gems, 2011), single precision
_ERFINV_CENTRAL = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
                   -0.00125372503, -0.00417768164, 0.246640727, 1.50140941)
_ERFINV_TAIL = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
                -0.0076224613, 0.00943887047, 1.00167406, 2.83297682)


def _erfinv(x: torch.Tensor) -> torch.Tensor:
    w = -torch.log((1 - x) * (1 + x))

    def horner(coefficients, u):
        p = torch.full_like(u, coefficients[0])
        for c in coefficients[1:]:
            p = c + p * u
        return p

    p = torch.where(w < 5, horner(_ERFINV_CENTRAL, w - 2.5), horner(_ERFINV_TAIL, torch.sqrt(w) - 3))
    return torch.where(x.abs() == 1, x * math.inf, p * x)


def _batch_norm(training_decomposition, x, weight, bias, running_mean, running_var, training, momentum, eps):
    if training or running_mean is None or running_var is None:
        return NotImplemented if training_decomposition is None else training_decomposition(
            x, weight, bias, running_mean, running_var, training, momentum, eps)
    return _batch_norm_evaluation(x, weight, bias, running_mean, running_var, momentum, eps)


def _batch_norm_evaluation(x, weight, bias, running_mean, running_var, momentum, eps):
    """Batch norm with the running statistics, and the statistics eager returns: empty on CPU, the
    running mean and invstd on any other device (Note [Emulated batch-norm statistics] in
    adaptive_eager.neuron_emulation); torch-mlir's own lowering returns [C] on CPU too and fails."""
    dtype = _compute_dtype(x)
    shape = [1, -1] + [1] * (x.dim() - 2)
    invstd = 1 / torch.sqrt(running_var.to(dtype) + eps)
    out = (x.to(dtype) - running_mean.to(dtype).reshape(shape)) * invstd.reshape(shape)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    if x.device.type == "cpu":
        return out.to(x.dtype), x.new_zeros((0,), dtype=dtype), x.new_zeros((0,), dtype=dtype)
    return out.to(x.dtype), running_mean.to(dtype, copy=True), invstd


# ----------------------------------------------------------------------------------------- scans


def _scan(values: tuple[torch.Tensor, ...], dim: int, combine) -> tuple[torch.Tensor, ...]:
    """Inclusive scan of ``values`` along ``dim`` with the associative ``combine(earlier, later)``."""
    n, k = values[0].shape[dim], 1
    while k < n:
        earlier = tuple(v.narrow(dim, 0, n - k) for v in values)
        later = tuple(v.narrow(dim, k, n - k) for v in values)
        values = tuple(torch.cat([v.narrow(dim, 0, k), c], dim) for v, c in zip(values, combine(earlier, later)))
        k *= 2
    return values


def _cumprod(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    if dtype is None:
        dtype = x.dtype if x.is_floating_point() or x.is_complex() else torch.int64
    compute = torch.float32 if dtype in _LOW_PRECISION else dtype
    x = x.to(compute)
    if x.dim() == 0:
        return x.clone().to(dtype)
    (out,) = _scan((x,), dim % x.dim(), lambda a, b: (a[0] * b[0],))
    return out.to(dtype)


def _cumulative_extreme(wins, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cummax (``wins`` = ge) / cummin (le): the later element wins a tie and a NaN wins, as in
    eager's loop (``isnan(x) || (!isnan(out) && x >= out)``)."""
    if x.dim() == 0:
        return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
    dim = dim % x.dim()
    n = x.shape[dim]
    shape = [1] * x.dim()
    shape[dim] = n
    index = torch.arange(n, dtype=torch.int64, device=x.device).reshape(shape).expand(x.shape)
    nan = x.is_floating_point()

    def combine(earlier, later):
        (va, ia), (vb, ib) = earlier, later
        later_wins = wins(vb, va)
        if nan:
            later_wins = torch.isnan(vb) | (~torch.isnan(va) & later_wins)
        return torch.where(later_wins, vb, va), torch.where(later_wins, ib, ia)

    return _scan((x, index), dim, combine)


# --------------------------------------------------------------------------------------- pooling


def _pair(v) -> list[int]:
    v = [v] if isinstance(v, int) else list(v)
    return v * 2 if len(v) == 1 else v


def _out_size(size: int, kernel: int, stride: int, pad: int, ceil_mode: bool) -> int:
    out = (size + 2 * pad - kernel + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + pad:
        out -= 1  # the last window must start inside the input or its left padding
    return out


def _window_matrix(start: torch.Tensor, end: torch.Tensor, size: int, divisor: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """[outputs, size]: row i is 1 / divisor[i] on positions start[i] <= h < end[i], else 0."""
    h = torch.arange(size, dtype=torch.int64, device=start.device)
    inside = (h >= start.unsqueeze(1)) & (h < end.unsqueeze(1))
    return inside.to(dtype) / divisor.unsqueeze(1).to(dtype)


def _avg_matrices(x: torch.Tensor, out_hw, kernel_size, stride, padding, ceil_mode, count_include_pad,
                  divisor_override, dtype) -> list[torch.Tensor]:
    """A_h, A_w of avg_pool2d (Note [Our decompositions]), divisors as eager's kernel computes them:
    the window [i*s - p, i*s - p + k) cut at the padded end gives ``count_include_pad``'s divisor,
    cut to the input the one without, and an empty window an output of 0."""
    kernel, stride = _pair(kernel_size), _pair(stride) if stride else _pair(kernel_size)
    padding = _pair(padding)
    matrices = []
    for axis in range(2):
        size, k, s, p = x.shape[-2 + axis], kernel[axis], stride[axis], padding[axis]
        start = torch.arange(out_hw[axis], dtype=torch.int64, device=x.device) * s - p
        end = torch.clamp(start + k, max=size + p)
        lo, hi = start.clamp(min=0), end.clamp(max=size)
        if divisor_override is not None:
            divisor = torch.full_like(start, divisor_override if axis == 0 else 1)
        elif count_include_pad:
            divisor = end - start
        else:
            divisor = (hi - lo).clamp(min=1)  # an empty window's row is all zeros anyway
        matrices.append(_window_matrix(lo, hi, size, divisor, dtype))
    return matrices


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.dtype in _LOW_PRECISION else t.dtype


def _avg_pool2d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    if divisor_override is None:
        return NotImplemented  # torch-mlir lowers it
    kernel, strides, pads = _pair(kernel_size), _pair(stride) if stride else _pair(kernel_size), _pair(padding)
    out_hw = [_out_size(x.shape[-2 + a], kernel[a], strides[a], pads[a], ceil_mode) for a in range(2)]
    dtype = _compute_dtype(x)
    a_h, a_w = _avg_matrices(x, out_hw, kernel_size, stride, padding, ceil_mode, count_include_pad,
                             divisor_override, dtype)
    return (a_h @ x.to(dtype) @ a_w.t()).to(x.dtype)


def _avg_pool2d_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    dtype = _compute_dtype(grad)
    a_h, a_w = _avg_matrices(x, grad.shape[-2:], kernel_size, stride, padding, ceil_mode, count_include_pad,
                             divisor_override, dtype)
    return (a_h.t() @ grad.to(dtype) @ a_w).to(grad.dtype)


def _adaptive_avg_pool2d_backward(grad, x):
    """Output i averages input positions floor(i*H/oh) <= h < ceil((i+1)*H/oh)."""
    dtype = _compute_dtype(grad)
    matrices = []
    for axis in range(2):
        size, out = x.shape[-2 + axis], grad.shape[-2 + axis]
        i = torch.arange(out, dtype=torch.int64, device=x.device)
        start, end = (i * size) // out, ((i + 1) * size + out - 1) // out
        matrices.append(_window_matrix(start, end, size, end - start, dtype))
    a_h, a_w = matrices
    return (a_h.t() @ grad.to(dtype) @ a_w).to(grad.dtype)


def _max_pool2d_with_indices_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    dtype = _compute_dtype(grad)
    plane = x.shape[-2] * x.shape[-1]
    flat = torch.zeros((*x.shape[:-2], plane), dtype=dtype, device=grad.device)
    flat = flat.scatter_add(-1, indices.flatten(-2), grad.to(dtype).flatten(-2))
    return flat.reshape(x.shape).to(grad.dtype)
