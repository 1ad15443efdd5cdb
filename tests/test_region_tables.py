"""The fuser's bounded in-memory tables: the region LRU and the scalar groups (``fuser.cache_info``).

Nothing here compiles (``hot_after`` is never reached): every window replays, and is still looked
up in both tables. Plain eager is the oracle for the values.
"""

import torch

import adaptive_eager as ae
import fuser
import fuser.regions
import fuser.scalars
from adaptive_eager import adaptive_eager

NEVER_HOT = dict(backend="inductor", hot_after=1000)
X = torch.randn(16)


def chain(n: int, s: float = 2.0) -> torch.Tensor:
    """A window of ``n + 1`` ops: one structure per ``n``."""
    y = X * s
    for _ in range(n):
        y = y.sin()
    return y


def run(windows) -> None:
    got = []
    with adaptive_eager(**NEVER_HOT):
        for n, s in windows:
            got.append(chain(n, s))
            ae.sync()
    for y, (n, s) in zip(got, windows):
        torch.testing.assert_close(y, chain(n, s))


def test_the_region_table_is_bounded_and_counts_its_lookups(fresh_regions, monkeypatch):
    monkeypatch.setattr(fuser.regions.CACHE, "max_entries", 2)
    run([(1, 2.0), (2, 2.0), (1, 2.0), (3, 2.0), (4, 2.0)])
    assert fuser.cache_info()["regions"] == (1, 4, 2, 2)  # hits, misses, maxsize, currsize
    assert ae.metrics()["replay_reasons"] == {"cold": 5}
    fuser.cache_clear()
    assert fuser.cache_info()["regions"] == (0, 0, 2, 0)


def test_a_scalar_group_in_use_outlives_newer_structures(fresh_regions, monkeypatch):
    """The scalar groups are least-recently-used, not first-in-first-out: a structure whose float
    was lifted keeps its group (and its region) while it runs, however many others come and go
    (first-in-first-out dropped it, and the float was lifted again, into a new region)."""
    monkeypatch.setattr(fuser.scalars.GROUPS, "max_entries", 2)
    run([(1, 1.0), (1, 2.0), (1, 3.0), (2, 2.0), (1, 4.0), (3, 2.0), (1, 5.0), (1, 6.0), (1, 7.0)])
    # the lifted float's one region serves structure 1 from 4.0 on: 4 hits (dropping its group
    # would have keyed 5.0 and 6.0 by value again, and lifted 7.0 into a new region: 1 hit)
    assert fuser.cache_info()["regions"].hits == 4
    assert fuser.cache_info()["scalar_groups"].currsize == 2
