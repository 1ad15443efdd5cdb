"""Every setting of adaptive eager, declared once.

This is the only module of ``adaptive_eager`` that touches ``os.environ`` (tests/test_layers.py
checks it): every read is here, and the one write, ``pass_to_children``, is a call its caller makes
on purpose. Reading settings has no side effect: ``emulate`` is a setting like any other, and the
mode's entry (``adaptive_eager.__init__``) installs the emulated device when it is on. The packages
below, ``neff_cache`` and ``fuser``, know nothing of this module: ``neff_cache`` reads its own
command line's settings (``neff_cache.settings.from_environment``) and hands the environment on to
its compile workers (``neff_cache.jobs``); ``fuser`` reads none.

Each setting has one spelling: the keyword ``name`` of ``adaptive_eager(name=...)`` /
``enable(name=...)`` and the environment variable ``NEURON_EAGER_<NAME>``. The environment is read
when options are built (at ``enable()`` / ``adaptive_eager()`` entry), never frozen at import, so a
change made before entering takes effect.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import os
from collections.abc import Mapping
from typing import Any

from neff_cache.settings import DEFAULT_DIRECTORY, DEFAULT_SHARING, SHARING

from .errors import AdaptiveEagerError

ENV_PREFIX = "NEURON_EAGER_"
ENV_SWITCH = "NEURON_EAGER"  # adaptive | eager (unset = eager)
SWITCH_VALUES = ("adaptive", "eager")
BACKENDS = ("replay", "inductor", "stablehlo", "neuron")
LOG_LEVELS = ("warning", "info", "debug")
CACHE_SHARING = SHARING
# The tiers a window or a call may climb, lowest first (docs/how-it-works.md, "Tiers"; Note [Tiers]
# in fuser.regions): each value turns on its tier and every one below it. Replay, the tier below
# them all, is ``backend='replay'``: one spelling for running every window op by op.
TIERS = ("regions", "hot", "capture")
DROPOUT = ("eager", "compiled")  # adaptive_eager._dropout.MODES


class ConfigError(AdaptiveEagerError, ValueError):
    """A setting has a value adaptive eager cannot use; the message names the setting and the fix."""


@dataclasses.dataclass(frozen=True)
class Options:
    """The resolved settings passed down to the tracer, the fuser and the cache."""

    device: str  # target device type; ops on other devices run eagerly, untouched
    window: int = 1024  # op cap: a window holding this many ops is flushed
    window_mb: float = 1024.0  # pending-bytes cap: outputs of pending ops, in MiB
    backend: str = "replay"  # load_options picks inductor for cpu and cuda
    cache_dir: str = DEFAULT_DIRECTORY
    cache_size_mb: int = 4096
    cache_shared: str = DEFAULT_SHARING  # who besides the user may write the cache: Note [Cache trust] in neff_cache.access
    hot_after: int = 2
    async_compile: bool = True
    compile_after_exit_s: float = 300.0  # Note [Compiles that outlive the program] in neff_cache.jobs
    log: str = "warning"
    workers: bool = False  # child processes record too: Note [Worker processes]
    emulate: bool = False  # a neuron device backed by CPU memory: adaptive_eager.neuron_emulation
    tiers: str = "capture"  # the highest of TIERS a window or call may reach
    dropout: str = "eager"  # DROPOUT: eager's masks, or masks computed in the compiled code (Note [Dropout in the compiled code] in _dropout)

    def replace(self, **changes: Any) -> Options:
        return dataclasses.replace(self, **changes)

    def reaches(self, tier: str) -> bool:
        """Whether ``tiers`` turns ``tier`` on: ``hot`` (Note [Hot windows] in _hot), ``capture``
        (Note [Captured modules] in _capture, Note [Optimizer capture] in _optim)."""
        return TIERS.index(self.tiers) >= TIERS.index(tier)


class _Invalid(ValueError):
    """A parser's rejection, saying what it expected; the caller names the setting as the user spelled
    it (``NEURON_EAGER_WINDOW='abc'`` from the environment, ``option window='abc'`` from a keyword)."""


# name -> (parser, description); README.md's settings table is built from it (settings_table).
def _parse_bool(name: str, raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise _Invalid("1/0 (or true/false)")


def _parse_int(name: str, raw: str, minimum: int = 1) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise _Invalid(f"an integer >= {minimum}") from None
    if value < minimum:
        raise _Invalid(f"an integer >= {minimum}")
    return value


def _parse_float(name: str, raw: str, minimum: float | None = None) -> float:
    expected = "a positive number" if minimum is None else f"a number >= {minimum:g}"
    try:
        value = float(raw)
    except ValueError:
        raise _Invalid(expected) from None
    if not (value > 0 if minimum is None else value >= minimum):
        raise _Invalid(expected)
    return value


def _parse_seconds(name: str, raw: str) -> float:
    return _parse_float(name, raw, minimum=0)


def _closest(value: str, choices) -> str:
    close = difflib.get_close_matches(value, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _parse_choice(choices: tuple[str, ...]):
    def parse(name: str, raw: str) -> str:
        low = raw.strip().lower()
        if low not in choices:
            raise _Invalid(f"one of {', '.join(choices)}{_closest(low, choices)}")
        return low

    return parse


def _parse_device(name: str, raw: str) -> str:
    low = raw.strip().lower()
    if not low or ":" in low:
        raise _Invalid("a device type such as cpu, cuda or neuron")
    return low


def _parse_str(name: str, raw: str) -> str:
    if not raw:
        raise _Invalid("a value (it is empty: unset it or give one)")
    return raw


SETTINGS: dict[str, tuple[Any, str]] = {
    "device": (_parse_device, "target device type (default: neuron if present, else cuda, else cpu)"),
    "window": (_parse_int, "op cap of a window (default 1024)"),
    "window_mb": (_parse_float, "pending-bytes cap of a window in MiB (default 1024)"),
    "backend": (_parse_choice(BACKENDS), "`inductor` (default on cpu and cuda), `replay` (op by op), `stablehlo` "
                "(Trainium's lowering compiled by XLA on cpu; the `neuron` extra) or `neuron` (NEFFs; default on "
                "a neuron device with torch-neuronx)"),
    "cache_dir": (_parse_str, "persistent cache directory (default ~/.cache/adaptive_eager)"),
    "cache_size_mb": (_parse_int, "persistent cache size bound in MiB (default 4096)"),
    "cache_shared": (_parse_choice(CACHE_SHARING), "`no` (default): only you may write the cache; `group`: its "
                     "group too (docs/cache.md, \"Sharing a cache\")"),
    "hot_after": (_parse_int, "compile a region after it was seen this many times (default 2)"),
    "async_compile": (_parse_bool, "compile in background workers (default 1)"),
    "tiers": (_parse_choice(TIERS), "the highest tier windows and calls may reach, each value with the ones before it: "
              "`regions` (a window seen `hot_after` times runs compiled), `hot` (+ a window whose structure runs "
              "compiled is recorded against it, not in full), `capture` (default; + a hot outermost `nn.Module` "
              "call and a hot `optimizer.step()` run as one call guarded by TorchDynamo, compiled in background "
              "workers and kept in the cache)"),
    "dropout": (_parse_choice(DROPOUT), "`eager` (default): eager's masks; `compiled`: masks made in the compiled "
                "code, eager's distribution, not its numbers (docs/trainium.md)"),
    "compile_after_exit_s": (_parse_seconds, "seconds a background compile may go on after the program exits, "
                             "to land in the cache (default 300; 0: stop it at exit)"),
    "log": (_parse_choice(LOG_LEVELS), "level of the `adaptive_eager` logger: `warning` (default), `info` (every "
            "flush, compile, recompile, fallback) or `debug`"),
    "emulate": (_parse_bool, "an emulated `neuron` device backed by CPU memory, counting one launch per eager op "
                "(default 0; docs/trainium.md)"),
    "workers": (_parse_bool, "child processes (DataLoader workers, forks) record too (default 0: they run eagerly)"),
}


# Settings no longer offered: name -> (the value whose behaviour is now always what happens, or
# None for a setting another one replaced; what to use instead). benchmarks/RESULTS.md, "Session 23:
# switches" and "Session 24: eager start and the tiers", has the measurements. Passing one is never
# silently ignored: the kept value is warned about once, any other is refused with the replacement
# (keyword and environment alike); a replaced setting is refused whatever its value.
_TIERS_HOT = ("tiers='hot' (NEURON_EAGER_TIERS=hot) turns the module and optimizer captures off and keeps the "
              "tiers below them; the default, tiers='capture', has them on")
REMOVED: dict[str, tuple[bool | None, str]] = {
    "tune_gc": (True, "gc's generation-0 threshold is always raised while adaptive eager is on and restored at "
                "exit (Note [GC threshold] in adaptive_eager._gc); to keep your own, set it with gc.set_threshold() "
                "(a threshold the program set while on, or 0, is left alone)"),
    "tune_malloc": (True, "glibc malloc's mmap/trim thresholds are always fixed at their ceilings on cpu (Note [Heap "
                    "thresholds] in adaptive_eager._heap); to keep glibc's own, set MALLOC_TRIM_THRESHOLD_ or "
                    "MALLOC_MMAP_THRESHOLD_, or glibc.malloc.* in GLIBC_TUNABLES: a program's own choice is left alone"),
    "meta_on_disk": (True, "op signatures' output metadata is part of the cache (Note [Meta entries on disk] in "
                     "adaptive_eager._meta_disk); cache_dir (NEURON_EAGER_CACHE_DIR) decides where it is kept"),
    "eager_start": (False, "the process's first window is recorded like every other (running it eagerly made the "
                    "first steps no faster); remove the setting"),
    "hot_windows": (None, "the tiers setting replaced it: tiers='regions' (NEURON_EAGER_TIERS=regions) records every "
                    "window in full and turns the captures off too; the default, tiers='capture', has hot windows on"),
    "module_capture": (None, "the tiers setting replaced it: " + _TIERS_HOT),
    "optimizer_capture": (None, "the tiers setting replaced it: " + _TIERS_HOT),
}


def _removed(name: str, value: Any, spelled: str) -> None:
    kept, instead = REMOVED[name]
    if kept is None:
        raise ConfigError(f"{spelled}: {name} is no longer a setting: {instead}")
    if isinstance(value, str):
        try:
            value = _parse_bool(name, value)
        except _Invalid:
            value = None
    if value is not kept:
        raise ConfigError(f"{spelled}: {name} is no longer a setting and cannot be changed: {instead}")
    if name not in _warned_removed:
        _warned_removed.add(name)
        from ._source import warn  # not at import: torch imports this module (_autoload)

        warn(f"{spelled}: {name} is no longer a setting (it is always {'on' if kept else 'off'}): {instead}")


_warned_removed: set[str] = set()


def options_doc() -> str:
    """The options as ``help(adaptive_eager.adaptive_eager)`` lists them, built from ``SETTINGS``."""
    import textwrap

    # indented as the docstrings it ends, which help() dedents
    lines = ["", "", "    Options (each a keyword, or the environment variable named after it; a keyword wins):", ""]
    for name, (_, description) in SETTINGS.items():
        lines += textwrap.wrap(f"{name}: {description} [{_env(name)}]", width=100, initial_indent="      ",
                               subsequent_indent="          ")
    return "\n".join(lines) + "\n"


SETTINGS_BEGIN, SETTINGS_END = "<!-- settings:begin -->", "<!-- settings:end -->"


def settings_table() -> str:
    """README.md's settings table, built from ``SETTINGS`` (tests/test_messages.py checks that README.md
    holds it between ``SETTINGS_BEGIN`` and ``SETTINGS_END``: print it with ``python -c "from adaptive_eager.config import settings_table as t; print(t())"``)."""
    rows = ["| keyword | environment variable | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{name}` | `{_env(name)}` | {description} |" for name, (_, description) in SETTINGS.items()]
    return "\n".join(rows)


def _env(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _parsed(name: str, raw: str, spelled: str) -> Any:
    try:
        return SETTINGS[name][0](name, raw)
    except _Invalid as e:
        raise ConfigError(f"{spelled}: expected {e}") from None


def default_device_type() -> str:
    """neuron if that device is registered and present, else cuda if available, else cpu."""
    import torch

    neuron = getattr(torch, "neuron", None)
    if neuron is not None:
        try:
            if neuron.is_available():
                return "neuron"
        except Exception:  # a half-installed torch-neuronx must not stop us from picking a device
            pass
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


_warned_unknown: set[str] = set()


def _warn_unknown(environ: Mapping[str, str]) -> None:
    valid = {_env(n) for n in SETTINGS}
    removed = {_env(n) for n in REMOVED}  # load_options says what became of those
    for key in environ:
        if key.startswith(ENV_PREFIX) and key not in valid | removed and key not in _warned_unknown:
            _warned_unknown.add(key)
            # matched without the prefix, which every name shares (NEURON_EAGER_FOO is not close to _LOG)
            close = difflib.get_close_matches(key[len(ENV_PREFIX):].lower(), list(SETTINGS), n=1)
            hint = f"; did you mean {_env(close[0])}?" if close else f"; valid: {', '.join(sorted(valid))}"
            from ._source import warn  # not at import: torch imports this module (_autoload)

            warn(f"unknown setting {key} is ignored{hint}")


_defaults: dict[str, Any] = {}


@contextlib.contextmanager
def defaults(**options: Any):
    """Temporarily change the defaults every ``adaptive_eager()``/``enable()`` starts from, above the
    environment and below explicit keywords (what tests use instead of editing os.environ)."""
    _validate(options)
    saved = dict(_defaults)
    _defaults.update(options)
    try:
        yield
    finally:
        _defaults.clear()
        _defaults.update(saved)


def _validate(overrides: Mapping[str, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, value in overrides.items():
        if name in REMOVED:
            _removed(name, value, f"option {name}={value!r}")
            continue
        if name not in SETTINGS:
            close = difflib.get_close_matches(name, list(SETTINGS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(SETTINGS)}"
            raise ConfigError(f"unknown option {name!r}{hint}")
        if value is None:
            continue
        values[name] = _parsed(name, value, f"option {name}={value!r}") if isinstance(value, str) else value
    _check_types(values)
    return values


def with_overrides(base: Options, **overrides: Any) -> Options:
    """``base`` with the given keyword options applied (an inner ``adaptive_eager(...)`` block)."""
    return base.replace(**_validate(overrides)) if overrides else base


def load_options(environ: Mapping[str, str] | None = None, **overrides: Any) -> Options:
    """Build options from the environment, then ``defaults()``, then keyword ``overrides``."""
    environ = os.environ if environ is None else environ
    _warn_unknown(environ)
    values: dict[str, Any] = {}
    for name in SETTINGS:
        raw = environ.get(_env(name))
        if raw is not None:
            values[name] = _parsed(name, raw, f"{_env(name)}={raw!r}")
    for name in REMOVED:
        raw = environ.get(_env(name))
        if raw is not None:
            _removed(name, raw, f"{_env(name)}={raw!r}")
    values.update(_defaults)
    values.update(_validate(overrides))
    # emulate: the mode's entry installs the emulated device, which is then the default
    emulated = bool(values.get("emulate")) or _emulated()
    if "device" not in values:
        values["device"] = "neuron" if emulated else default_device_type()
    if "backend" not in values:
        values["backend"] = _default_backend(values["device"], emulated)
    if values["backend"] == "neuron":
        _check_backend("neuron", values["device"], "neuron", emulated)
    if values["backend"] == "inductor" and values["device"] not in ("cpu", "cuda"):
        raise ConfigError(f"backend 'inductor' compiles for cpu and cuda, not {values['device']!r}; use backend='replay'")
    if values["backend"] == "stablehlo":
        _check_backend("stablehlo", values["device"], "cpu", emulated)
    return Options(**values)


def _default_backend(device: str, emulated: bool) -> str:
    """inductor on cpu and cuda; on neuron the neuron backend where its packages are installed (it
    has not run on hardware yet: fuser/backends/neuron.py), else replay (one NEFF per op)."""
    if device in ("cpu", "cuda"):
        return "inductor"
    if device == "neuron":
        from fuser.backends.neuron import NeuronBackend
        from fuser.backends.stablehlo import INSTALL_HINT, missing_requirements

        if emulated:
            # stablehlo stands in for neuronx-cc on the emulated device
            if not missing_requirements():
                return "stablehlo"
            _warn_once("emulated-replay", "adaptive_eager: the emulated neuron device runs windows op by op (backend "
                       "'replay'): the stablehlo backend, which stands in for neuronx-cc, needs the [neuron] extra: "
                       f"{INSTALL_HINT}")
        elif not missing_requirements(NeuronBackend.requirements):
            return "neuron"
    return "replay"


def _check_backend(name: str, device: str, compiles_for: str, emulated: bool) -> None:
    # at enable(), not at the first compile: a missing package must not surface in the middle of a run
    from fuser.backends import get_backend_class
    from fuser.backends.stablehlo import INSTALL_HINT, missing_requirements

    missing = missing_requirements(get_backend_class(name).requirements)
    if missing:
        raise ConfigError(f"backend {name!r} needs {' and '.join(missing)}, which are not installed: {INSTALL_HINT}")
    if device != compiles_for and not (device == "neuron" and compiles_for == "cpu" and emulated):
        raise ConfigError(f"backend {name!r} compiles for {compiles_for}, not {device!r}; use backend='replay'")


def _check_types(values: dict[str, Any]) -> None:
    device = values.get("device")
    if device is not None and not isinstance(device, str):
        import torch

        if not isinstance(device, torch.device) or device.index is not None:
            raise ConfigError(f"option device={device!r}: expected a device type such as 'cpu', 'cuda' or 'neuron' "
                              f"(or torch.device('cuda')): adaptive eager records the ops of every device of that type")
        values["device"] = device.type
    for name in ("window", "cache_size_mb", "hot_after"):
        if name in values and (type(values[name]) is not int or values[name] < 1):
            raise ConfigError(f"option {name}={values[name]!r}: expected an integer >= 1")
    if "window_mb" in values and not (isinstance(values["window_mb"], (int, float)) and values["window_mb"] > 0):
        raise ConfigError(f"option window_mb={values['window_mb']!r}: expected a positive number")
    seconds = values.get("compile_after_exit_s")
    if seconds is not None and not (type(seconds) in (int, float) and seconds >= 0):
        raise ConfigError(f"option compile_after_exit_s={seconds!r}: expected a number >= 0")
    for name in ("async_compile", "workers", "emulate"):
        if name in values and type(values[name]) is not bool:
            raise ConfigError(f"option {name}={values[name]!r}: expected True or False")
    if "tiers" in values and values["tiers"] not in TIERS:
        raise ConfigError(f"option tiers={values['tiers']!r}: expected one of {', '.join(TIERS)}")
    if "dropout" in values and values["dropout"] not in DROPOUT:
        raise ConfigError(f"option dropout={values['dropout']!r}: expected one of {', '.join(DROPOUT)}"
                          + _closest(str(values["dropout"]), DROPOUT))


def entry_options(base: Options | None, install_emulation, **overrides: Any) -> Options:
    """The options ``enable()`` / ``adaptive_eager()`` turn on with: ``load_options`` (``base`` None)
    or ``base`` with the block's keywords, refused for a device this machine lacks. With ``emulate``
    on, a new activation calls ``install_emulation`` (the mode's entry passes
    ``neuron_emulation.emulate_neuron``) before the device is checked: it is the device checked."""
    opts = load_options(**overrides) if base is None else with_overrides(base, **overrides)
    if base is None and opts.emulate:
        install_emulation()
    if base is None or "device" in overrides:
        check_device(opts.device, keyword="device" in overrides or "device" in _defaults)
    return opts


def check_device(device: str, keyword: bool) -> None:
    """Refuse a device type this machine lacks: recording for it would silently record nothing
    (every op runs on another device, untouched). ``keyword``: it came from ``device=``, not from
    NEURON_EAGER_DEVICE."""
    import torch

    spelled = f"option device={device!r}" if keyword else f"{_env('device')}={device}"
    try:
        torch.device(device)
    except RuntimeError:
        raise ConfigError(f"{spelled}: torch knows no such device type: use cpu, cuda or neuron") from None
    is_available = getattr(getattr(torch, device, None), "is_available", None)
    if is_available is not None and not is_available():
        fix = (f"pass device='{default_device_type()}' or leave it out" if keyword
               else f"unset {_env('device')} (the default here is {default_device_type()})")
        raise ConfigError(f"{spelled}: this machine has no {device} device, so adaptive eager would record "
                          f"nothing: {fix}")


# Whether this process has the emulated neuron device: set by ``neuron_emulation`` when it installs
# it (at an earlier entry, or by the program), so that the settings, a layer below the emulation,
# know it without importing the emulation (which imports torch) or looking it up.
EMULATION_INSTALLED = [False]


def _emulated() -> bool:
    return EMULATION_INSTALLED[0]


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logging.getLogger("adaptive_eager").warning(message)


def setting(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """One setting from the environment, else its default (at ``import torch``: nothing else is read)."""
    environ = os.environ if environ is None else environ
    raw = environ.get(_env(name))
    return getattr(Options, name) if raw is None else _parsed(name, raw, f"{_env(name)}={raw!r}")


def pass_to_children(name: str, value: str) -> None:
    """Set the setting ``name``'s variable in this process's environment, which the processes it
    starts afterwards inherit (the emulated device's compile and DataLoader workers): the one write
    to ``os.environ``, made by its caller on purpose."""
    os.environ[_env(name)] = value


def malloc_chosen_by_program(environ: Mapping[str, str] | None = None) -> str | None:
    """Why the program's environment keeps glibc malloc's thresholds as they are, or None: a
    ``MALLOC_*`` threshold variable, ``glibc.malloc.*`` tunables, another malloc preloaded (Note
    [Heap thresholds] in _heap)."""
    env = os.environ if environ is None else environ
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"):
        if name in env:
            return f"{name} is set"
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets malloc"
    if "malloc" in env.get("LD_PRELOAD", ""):  # jemalloc, tcmalloc, mimalloc: another allocator serves malloc
        return "another malloc is preloaded"
    return None


def switch_value(environ: Mapping[str, str] | None = None) -> str:
    """The value of NEURON_EAGER: 'adaptive' turns the library on at ``import torch``."""
    environ = os.environ if environ is None else environ
    raw = environ.get(ENV_SWITCH, "")
    low = raw.strip().lower()
    if low in ("", "0", "off"):
        return "eager"
    if low not in SWITCH_VALUES:  # named as the user spelled it, matched as the choices are: in any case
        raise ConfigError(f"{ENV_SWITCH}={raw!r}: expected 'adaptive' (on) or 'eager' (off), in any case"
                          f"{_closest(low, SWITCH_VALUES)}")
    return low
