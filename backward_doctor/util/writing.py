"""Writing a file the doctor makes (a report, a page, an export) so that nothing planted at its name decides
where the bytes go, and no half file is ever left.

The bytes go into a new file created exclusively beside the final name (same folder, an unpredictable name:
``mkstemp``, ``O_EXCL``), then :func:`os.replace` renames it onto the final name. A rename replaces a
symbolic link sitting at that name, it never follows it: a link planted in an output folder (``run
--output-dir``, a callback's folder, ``render -o``) cannot make the doctor overwrite the file it points
to. A write that fails midway (a full disk, a quota, a file size limit) removes the new file and leaves
whatever was at the final name untouched: the file is there whole, or not at all.

>>> import os, tempfile
>>> d = tempfile.mkdtemp()
>>> victim = os.path.join(d, "victim.txt")
>>> _ = open(victim, "w").write("precious")
>>> os.symlink(victim, os.path.join(d, "report.json"))
>>> write_atomic(os.path.join(d, "report.json"), '{"ok": true}')  # doctest: +ELLIPSIS
'...report.json'
>>> open(victim).read(), os.path.islink(os.path.join(d, "report.json")), sorted(os.listdir(d))
('precious', False, ['report.json', 'victim.txt'])
>>> os.mkdir(os.path.join(d, "taken"))
>>> write_atomic(os.path.join(d, "taken"), "x")  # doctest: +ELLIPSIS
Traceback (most recent call last):
IsADirectoryError: [Errno 21] Is a directory: '...taken'
>>> sorted(os.listdir(d))
['report.json', 'taken', 'victim.txt']
"""
from __future__ import annotations

import os
import tempfile


def _umask() -> int:
    """The process's umask (the mode a plain ``open(path, "w")`` gives a new file), read without changing it
    where Linux says it (``/proc/self/status``)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: str | os.PathLike, data: str | bytes) -> str:
    """Write ``data`` (text as UTF-8) to ``path`` whole or not at all, replacing what is at ``path`` (a link
    itself, never its target); returns ``path``. ``OSError`` naming ``path`` when it cannot be written
    (its folder missing or read-only, a folder at ``path``, a full disk), with nothing left behind."""
    path = os.fspath(path)
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)[:64]}.", suffix=".part", dir=folder)
    except OSError as exc:
        raise _named(exc, path) from None
    try:
        try:
            os.fchmod(fd, 0o666 & ~_umask())
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise _named(exc, path) from None
        raise
    return path


def _named(exc: OSError, path: str) -> OSError:
    """The error as ``open(path)`` would have said it: its kind (``IsADirectoryError``...) and the final name,
    not the temporary one."""
    if exc.errno is None:
        return OSError(f"{path}: {exc}")
    return OSError(exc.errno, exc.strerror or os.strerror(exc.errno), path)


__all__ = ["write_atomic"]
