"""PyTorch's OpInfo database as a differential test: every float32 CPU sample, eager vs adaptive eager.

Each sample runs on exact copies of its inputs, twice eagerly (to tell ops whose output is undefined
from ops that are merely random) and once under ``adaptive_eager()``. Everything the program can
observe must match: outputs (values, dtype, shape, strides, also while pending), the inputs after
the call (in-place ops), which outputs alias which inputs, and the exception type when eager raises.
Every sample also runs with its inputs made inside the window (pending placeholders), with OpInfo's
in-place form of the op where there is one (also writing an expanded tensor, which eager refuses or
allows at the call), and with its 4-d tensors in channels_last. OpInfo's error inputs must raise
the eager exception, at the call when the op's meta kernel can see the error, else no later than
the sync point.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import re
import time
import types

import pytest
import torch
from torch.utils._pytree import tree_map

from _oracle import aliasing, clone_exact, first_difference, tensors_in
from adaptive_eager import adaptive_eager, is_enabled, metrics

SAMPLES_PER_OP = 5
# Each sample's window is new, so under the defaults (hot_after=2) it would replay anyway; naming the
# backend keeps background compiles of the windows that do repeat (error inputs) off the shared CPUs.
# Compiled regions are exercised by test_generated_programs.py.
BACKEND = "replay"
REQUIRED_AGREEMENT = 0.97
THIS_FILE = __file__.rsplit("/", 1)[-1]

# Outputs read memory that was never written, so two eager runs need not agree; only their
# metadata is comparable. Random ops are not here: a seed makes them comparable.
UNINITIALIZED_OUTPUT = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"}


@pytest.fixture(autouse=True)
def _no_stack_walk(monkeypatch):
    """OpInfo's samples look for the unittest method that asks for them (``extract_test_fn``, an
    ``inspect.stack()`` per sample list, whose cost grows with the modules loaded): late in the
    whole suite a third of this module's time. Under pytest there is none to find."""
    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core

    for module in (common_utils, core):  # core imports it by name
        monkeypatch.setattr(module, "extract_test_fn", lambda: None)


@pytest.fixture(scope="module")
def float32_ops():
    from torch.testing._internal.common_methods_invocations import op_db

    return [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")]


def full_name(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _short(error: BaseException) -> str:
    return " ".join(str(error).split())[:200]


def is_sparse(tree) -> bool:
    return any(t.layout is not torch.strided for t in tensors_in(tree))


def _clone_tensor(x):
    return x.clone() if isinstance(x, torch.Tensor) else x


@dataclasses.dataclass
class Outcome:
    result: object = None
    error: BaseException | None = None
    inputs: object = None
    raised_at_sync: bool = False  # the call returned; the error came when the window ran
    strides_at_call: list | None = None  # the outputs' strides when the call returned (pending, lazily)


def run_sample(call, sample, lazy: bool, pending_inputs: bool = False) -> Outcome:
    # A lazy run that failed to leave the mode would turn the oracle into the thing under test.
    assert not is_enabled(), "adaptive eager is still on from an earlier run"
    inputs = clone_exact((sample.input, sample.args, sample.kwargs))
    returned = False
    # Every run draws from the same generator state: random ops are compared value for value.
    # (Only the CPU generator: torch.manual_seed also queues a CUDA seeding with a stack trace.)
    torch.default_generator.manual_seed(0)
    try:
        with adaptive_eager(backend=BACKEND) if lazy else contextlib.nullcontext():
            if pending_inputs:
                # Inputs made inside the window are placeholders whose values do not exist yet:
                # the op must read (and write) them through the window, not through memory.
                inputs = tree_map(_clone_tensor, inputs)
            first, args, kwargs = inputs
            result = call(first, *args, **kwargs)
            returned = True
            # read while the values are pending: the flush must not be what makes them eager's
            strides = [t.stride() for t in tensors_in(result) if t.layout is torch.strided]
    except Exception as e:  # noqa: BLE001 - the exception type is part of what is compared
        return Outcome(error=e, inputs=inputs, raised_at_sync=returned)
    return Outcome(result=result, inputs=inputs, strides_at_call=strides)


def compare(eager: Outcome, lazy: Outcome, values: bool) -> str | None:
    if eager.error is not None or lazy.error is not None:
        if eager.error is None:
            return f"lazy raised {type(lazy.error).__name__} ({_short(lazy.error)}), eager did not"
        if lazy.error is None:
            return f"eager raised {type(eager.error).__name__} ({_short(eager.error)}), lazy did not"
        if type(eager.error) is not type(lazy.error):
            return f"lazy raised {type(lazy.error).__name__} ({_short(lazy.error)}), eager {type(eager.error).__name__}"
        return None
    return (
        first_difference(eager.result, lazy.result, "output", values=values)
        or first_difference(eager.inputs, lazy.inputs, "inputs after the call", values=values)
        or _aliasing_difference(eager, lazy)
        or _pending_strides_difference(eager, lazy)
    )


def _pending_strides_difference(eager: Outcome, lazy: Outcome) -> str | None:
    if lazy.strides_at_call != eager.strides_at_call:
        return f"output strides while pending {lazy.strides_at_call}, eager {eager.strides_at_call}"
    return None


def _aliasing_difference(eager: Outcome, lazy: Outcome) -> str | None:
    expected = aliasing(eager.result, eager.inputs)
    actual = aliasing(lazy.result, lazy.inputs)
    if expected != actual:
        return f"outputs alias inputs {actual}, eager {expected}"
    return None


@dataclasses.dataclass
class Tally:
    agreed: int = 0
    recorded_lazily: int = 0
    ran_eagerly: int = 0
    disagreements: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    metadata_only: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    skipped: dict = dataclasses.field(default_factory=dict)

    @property
    def compared(self) -> int:
        return self.agreed + sum(len(v) for v in self.disagreements.values())

    @property
    def rate(self) -> float:
        return self.agreed / self.compared

    def count_recording(self, ops_recorded_before: int) -> None:
        if metrics()["ops_recorded"] > ops_recorded_before:
            self.recorded_lazily += 1
        else:
            self.ran_eagerly += 1

    def print_summary(self, title: str, seconds: float, required: float) -> None:
        print(f"\n{title}: {self.compared} samples compared in {seconds:.0f} s")
        print(f"  agreement {self.agreed}/{self.compared} = {self.rate:.2%} (required {required:.0%})")
        print(f"  samples that recorded lazily: {self.recorded_lazily}, ran eagerly: {self.ran_eagerly}")
        for name, count in sorted(self.metadata_only.items()):
            print(f"  values not compared, nondeterministic by design: {name} ({count} samples, metadata compared)")
        for name, reason in sorted(self.skipped.items()):
            print(f"  skipped {name}: {reason}")
        for name, diffs in sorted(self.disagreements.items()):
            print(f"  DISAGREE {name} ({len(diffs)} samples): {diffs[0]}")


def variants(op):
    """(name, callable) pairs: the op itself and, where OpInfo has one, its in-place form."""
    name = full_name(op)
    yield name, op
    if op.inplace_variant is not None:
        yield f"{name} (in-place)", op.inplace_variant


def check_op_samples(op, tally: Tally) -> None:
    name = full_name(op)
    try:
        samples = list(itertools.islice(op.sample_inputs("cpu", torch.float32, requires_grad=False), SAMPLES_PER_OP))
    except Exception as e:  # noqa: BLE001 - a broken OpInfo is reported, not fatal
        tally.skipped[name] = f"sample_inputs raised {type(e).__name__}: {_short(e)}"
        return
    for sample in samples:
        if is_sparse((sample.input, sample.args, sample.kwargs)):
            tally.skipped.setdefault(name, "sparse layout (out of scope)")
            continue
        for variant, call in variants(op):
            for pending_inputs in (False, True):
                label = f"{variant} [pending inputs]" if pending_inputs else variant
                check_sample(call, sample, label, op.name, pending_inputs, tally)
        nhwc = channels_last(sample)
        if nhwc is not None:  # output layouts that follow a memory format (Note [Eager layouts])
            for pending_inputs in (False, True):
                label = f"{name} [channels_last{', pending inputs' if pending_inputs else ''}]"
                check_sample(op, nhwc, label, op.name, pending_inputs, tally)
        expanded = expanded_input(sample) if op.inplace_variant is not None else None
        if expanded is not None:  # a write eager refuses (or allows) from metadata: Note [Overlapping writes]
            check_sample(op.inplace_variant, expanded, f"{name} (in-place) [expanded input]", op.name, False, tally,
                         errors_at_call=True)


def expanded_input(sample):
    """``sample`` with its input (what an in-place op writes) an expand of its first row, or None."""
    x = sample.input
    if not isinstance(x, torch.Tensor) or x.layout is not torch.strided or x.dim() == 0 or x.shape[0] < 2:
        return None
    return types.SimpleNamespace(input=x[:1].expand(x.shape), args=sample.args, kwargs=sample.kwargs)


def channels_last(sample):
    """``sample`` with its 4-d tensors in channels_last, or None if it has none."""
    found = []

    def convert(x):
        if isinstance(x, torch.Tensor) and x.layout is torch.strided and x.dim() == 4 and x.is_contiguous():
            found.append(x)
            return x.contiguous(memory_format=torch.channels_last)
        return x

    converted = tree_map(convert, (sample.input, sample.args, sample.kwargs))
    return types.SimpleNamespace(input=converted[0], args=converted[1], kwargs=converted[2]) if found else None


def check_sample(call, sample, label: str, op_name: str, pending_inputs: bool, tally: Tally,
                 errors_at_call: bool = False) -> None:
    """``errors_at_call``: an error eager raises must come at the call, with eager's message."""
    eager = run_sample(call, sample, lazy=False, pending_inputs=pending_inputs)
    if is_sparse(eager.result):
        tally.skipped.setdefault(label, "sparse layout (out of scope)")
        return
    eager_again = run_sample(call, sample, lazy=False, pending_inputs=pending_inputs)
    values = op_name not in UNINITIALIZED_OUTPUT and compare(eager, eager_again, values=True) is None
    before = metrics()["ops_recorded"]
    lazy = run_sample(call, sample, lazy=True, pending_inputs=pending_inputs)
    tally.count_recording(before)
    diff = compare(eager, lazy, values)
    if diff is None and errors_at_call and eager.error is not None:
        if lazy.raised_at_sync:
            diff = f"raised at the sync point, not at the call: {_short(lazy.error)}"
        elif str(lazy.error) != str(eager.error):
            diff = f"message {_short(lazy.error)!r}, eager {_short(eager.error)!r}"
    if diff is not None:
        tally.disagreements[label].append(diff)
    elif values:
        tally.agreed += 1
    else:
        tally.metadata_only[label] += 1


@pytest.mark.filterwarnings("ignore")
def test_opinfo_samples_agree_with_eager(float32_ops, capsys):
    tally = Tally()
    start = time.perf_counter()
    for op in float32_ops:
        check_op_samples(op, tally)
    with capsys.disabled():
        tally.print_summary(f"OpInfo samples ({len(float32_ops)} ops)", time.perf_counter() - start, REQUIRED_AGREEMENT)
    assert tally.rate >= REQUIRED_AGREEMENT, f"agreement {tally.rate:.2%} < {REQUIRED_AGREEMENT:.0%}"
    # Agreement proves nothing if the samples never reached the window.
    assert tally.recorded_lazily > tally.ran_eagerly


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def meta_raises(op, sample, error_type) -> bool:
    """Whether the op's meta kernel (what the tracer runs at record time) already sees the error."""
    first, args, kwargs = tree_map(_to_meta, (sample.input, sample.args, sample.kwargs))
    try:
        op(first, *args, **kwargs)
    except error_type:
        return True
    except Exception:  # noqa: BLE001 - any other failure means meta cannot tell
        return False
    return False


def check_error_input(op, error_input, pending_inputs: bool, tally: Tally) -> None:
    name = full_name(op)
    label = f"{name} [pending inputs]" if pending_inputs else name
    sample, error_type = error_input.sample_input, error_input.error_type
    if is_sparse((sample.input, sample.args, sample.kwargs)):
        tally.skipped.setdefault(name, "sparse layout (out of scope)")
        return
    eager = run_sample(op, sample, lazy=False, pending_inputs=pending_inputs)
    if not isinstance(eager.error, error_type) or not re.search(error_input.error_regex, str(eager.error)):
        tally.skipped[label] = f"eager does not raise what OpInfo expects ({type(eager.error).__name__})"
        return
    before = metrics()["ops_recorded"]
    lazy = run_sample(op, sample, lazy=True, pending_inputs=pending_inputs)
    tally.count_recording(before)
    diff = compare(eager, lazy, values=True)
    if diff is None and not re.search(error_input.error_regex, str(lazy.error)):
        diff = f"message {_short(lazy.error)!r} does not match eager's {error_input.error_regex!r}"
    if diff is None and lazy.raised_at_sync:
        if meta_raises(op, sample, error_type):
            diff = "raised at the sync point, not at the call, though the meta kernel sees the error"
        elif THIS_FILE not in str(lazy.error):
            diff = f"deferred error does not name the user's line: {_short(lazy.error)!r}"
    if diff is not None:
        tally.disagreements[label].append(diff)
    else:
        tally.agreed += 1


@pytest.mark.slow  # ~80 s; the overlapping-write and tracer tests check eager's errors in the default run
@pytest.mark.filterwarnings("ignore")
def test_opinfo_error_inputs_raise_like_eager(float32_ops, capsys):
    tally = Tally()
    start = time.perf_counter()
    for op in float32_ops:
        if op.error_inputs_func is None:
            continue
        try:
            error_inputs = list(op.error_inputs("cpu"))
        except Exception as e:  # noqa: BLE001 - a broken OpInfo is reported, not fatal
            tally.skipped[full_name(op)] = f"error_inputs raised {type(e).__name__}: {_short(e)}"
            continue
        for error_input in error_inputs:
            for pending_inputs in (False, True):
                check_error_input(op, error_input, pending_inputs, tally)
    with capsys.disabled():
        tally.print_summary("OpInfo error inputs", time.perf_counter() - start, REQUIRED_AGREEMENT)
    assert tally.rate >= REQUIRED_AGREEMENT, f"agreement {tally.rate:.2%} < {REQUIRED_AGREEMENT:.0%}"
