"""The fuser's counters, folded into ``adaptive_eager.metrics()`` by ``fuser.metrics()``."""

from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger("adaptive_eager.fuser")


class RegionStats:
    """The fuser's counters (``fuser.metrics()`` adds the stores' ``corrupt_entries``)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.compiles = 0
        self.compile_seconds = 0.0
        self.cache_hits_memory = 0
        self.cache_misses = 0
        self.replayed_regions = 0
        self.compiled_runs = 0
        self.joined_runs = 0  # windows run joined with a captured graph (Note [Joined runs] in fuser.joined)
        self.blacklisted = 0
        self.compile_failures = 0
        self.cache_hits_disk = 0
        self.waited_for_other_process = 0
        self.neuron_fallbacks = 0  # regions compiled by torch.compile(backend="neuron") (fuser.backends.neuron)
        self.recompiles: Counter[str] = Counter()
        self.not_compiled: Counter[str] = Counter()  # why a window stayed on replay
        self.not_dynamic: Counter[str] = Counter()  # why a varying shape stayed per-shape
        self.run_alone: Counter[str] = Counter()  # nodes of compiled regions run outside compiled code
        self.replay_reasons: Counter[str] = Counter()  # replayed windows by reason (Note [Tiers] in fuser.regions)
        self.not_joined: Counter[str] = Counter()  # why a window ran alone before its captured graph

    def as_dict(self) -> dict:
        return {
            "compile_seconds": round(self.compile_seconds, 3),
            "cache_hits_memory": self.cache_hits_memory,
            "cache_misses": self.cache_misses,
            "replayed_regions": self.replayed_regions,
            "compiled_runs": self.compiled_runs,
            "joined_runs": self.joined_runs,
            "recompiles": dict(self.recompiles),
            "blacklisted": self.blacklisted,
            "compile_failures": self.compile_failures,
            "compiles": self.compiles,
            "cache_hits_disk": self.cache_hits_disk,
            "waited_for_other_process": self.waited_for_other_process,
            "neuron_fallbacks": self.neuron_fallbacks,
            "not_compiled": dict(self.not_compiled),
            "not_dynamic": dict(self.not_dynamic),
            "run_alone": dict(self.run_alone),
            "replay_reasons": dict(self.replay_reasons),
            "not_joined": dict(self.not_joined),
        }


STATS = RegionStats()


def _recompile(cause: str, region: str | None) -> None:
    STATS.recompiles[cause] += 1
    if log.isEnabledFor(logging.INFO):
        log.info("adaptive_eager: recompiling region %s: %s", region or "(new key)", cause)
