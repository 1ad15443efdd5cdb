"""``python -m neff_cache stats|ls|clear|prune|repair``: inspect, trim and repair the compiled-artifact cache."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sqlite3
import sys
import time
from typing import Any

from diskcache.core import DBNAME

from neff_cache.settings import from_environment
from neff_cache.repair import repair
from neff_cache.store import BYTES_PER_MB, ArtifactStore

_AGE_PATTERN = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([smhdw]?)")
_SECONDS_PER_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for bad usage, 1 if the cache is unusable)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "prune" and args.max_size is None and args.older_than is None:
        parser.error("prune needs --max-size MB and/or --older-than AGE, e.g. 'prune --older-than 7d'")
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")
    default_directory, shared = _settings(parser)
    directory = os.path.abspath(os.path.expanduser(getattr(args, "cache_dir", None) or default_directory))
    if os.path.exists(directory) and not os.path.isdir(directory):
        parser.error(f"--cache-dir {directory}: not a directory; pass the cache's directory "
                     "(default: NEURON_EAGER_CACHE_DIR, else ~/.cache/adaptive_eager)")
    if not os.path.exists(os.path.join(directory, DBNAME)):
        if os.path.isdir(directory) and os.listdir(directory):
            # a typo'd path that exists (a home or system directory) is not an empty cache
            print(f"{directory} holds files but no compiled-artifact cache (no {DBNAME}): check --cache-dir "
                  "or NEURON_EAGER_CACHE_DIR", file=sys.stderr)
            return 1
        print(f"no compiled-artifact cache at {directory}")
        return 0
    if args.command == "repair":
        return _repair(directory)
    with ArtifactStore(directory, shared=shared) as store:
        if store.in_memory:
            return 1  # the store has logged what is wrong with the directory and how to fix it
        if store.read_only and args.command in ("clear", "prune"):
            print(f"cannot {args.command} {directory}: it is read-only (see the warning above)", file=sys.stderr)
            return 1
        _COMMANDS[args.command](store, args)
    return 0


def _parser() -> argparse.ArgumentParser:
    # --cache-dir is accepted before or after the command; SUPPRESS keeps the subcommand's parser
    # from overwriting a value given before the command with its default.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--cache-dir",
        metavar="DIR",
        default=argparse.SUPPRESS,
        help="cache directory (default: NEURON_EAGER_CACHE_DIR, else ~/.cache/adaptive_eager)",
    )
    parser = argparse.ArgumentParser(
        prog="python -m neff_cache",
        description="Inspect and trim adaptive eager's persistent compiled-artifact cache.",
        parents=[common],
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{stats,ls,clear,prune,repair}")
    commands.add_parser("stats", parents=[common], help="entries, bytes, hits, oldest/newest, per backend")
    commands.add_parser("ls", parents=[common], help="one line per entry")
    commands.add_parser("clear", parents=[common], help="remove every entry")
    prune = commands.add_parser(
        "prune", parents=[common], help="remove entries unused for a while and/or the least recently used"
    )
    prune.add_argument("--max-size", type=_parse_size_mb, metavar="MB", help="keep at most this many MB")
    prune.add_argument(
        "--older-than",
        type=_parse_age_s,
        metavar="AGE",
        help="remove entries unused for AGE: 3600, 90s, 30m, 12h, 7d, 2w",
    )
    commands.add_parser(
        "repair", parents=[common], help="rebuild a damaged index or control database, keeping every sound artifact"
    )
    return parser


def _parse_size_mb(text: str) -> float:
    try:
        size_mb = float(text)
    except ValueError:
        size_mb = -1.0
    if not size_mb >= 0:
        raise argparse.ArgumentTypeError(f"expected a size in MB such as 512 or 0.5, got {text!r}")
    return size_mb


def _parse_age_s(text: str) -> float:
    match = _AGE_PATTERN.fullmatch(text.strip().lower())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected an age such as 3600, 90s, 30m, 12h, 7d or 2w, got {text!r}"
        )
    return float(match.group(1)) * _SECONDS_PER_UNIT[match.group(2)]


def _settings(parser: argparse.ArgumentParser) -> tuple[str, str]:
    """The cache directory and who shares it (NEURON_EAGER_CACHE_DIR, NEURON_EAGER_CACHE_SHARED)."""
    try:
        return from_environment(os.environ)  # this program's own settings: neff_cache.settings
    except ValueError as error:  # a bad NEURON_EAGER_* value: the message names it
        parser.error(f"{error} (or pass --cache-dir DIR)")


def _stats(store: ArtifactStore, args: argparse.Namespace) -> None:
    stats = store.stats()
    print(f"cache directory: {stats['directory']}{' (read-only)' if stats['read_only'] else ''}")
    print(f"entries: {stats['entries']} ({_format_size(stats['bytes'])})")
    print(f"hits: {stats['hits']}")
    print(f"oldest: {_format_time(stats['oldest'])}")
    print(f"newest: {_format_time(stats['newest'])}")
    print(
        f"evicted: {stats['evictions']} to fit the size limit, {stats['corrupt_entries']} corrupt, "
        f"{stats['incompatible_entries']} incompatible"
    )
    for backend, totals in sorted(stats["backends"].items()):
        print(
            f"backend {backend}: {totals['entries']} entries, {_format_size(totals['bytes'])}, "
            f"{totals['hits']} hits"
        )


def _ls(store: ArtifactStore, args: argparse.Namespace) -> None:
    entries = store.entries()
    if not entries:
        print("no entries")
        return
    now = time.time()
    rows = [("KEY", "FORMAT", "BACKEND", "SIZE", "HITS", "AGE", "UNUSED FOR", "COMPILE")]
    rows += [
        (
            entry["key"],
            f"v{entry['format_version']}",
            str(entry["backend"]),
            _format_size(entry["size"]),
            str(entry["hits"]),
            _format_duration(now - entry["created"]),
            _format_duration(now - entry["last_used"]),
            "?" if entry["compile_seconds"] is None else f"{entry['compile_seconds']:.2f}s",
        )
        for entry in entries
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _clear(store: ArtifactStore, args: argparse.Namespace) -> None:
    _report_removed(store, store.clear())


def _prune(store: ArtifactStore, args: argparse.Namespace) -> None:
    _report_removed(store, store.prune(max_size_mb=args.max_size, older_than_s=args.older_than))
    if store.orphans_removed:
        print(f"removed {store.orphans_removed} orphaned files left by processes killed while writing")


def _repair(directory: str) -> int:
    try:
        done = repair(directory)
    except (OSError, sqlite3.Error) as error:  # a directory this process cannot write
        print(f"cannot repair {directory}: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    if done["index"] == "rebuilt":
        print(f"index rebuilt: kept {done['kept']} entries, dropped {done['dropped']} that did not verify "
              f"(the damaged index is kept as {os.path.join(directory, DBNAME)}.damaged; delete it when done)")
    else:
        print("index: sound")
    print("control database (claims and counters): " + ("rebuilt" if done["control"] == "rebuilt" else "sound"))
    print(f"removed {done['orphans']} orphaned files ({_format_size(done['orphan_bytes'])})")
    return 0


def _report_removed(store: ArtifactStore, removed: list[dict[str, Any]]) -> None:
    for entry in removed:
        size = _format_size(entry["size"])
        print(f"removed {entry['key']} ({entry['backend']}, {size}, {entry['hits']} hits)")
    total = sum(entry["size"] or 0 for entry in removed)
    print(f"removed {len(removed)} entries ({_format_size(total)}) from {store.directory}")


def _format_size(size: int | None) -> str:
    if size is None:
        return "?"
    if size < 1024:
        return f"{size} B"
    if size < BYTES_PER_MB:
        return f"{size / 1024:.1f} KB"
    if size < 1024 * BYTES_PER_MB:
        return f"{size / BYTES_PER_MB:.1f} MB"
    return f"{size / (1024 * BYTES_PER_MB):.2f} GB"


def _format_duration(seconds: float) -> str:
    for unit, unit_seconds in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= unit_seconds:
            return f"{seconds / unit_seconds:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"


def _format_time(epoch_s: float | None) -> str:
    if epoch_s is None:
        return "-"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch_s))
    return f"{stamp} ({_format_duration(time.time() - epoch_s)} ago)"


_COMMANDS = {"stats": _stats, "ls": _ls, "clear": _clear, "prune": _prune}
