"""Output files of ``pagedkv simulate`` (``--csv``, ``--plot``, ``--save-trace``).

What a path may name, decided before anything runs (:func:`check_output`):

- a regular file, or a name that does not exist yet in an existing directory: the
  output is written beside it under a fresh name and renamed over it once complete,
  so an interrupted write leaves the old file (or none), never half of one;
- a FIFO or a character device (``/dev/stdout``, ``/dev/null``, a terminal): opened
  and written in place, never replaced by a regular file;
- a symbolic link is followed: the file it points to is written as above and the
  link stays a link (a dangling link creates its target);
- refused: a directory, a block device, a socket, a path whose directory does not
  exist or cannot be written, and a path that is one of the run's inputs (the same
  file, through any name or link) or another output of the same run.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = ["OutputPathError", "check_output", "open_output"]


class OutputPathError(ValueError):
    """An output path that cannot or must not be written (the message says why)."""


def _special(mode: int) -> bool:
    """Written in place: FIFOs and character devices."""
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def check_output(
    path: str | Path,
    *,
    inputs: Iterable[str | Path] = (),
    others: Iterable[str | Path] = (),
    what: str = "output",
) -> None:
    """Refuses (:class:`OutputPathError`) an output path that cannot be written, or
    that would destroy an input (``inputs``: files the run reads) or another output
    (``others``). Nothing is created or opened."""
    p = os.fspath(path)
    if not p:
        raise OutputPathError(f"{what}: an empty path")
    real = os.path.realpath(p)
    try:
        st: os.stat_result | None = os.stat(real)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise OutputPathError(f"{what} {p}: {e.strerror or e}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise OutputPathError(f"{what} {p}: is a directory")
        if not (stat.S_ISREG(st.st_mode) or _special(st.st_mode)):
            raise OutputPathError(
                f"{what} {p}: not a regular file, FIFO or character device (refused)"
            )
        for other in inputs:
            try:
                if _same(st, os.stat(other)):
                    raise OutputPathError(f"{what} {p}: is the input {os.fspath(other)}")
            except OSError:
                continue
        if not os.access(real, os.W_OK):
            raise OutputPathError(f"{what} {p}: not writable")
    for other in others:
        o = os.fspath(other)
        try:
            same = (st is not None and _same(st, os.stat(o))) or os.path.realpath(o) == real
        except OSError:
            same = os.path.realpath(o) == real
        if same and not (st is not None and _special(st.st_mode)):
            raise OutputPathError(f"{what} {p}: another output of this run writes {o}")
    if st is None or stat.S_ISREG(st.st_mode):
        parent = os.path.dirname(real)
        if not os.path.isdir(parent):
            raise OutputPathError(f"{what} {p}: no directory {parent}")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise OutputPathError(f"{what} {p}: directory {parent} not writable")


@contextmanager
def open_output(
    path: str | Path, mode: str = "w", *, newline: str | None = None
) -> Iterator[IO[Any]]:
    """The output file open for writing (``mode`` ``"w"`` or ``"wb"``), as
    :func:`check_output` describes: a FIFO or character device is written in
    place; anything else is written to a fresh file beside the link-resolved
    target and renamed over it when the block ends without an exception."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    text = mode == "w"
    real = os.path.realpath(os.fspath(path))
    try:
        st: os.stat_result | None = os.stat(real)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise OutputPathError(f"{os.fspath(path)}: is a directory")
    if st is not None and _special(st.st_mode):
        with open(
            real, mode, encoding="utf-8" if text else None, newline=newline if text else None
        ) as f:
            yield f
        return
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise OutputPathError(f"{os.fspath(path)}: not a regular file, FIFO or character device")
    parent, name = os.path.split(real)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=parent)
    try:
        # mkstemp creates the file 0600: give it the mode the old file had, or
        # what a new file gets under the umask.
        if st is not None:
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(
            fd, mode, encoding="utf-8" if text else None, newline=newline if text else None
        ) as f:
            fd = -1
            yield f
        os.replace(tmp, real)
        tmp = ""
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
