"""File modes of durable artifacts: one rule for every file of a catalog or a saved buffer.

A durable artifact (a dataset catalog, a saved replay buffer) is a directory of files that
outlives the process. The rule:

- Every file of one artifact gets the same mode, ``mode``: ``0o600`` by default (private to its
  owner), ``0o640`` (the group may read) or ``0o644`` (everyone may read) when the caller asks.
  Nobody but the owner may ever write: the artifact is read-only to everyone else.
- Its directory gets the same bits plus search (``x``) wherever it is readable: ``0o700``,
  ``0o750``, ``0o755``.
- Modes are set with ``fchmod``/``chmod`` after creation, so the umask cannot make one file
  differ from the others (a reader who can open one file can open them all).
- Files are created exclusively (``O_EXCL``) and never through a symlink (``O_NOFOLLOW``).

A file the process may not read is a :class:`~tensortier.errors.PermissionDeniedError` naming
it and its mode (:func:`denied`), never a raw ``PermissionError`` from deep inside a read.
"""

from __future__ import annotations

import os
import stat

from tensortier._units import is_int
from tensortier.errors import ConfigError, PermissionDeniedError

PRIVATE = 0o600
MODES = {0o600: "private", 0o640: "group-readable", 0o644: "readable by everyone"}
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


def check_mode(mode: object, what: str) -> int:
    """``mode`` if it is one of :data:`MODES`, else a ConfigError naming the choices."""
    if not is_int(mode) or mode not in MODES:
        shown = oct(mode) if is_int(mode) else repr(mode)
        raise ConfigError(
            f"{what}: mode={shown}; pass 0o600 (private, the default), 0o640 (the group may "
            f"read) or 0o644 (everyone may read). Every file gets this mode and only the owner "
            f"may write"
        )
    return mode


def dir_mode(mode: int) -> int:
    """The directory mode that goes with file ``mode``: the same bits, plus x where readable."""
    return mode | ((mode & 0o444) >> 2) | 0o700


def create(path: str, mode: int, flags: int = 0) -> int:
    """A new file at ``path`` (exclusive, never through a symlink) with exactly ``mode``."""
    fd = os.open(path, _CREATE | flags, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have taken bits away
    except BaseException:
        os.close(fd)
        raise
    return fd


def set_dir(path: str, mode: int) -> None:
    """Give the artifact directory ``path`` the mode that goes with file ``mode``."""
    os.chmod(path, dir_mode(mode))


def denied(path: str, exc: OSError | None, what: str) -> PermissionDeniedError:
    """The error for a file of an artifact this process may not read (``exc``: the raw error)."""
    try:
        st = os.stat(path)
        shown = f"mode {oct(stat.S_IMODE(st.st_mode))}, owner uid {st.st_uid}"
    except OSError:
        shown = "its directory cannot be searched"
    reason = f" ({exc.strerror})" if exc is not None and exc.strerror else ""
    return PermissionDeniedError(
        f"{what}: cannot read {path!r}{reason}: {shown}, this process runs as uid "
        f"{os.geteuid()}. Ask its owner to write it with mode=0o640 or 0o644 (or to chmod the "
        f"directory and its files), or run as its owner",
        path=path,
    )
