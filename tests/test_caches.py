"""The tracer's caches (Note [Bounded tables] in adaptive_eager._signatures): bounded, with
cache_info() and cache_clear(); plain eager is the oracle."""

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import adaptive_eager


def _program(n: int):
    x = torch.arange(float(n)).reshape(1, n)  # a new shape, so new signatures, for every n
    return ((x * 2 + 1).t().relu() - 0.5).sum()


def test_caches_are_bounded_and_values_stay_eager(monkeypatch):
    import adaptive_eager._signatures as signatures

    monkeypatch.setattr(signatures, "MAX_ENTRIES", 8)
    ae.cache_clear()
    for n in list(range(1, 25)) * 2:  # more signatures than the bound, each seen again after eviction
        want = _program(n)
        with adaptive_eager(backend="replay"):
            got = _program(n)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        info = ae.cache_info()
        assert info["meta_entries"] <= 8 and info["signature_ids"] <= 16, info
    assert info["evictions"] > 0 and info["meta_misses"] > 48, info


def test_cache_clear_empties_and_counts_afresh():
    with adaptive_eager(backend="replay"):
        _program(3)
    assert ae.cache_info()["meta_entries"] > 0
    ae.cache_clear()
    info = ae.cache_info()
    assert (info["meta_entries"], info["signature_ids"], info["meta_misses"], info["evictions"]) == (0, 0, 0, 0)
    want = _program(3)
    with adaptive_eager(backend="replay"):
        got = _program(3)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    misses = ae.cache_info()["meta_misses"]
    assert misses > 0
    with adaptive_eager(backend="replay"):
        _program(3)
    assert ae.cache_info()["meta_misses"] == misses  # all hits now


def test_memoized_failure_keeps_its_reason_and_is_counted():
    ae.cache_clear()
    a, b = torch.randn(4, 3), torch.randn(2, 2)
    with pytest.raises(RuntimeError) as want:
        a @ b
    for _ in range(2):  # the second time the failure is memoized: same eager error, at the line
        with adaptive_eager(backend="replay"):
            with pytest.raises(RuntimeError) as got:
                a @ b
        assert str(got.value) == str(want.value)
    failures = ae.cache_info()["failures"]
    assert len(failures) == 1 and "reduction dim" in failures["aten.mm.default"], failures
    assert ae.cache_info()["meta_misses"] == 1
    assert sum(ae.metrics()["fallback_ops"].values()) == 2
