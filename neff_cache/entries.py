"""What an entry records beside its artifact (Note [Storage layout] in neff_cache._disk): the metadata
``put`` writes, the checks ``get`` and ``repair`` make of it, and the description ``entries`` lists."""

from __future__ import annotations

import json
import re
from typing import Any

import xxhash

from neff_cache._disk import _Row

_STORED_KEY_PATTERN = re.compile(r"v(\d+)/([0-9a-f]+)")
_META_FIELDS = {"fingerprint": str, "backend": str, "size": int, "checksum": str, "compile_seconds": float}


def checksum(data: bytes) -> str:
    """The integrity checksum recorded with every artifact (xxh3-128, hex)."""
    return xxhash.xxh3_128_hexdigest(data)


def _parse_meta(meta_text: str | None) -> dict[str, Any] | None:
    try:
        meta = json.loads(meta_text) if isinstance(meta_text, str) else None
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def _integrity_problem(data: bytes | None, meta: dict[str, Any] | None) -> str | None:
    if meta is None or not all(isinstance(meta.get(field), kind) for field, kind in _META_FIELDS.items()):
        return "metadata unreadable"
    if data is None:
        return "artifact file missing or unreadable"
    if len(data) != meta["size"]:
        return f"truncated: {len(data)} of {meta['size']} bytes"
    if checksum(data) != meta["checksum"]:
        return "checksum mismatch"
    return None


def _describe(row: _Row) -> dict[str, Any] | None:
    match = _STORED_KEY_PATTERN.fullmatch(row.stored_key) if type(row.stored_key) is str else None
    if match is None:
        return None  # not an artifact of any format version: leave foreign rows alone
    meta = _parse_meta(row.meta_text) or {}
    return {
        "key": match.group(2),
        "format_version": int(match.group(1)),
        "backend": meta.get("backend"),
        "fingerprint": meta.get("fingerprint"),
        "size": meta.get("size"),
        "checksum": meta.get("checksum"),
        "compile_seconds": meta.get("compile_seconds"),
        "created": row.created,
        "last_used": row.last_used,
        "hits": row.hits,
    }
