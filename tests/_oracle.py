"""Plain eager as the oracle: exact copies of a program's inputs, and the first observable difference.

Shared by the differential tests; this module holds no tests.
"""

from __future__ import annotations

import math
import os

import torch
from torch.utils._pytree import tree_map

# The options the differential tests run under. Replay is exact and fast; a generated program's
# windows are new, so under the defaults (hot_after=2) they would replay too: the compiled variant
# compiles every window at first sight, in this thread, so every run is a compiled one.
REPLAY = {"backend": "replay"}
COMPILED = {"backend": "inductor", "hot_after": 1, "async_compile": False}


CACHE_ENV = "NEURON_EAGER_CACHE_DIR"


def program_env(drop: tuple[str, ...] = ("NEURON_EAGER",)) -> dict:
    """The environment of a program a test runs in a fresh process: this one's without the
    variables that start with ``drop`` (the settings the test gives it are its own), but with the
    test session's cache (conftest's ``_private_cache_dir``), so that it never writes the user's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    if CACHE_ENV in os.environ:
        env.setdefault(CACHE_ENV, os.environ[CACHE_ENV])
    return env


def clone_exact(tree):
    """Copy every tensor in ``tree`` with its storage, offset, sizes and strides.

    ``Tensor.clone()`` would make expanded, overlapping or offset inputs dense, and would split two
    inputs that share a storage; both change what an op sees (its kernel path, whether an in-place
    write shows through another argument). Copying the storage keeps all of that.
    """
    copies: dict[int, torch.Tensor] = {}

    def copy(x):
        if not isinstance(x, torch.Tensor) or x.layout is not torch.strided:
            return x
        storage = x.untyped_storage()
        key = storage._cdata
        if key not in copies:
            # the bytes copied as a tensor, not ``storage.clone()``: an emulated neuron tensor's
            # storage holds no memory (Note [Emulated storage]); the copy's tensor keeps it live
            copies[key] = torch.empty(0, dtype=torch.uint8, device=x.device).set_(storage).clone()
        out = torch.empty(0, dtype=x.dtype, device=x.device)
        out.set_(copies[key].untyped_storage(), x.storage_offset(), x.size(), x.stride())
        return out

    return tree_map(copy, tree)


def tensors_in(tree) -> list[torch.Tensor]:
    found = []
    tree_map(lambda x: found.append(x) if isinstance(x, torch.Tensor) else None, tree)
    return found


def aliasing(outputs, inputs) -> list[int | None]:
    """For each output tensor, the index of the first input tensor whose storage it shares."""
    storages = [t.untyped_storage()._cdata if t.untyped_storage().nbytes() else None for t in tensors_in(inputs)]
    found = []
    for t in tensors_in(outputs):
        key = t.untyped_storage()._cdata if t.untyped_storage().nbytes() else None
        found.append(storages.index(key) if key is not None and key in storages else None)
    return found


def _significant_strides(t: torch.Tensor) -> tuple:
    # A dimension of size 0 or 1 is never stepped over, so its stride is not observable.
    return tuple(s for n, s in zip(t.shape, t.stride()) if n > 1) if t.numel() > 1 else ()


def tensor_difference(expected: torch.Tensor, actual, where: str, *, values: bool = True, strides: bool = True,
                      exact: bool = False):
    if not isinstance(actual, torch.Tensor):
        return f"{where}: expected a tensor, got {type(actual).__name__}"
    for attr in ("dtype", "shape", "device", "layout", "requires_grad"):
        if getattr(expected, attr) != getattr(actual, attr):
            return f"{where}: {attr} {getattr(actual, attr)} != eager {getattr(expected, attr)}"
    if strides and _significant_strides(expected) != _significant_strides(actual):
        return f"{where}: strides {actual.stride()} != eager {expected.stride()}"
    if expected.is_conj() != actual.is_conj() or expected.is_neg() != actual.is_neg():
        return f"{where}: conj/neg bits differ from eager"
    if values:
        try:
            tolerance = {"rtol": 0, "atol": 0} if exact else {}
            torch.testing.assert_close(actual, expected, equal_nan=True, check_stride=False, **tolerance)
        except AssertionError as e:
            return f"{where}: values differ from eager: {' '.join(str(e).split())[:300]}"
    return None


def first_difference(expected, actual, where: str = "output", *, values: bool = True, strides: bool = True,
                     exact: bool = False):
    """A sentence naming the first place ``actual`` differs from the eager ``expected``, or None.
    Floating-point values are compared with torch.testing's tolerances, or bitwise when ``exact``
    (a replayed region runs eager's own kernels in eager's order)."""
    if isinstance(expected, torch.Tensor):
        return tensor_difference(expected, actual, where, values=values, strides=strides, exact=exact)
    if isinstance(expected, (tuple, list)):
        if type(expected) is not type(actual) or len(expected) != len(actual):
            return f"{where}: {type(actual).__name__} of {_len(actual)} != eager {type(expected).__name__} of {len(expected)}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            diff = first_difference(e, a, f"{where}[{i}]", values=values, strides=strides, exact=exact)
            if diff is not None:
                return diff
        return None
    if isinstance(expected, dict):
        if type(expected) is not type(actual) or expected.keys() != actual.keys():
            return f"{where}: {actual!r} != eager {expected!r}"
        for k in expected:
            diff = first_difference(expected[k], actual[k], f"{where}[{k!r}]", values=values, strides=strides, exact=exact)
            if diff is not None:
                return diff
        return None
    if type(expected) is not type(actual):
        return f"{where}: {type(actual).__name__} != eager {type(expected).__name__}"
    if isinstance(expected, float):
        # a float read out of a tensor (item, tolist): torch.testing's float32 tolerances
        if not values or expected == actual or (not exact and math.isclose(expected, actual, rel_tol=1.3e-6, abs_tol=1e-5)):
            return None
        if math.isnan(expected) and math.isnan(actual):
            return None
        return f"{where}: {actual!r} != eager {expected!r}"
    if values and expected != actual:
        return f"{where}: {actual!r} != eager {expected!r}"
    return None


def _len(x):
    return len(x) if isinstance(x, (tuple, list)) else "-"


def artifacts(store) -> list:
    """``store.entries()`` less adaptive eager's tables of op metadata (Note [Meta entries on disk]
    in adaptive_eager._meta_disk) and the captures' records (Note [Captures from the cache] in
    adaptive_eager._capture): the compiled artifacts."""
    return [e for e in store.entries() if e["backend"] not in ("meta", "capture_record")]


def count_aot_traces(monkeypatch):
    """How many AOTAutograd traces our backend starts (Note [Captures from the cache]); a region's
    Inductor compile makes its own, which are not counted."""
    import torch._dynamo.backends.common as common

    traces = []
    real = common.aot_autograd

    def counted(**kwargs):
        if getattr(kwargs["fw_compiler"], "__qualname__", "").startswith(("_Backend.__call__", "_aot_trace.")):
            traces.append(1)
        return real(**kwargs)

    monkeypatch.setattr(common, "aot_autograd", counted)
    return traces


def declining_trace_job(payload: bytes) -> bytes:
    """A worker's trace job that declines every graph (Note [Traces off the step] in
    adaptive_eager._capture): ``_capture._TRACE_JOB`` names it in a test."""
    from adaptive_eager._capture import _Decline

    raise _Decline("test_decline", "declined by the test")


def trace_job_after_exit(payload: bytes) -> bytes:
    """A worker's trace job that starts once its program has exited (Note [Follow-up compiles after
    exit] in neff_cache._worker), so that the program never reads the record: ``_capture._TRACE_JOB``
    names it in a test's child program."""
    import time

    from adaptive_eager._capture_trace import trace_job
    from neff_cache._worker import program_gone

    deadline = time.monotonic() + 120.0
    while not program_gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    return trace_job(payload)
