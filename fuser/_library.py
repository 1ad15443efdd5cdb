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
        for package in ("adaptive_eager", "fuser", "neff_cache"):
            for root, dirs, files in os.walk(os.path.join(top, package)):
                dirs.sort()
                for name in sorted(files):
                    if name.endswith(".py"):
                        path = os.path.join(root, name)
                        digest.update(os.path.relpath(path, top).encode())
                        try:
                            with open(path, "rb") as f:
                                digest.update(f.read())
                        except OSError:  # unreadable: it still names the file set
                            pass
        _LIBRARY_DIGEST.append(digest.hexdigest())
    return _LIBRARY_DIGEST[0]
