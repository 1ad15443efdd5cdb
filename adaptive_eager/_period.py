"""Step alignment without an optimizer: find the period of the op stream and cut windows on it.

Note [Period detection]
A loop that never syncs (or syncs rarely) is cut by the op cap, at a phase that drifts by
``cap mod step length`` every window, so no two windows have the same structure and nothing is
ever compiled. When a window is cut by the cap, the signatures of the ops recorded since the last
other sync point are searched for the shortest period P that repeats over the whole recent stream
(at least ``2 * cap`` ops, or two full periods, so that one repeated layer inside a longer step is
not mistaken for the step). From then on windows end at multiples of P counted from a fixed
reference in the stream (the largest multiple that fits under the cap), so every window starts at
the same phase of the loop and has the same structure. A sync point elsewhere (``print(loss.item())``
every 50 steps) makes one short window, and the next cut is back on the grid: positions are
counted over the whole stream, never re-based.

A period whose windows keep changing structure is dropped after ``MISSES`` windows in a row and
searched for again. The record path pays nothing for any of this: it compares the window length
with ``TracerState.cut_at``, which this module moves.
"""

from __future__ import annotations

MIN_PERIOD = 4  # shorter periods are a repeated op, not a loop body
MISSES = 3  # period windows in a row whose structure differs from the previous one: drop the period


class Periodicity:
    __slots__ = ("cap", "period", "ref", "pos", "history", "last", "misses", "found")

    def __init__(self, cap: int):
        self.cap = cap
        self.period = 0  # 0: none known
        self.ref = 0  # a stream position where a period window starts
        self.pos = 0  # ops recorded so far (stream position of the open window's first op)
        self.history: list[int] = []  # op signature ids since the last sync point other than a cut
        self.last: list | None = None  # the previous period window's signature
        self.misses = 0
        self.found = 0  # periods found (for tests and the report)

    def next_cut(self) -> int:
        """Window length at which the open window is cut."""
        p = self.period
        if not p:
            return self.cap
        first = p - (self.pos - self.ref) % p  # ops left until the period's next start
        if first >= self.cap:
            return self.cap  # a period longer than the cap: cut it into the same chunks each time
        return first + (self.cap - first) // p * p

    def on_flush(self, n: int, sigs: list, by_cut: bool, op_ids) -> None:
        """A window of ``n`` ops with signature ``sigs`` was flushed; ``by_cut``: it ended at
        ``next_cut()``; ``op_ids(sigs)``: its ops' signature ids, one per op."""
        if self.period:
            if by_cut and (self.pos - self.ref) % self.period == 0:
                if self.last is not None and sigs != self.last:
                    self.misses += 1
                    if self.misses >= MISSES:
                        self.period, self.last, self.misses = 0, None, 0
                        self.history = []
                else:
                    self.misses = 0
                self.last = sigs
        elif by_cut:
            self.history.extend(op_ids(sigs))
            self._search(self.pos + n)
        else:
            self.history = []
        self.pos += n

    def _search(self, end: int) -> None:
        h = self.history
        keep = 4 * self.cap
        if len(h) > keep:
            del h[: len(h) - keep]
        n = len(h)
        last = h[-1] if h else None
        for p in range(MIN_PERIOD, n // 2 + 1):
            if h[n - 1 - p] != last:
                continue
            span = max(2 * p, min(n, 2 * self.cap))
            if span > n:
                break
            if h[n - span + p:] == h[n - span : n - p]:
                self.period, self.ref, self.misses, self.last = p, end, 0, None
                self.found += 1
                self.history = []
                return
