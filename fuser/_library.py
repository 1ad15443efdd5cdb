"""A digest of this library's own source: Note [Remembered failures] in neff_cache.store."""

from __future__ import annotations

_LIBRARY_DIGEST: list[str] = []


def library_digest() -> str:
    """A digest of this library's own source (``adaptive_eager``, ``fuser``, ``neff_cache``): what
    the cache keeps that our code decided, and that a bug of ours could have made wrong, is kept
    under it and lapses with the release (or the edit) that changes the code (Note [Remembered
    failures] in neff_cache.store, Note [Meta entries on disk] in adaptive_eager._meta_disk).
    Made once per process, when first needed (~1 ms)."""
    if not _LIBRARY_DIGEST:
        import os

        import xxhash

        digest = xxhash.xxh3_64()
        top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        cut = len(top) + 1
        # the same bytes as an ``os.walk`` in sorted order with ``relpath``, at half the cost (a
        # warm restart's first step paid ~5 ms here): directories by ``scandir``, names sliced
        stack = [os.path.join(top, package) for package in ("neff_cache", "fuser", "adaptive_eager")]
        while stack:
            root = stack.pop()
            try:
                entries = sorted(os.scandir(root), key=lambda e: e.name)
            except OSError:
                continue
            subdirs = []
            for e in entries:
                if e.is_dir():
                    subdirs.append(e.path)
                elif e.name.endswith(".py"):
                    digest.update(e.path[cut:].encode())
                    try:
                        with open(e.path, "rb") as f:
                            digest.update(f.read())
                    except OSError:  # unreadable: it still names the file set
                        pass
            stack.extend(reversed(subdirs))
        _LIBRARY_DIGEST.append(digest.hexdigest())
    return _LIBRARY_DIGEST[0]
