"""Who may write a cache directory, and how neff_cache creates, checks and opens what is in it.

Note [Cache trust]
~~~~~~~~~~~~~~~~~~
Artifacts hold generated code and shared objects that the fuser executes, so whoever can write a
cache directory runs code in every process that uses it, with that process's rights. A checksum
cannot help: whoever can write an artifact can write its checksum too. (JAX's persistent
compilation cache and ccache say the same of theirs.) So a directory is used only if nobody but
its user (and root) can write it:

- the directory, its ``control`` directory and their SQLite files are owned by the user or root
  and carry no group or other write bit; neff_cache creates them (and any missing ancestor)
  0700 / 0600 whatever the umask. The directory itself must not be a symbolic link (its
  ancestors may be: ``~/.cache`` on another disk is common);
- a value file is opened from a descriptor of the directory, one component at a time, with
  ``O_NOFOLLOW`` on each, so no symbolic link below the directory is followed, and it must be a
  regular file under the same owner and mode rules. A name that is not diskcache's
  ``xx/yy/<hex>.val`` is never opened nor deleted (a planted row cannot name ``/etc/...``);
- nothing read back is unpickled (Note [No pickle]).

A directory that fails a check is not used: the store keeps artifacts in memory for the process,
with one WARNING that says what is wrong and what to do (as for an unwritable directory, Note
[Degrading to memory] in ``neff_cache.store``): the program runs on. A value file that fails one
is evicted as corrupt.

Sharing among users who trust each other (``shared=True``, the ``cache_shared=group`` setting):
the directory is group-owned, with the setgid bit so that what is created in it gets its group.
neff_cache then creates files 0660 and directories 2770, and accepts group write, and owners who
are members of the group, only for the directory's group. Every member runs code in every other
member's processes.

What the checks cannot give: within one uid (or a trusted group), an artifact edited with its
checksum recomputed is believed; it can compute wrong values or run any code. Ancestors of the
directory are not checked: one that others can write (with no sticky bit) lets them swap the
directory between the check and SQLite's open.

Note [No pickle]
~~~~~~~~~~~~~~~~
diskcache pickles every value that is not bytes, str, int64 or float, and ``Disk.fetch``/``Disk.get``
unpickle such rows, so a planted row would run code in whoever reads it (``stats()``, the CLI).
``SafeDisk`` stores only values diskcache keeps raw (it raises before pickling anything else) and
refuses, without unpickling, every pickled or text value and every pickled key. The fuser's
artifacts are a pickle-free container too (``fuser.backends._common.pack_sections``).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import grp
import os
import pwd
import re
import stat

import diskcache
from diskcache.core import MODE_BINARY, MODE_RAW, UNKNOWN

_VALUE_NAME = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val")  # diskcache's Disk.filename
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_INT64 = range(-(2**63), 2**63)
_WRITE_ATTEMPTS = 10  # another process may remove an emptied value directory under a write (diskcache retries too)


class UntrustedCache(Exception):
    """A cache directory, or a file of it, that someone other than the user may write: not used.
    The message says what is wrong; ``fix`` what to do."""

    def __init__(self, problem: str, fix: str):
        super().__init__(problem)
        self.fix = fix


class UnsafeEntry(ValueError):
    """A stored value neff_cache will not read: a pickle, or a file the checks of Note [Cache trust] refuse."""


@dataclasses.dataclass(frozen=True)
class Access:
    """The rules of one cache directory: who may write what is in it (Note [Cache trust])."""

    shared: bool = False  # shared with the directory's group
    gid: int | None = None  # that group

    @property
    def dir_mode(self) -> int:
        return 0o2770 if self.shared else 0o700

    @property
    def file_mode(self) -> int:
        return 0o660 if self.shared else 0o600

    def check(self, path: str, *, directory: bool = False, create: bool = False) -> None:
        """Check the file (or ``directory``) ``path`` if it exists; with ``create``, make it with
        this mode when missing. Raises UntrustedCache, or OSError if it is of another kind."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if not create or _make(path, directory, self.dir_mode if directory else self.file_mode):
                return
            st = os.lstat(path)  # made by another process meanwhile
        problem = self.problem(path, st)
        if problem is not None:
            raise UntrustedCache(*problem)
        if directory and not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
        if not directory and not stat.S_ISREG(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "not a regular file", path)

    def problem(self, path: str, st: os.stat_result) -> tuple[str, str] | None:
        """(what makes ``path`` untrusted, what to do), or None; ``st`` is its ``lstat``."""
        if stat.S_ISLNK(st.st_mode):
            target = os.path.realpath(path)
            return f"{path} is a symbolic link (to {target})", f"set NEURON_EAGER_CACHE_DIR={target}"
        if not self._trusted_owner(st.st_uid):
            return (f"{path} is owned by {_user_name(st.st_uid)}, not by {_user_name(os.geteuid())}",
                    "remove it if you did not make it, or use a cache directory of your own")
        if st.st_mode & stat.S_IWOTH:
            return f"{path} is writable by every user (mode {stat.filemode(st.st_mode)})", f"chmod o-w {path}"
        if st.st_mode & stat.S_IWGRP and not (self.shared and st.st_gid == self.gid):
            fix = f"chmod g-w {path}"
            if not self.shared:
                fix += (f", or, to share the cache with group {_group_name(st.st_gid)} whose members you trust to run "
                        "code as you, set NEURON_EAGER_CACHE_SHARED=group")
            return f"{path} is writable by group {_group_name(st.st_gid)} (mode {stat.filemode(st.st_mode)})", fix
        return None

    def _trusted_owner(self, uid: int) -> bool:
        return uid in (os.geteuid(), 0) or (self.shared and _in_group(uid, self.gid))


def open_directory(path: str, shared: bool = False) -> Access:
    """Create ``path`` (and missing ancestors, ``dir_mode`` whatever the umask) unless it exists,
    check it (Note [Cache trust]) and return its rules. Raises UntrustedCache, or OSError if it
    cannot be made."""
    missing = []
    parent = path
    while not os.path.lexists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for directory in reversed(missing):
        _make(directory, True, Access(shared).dir_mode)
    st = os.lstat(path)
    access = Access(shared, st.st_gid if shared else None)
    access.check(path, directory=True)
    if shared and not st.st_mode & stat.S_ISGID:
        raise UntrustedCache(f"{path} is shared with its group but has no setgid bit, so what one member creates "
                             "would not belong to the group", f"chmod g+s {path}")
    return access


def _make(path: str, directory: bool, mode: int) -> bool:
    """Create ``path`` with ``mode`` exactly (not masked by the umask; Linux's mkdir also drops the
    setgid bit); False if it exists."""
    try:
        if directory:
            os.mkdir(path, mode)
            fd = os.open(path, _DIR_FLAGS)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except FileExistsError:
        return False
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return True


class SafeDisk(diskcache.Disk):
    """diskcache's serialization with Note [No pickle] and Note [Cache trust] for value files.
    The cache that uses it sets ``access`` right after opening (no value is read or written before)."""

    access: Access

    def store(self, value, read, key=UNKNOWN):
        if type(value) is bytes and len(value) >= self.min_file_size and not read:
            filename, _ = self.filename(key, value)
            write_value(self._directory, filename, value, self.access)
            return len(value), MODE_BINARY, filename, None
        raw = (type(value) in (bytes, str) and len(value) < self.min_file_size) or (
            type(value) is int and value in _INT64) or type(value) is float
        if read or not raw:
            raise TypeError(f"neff_cache stores bytes, short str, int64 and float, not {type(value).__name__}")
        return super().store(value, read, key)

    def fetch(self, mode, filename, value, read):
        if read:
            raise TypeError("neff_cache reads values whole")
        if mode == MODE_RAW:
            return super().fetch(mode, filename, value, read)
        if mode == MODE_BINARY:
            return read_value(self._directory, filename, self.access)
        raise UnsafeEntry(f"a stored value of diskcache mode {mode!r} (pickled or text) is never read")

    def get(self, key, raw):
        if not raw:
            raise UnsafeEntry("a pickled key is never read")
        return super().get(key, raw)

    def remove(self, file_path):
        remove_value(self._directory, file_path, self.access)


def read_value(root: str, relative: str, access: Access) -> bytes:
    """The bytes of the value file ``relative`` under ``root``, following no symbolic link."""
    *dirs, name = _value_path(relative)
    fds = _walk(root, dirs, access, create=False)
    try:
        fd = _open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fds[-1])
        with open(fd, "rb") as file:
            _check_open(file.fileno(), f"{root}/{relative}", access, stat.S_ISREG)
            return file.read()
    finally:
        _close(fds)


def write_value(root: str, relative: str, data: bytes, access: Access) -> None:
    """Create the value file ``relative`` under ``root`` holding ``data`` (``file_mode``)."""
    *dirs, name = _value_path(relative)
    for attempt in range(1, _WRITE_ATTEMPTS + 1):
        fds = _walk(root, dirs, access, create=True)
        try:
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             access.file_mode, dir_fd=fds[-1])
            except FileNotFoundError:
                if attempt == _WRITE_ATTEMPTS:
                    raise
                continue  # another process removed our emptied directory: make it again
            try:
                with open(fd, "wb") as file:
                    os.fchmod(file.fileno(), access.file_mode)  # the umask does not decide its mode
                    file.write(data)
            except BaseException:
                os.unlink(name, dir_fd=fds[-1])
                raise
            return
        finally:
            _close(fds)


def remove_value(root: str, relative: str, access: Access) -> None:
    """Delete the value file ``relative`` and its emptied directories; never outside ``root``.
    Errors are ignored, as diskcache's own ``Disk.remove`` ignores them (another process may
    have removed it first)."""
    try:
        *dirs, name = _value_path(relative)
        fds = _walk(root, dirs, access, create=False)
    except (OSError, UnsafeEntry):
        return
    try:
        # innermost first: the file, then each directory it leaves empty
        for depth, (fd, entry) in enumerate(zip(reversed(fds), [name, *reversed(dirs)])):
            if depth == 0:
                os.unlink(entry, dir_fd=fd)
            else:
                os.rmdir(entry, dir_fd=fd)
    except OSError:
        pass  # not empty: other values live there
    finally:
        _close(fds)


def _value_path(relative: object) -> list[str]:
    if type(relative) is not str or _VALUE_NAME.fullmatch(relative) is None:
        raise UnsafeEntry(f"value file name {relative!r} is not one diskcache makes")
    return relative.split("/")


def _walk(root: str, dirs: list[str], access: Access, *, create: bool) -> list[int]:
    """Descriptors of ``root`` and of each of ``dirs`` below it, opened with O_NOFOLLOW and checked;
    with ``create``, missing ones are made (``dir_mode``)."""
    fds = [_open(root, _DIR_FLAGS)]
    try:
        for depth, name in enumerate(dirs, 1):
            made = False
            if create:
                try:
                    os.mkdir(name, access.dir_mode, dir_fd=fds[-1])
                    made = True
                except FileExistsError:
                    pass
            fds.append(_open(name, _DIR_FLAGS, dir_fd=fds[-1]))
            if made:
                os.fchmod(fds[-1], access.dir_mode)  # the umask does not decide its mode
            else:
                _check_open(fds[-1], os.path.join(root, *dirs[:depth]), access, stat.S_ISDIR)
        return fds
    except BaseException:
        _close(fds)
        raise


def _open(path: str, flags: int, dir_fd: int | None = None) -> int:
    try:
        return os.open(path, flags, dir_fd=dir_fd)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeEntry(f"{path} is a symbolic link or not a directory where one is expected") from None
        raise


def _check_open(fd: int, path: str, access: Access, is_kind) -> None:
    st = os.fstat(fd)
    problem = access.problem(path, st)
    if problem is not None:
        raise UnsafeEntry(problem[0])
    if not is_kind(st.st_mode):
        raise UnsafeEntry(f"{path} is not a {'directory' if is_kind is stat.S_ISDIR else 'regular file'}")


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


@functools.lru_cache(maxsize=64)
def _in_group(uid: int, gid: int | None) -> bool:
    try:
        user = pwd.getpwuid(uid)
        return user.pw_gid == gid or user.pw_name in grp.getgrgid(gid).gr_mem
    except (KeyError, TypeError):
        return False


def _user_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _group_name(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"
