"""Reading a file someone else handed over (a saved report, a rank's files in a ``combine`` folder) without
letting the file decide what happens: only a regular file is read, never a FIFO that blocks forever or a
device such as ``/dev/zero`` that never ends, and never more than a bound.

>>> import os, tempfile
>>> d = tempfile.mkdtemp()
>>> p = os.path.join(d, "r.json")
>>> _ = open(p, "w").write('{"ok": true}')
>>> read_bounded(p, limit=100)
'{"ok": true}'
>>> read_bounded(p, limit=5)
Traceback (most recent call last):
backward_doctor.util.files.UnsafeFile: ...r.json is 12 bytes, more than the 5 bytes a file of this kind may have
>>> os.mkfifo(os.path.join(d, "fifo")); read_bounded(os.path.join(d, "fifo"), limit=100)
Traceback (most recent call last):
backward_doctor.util.files.UnsafeFile: ...fifo is not a regular file (a FIFO)
"""
from __future__ import annotations

import os
import stat

#: What a saved report may weigh: the largest a run writes (60,000 recorded ops, a 4,096-point loop
#: series, the memory timeline) is tens of MB; past this a file is refused before it is read.
MAX_REPORT_BYTES = 256 * 1024 * 1024

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))


class UnsafeFile(ValueError):
    """A file that is not read: not a regular file, or larger than its bound (the message says which)."""


def read_bounded(path: str, limit: int = MAX_REPORT_BYTES, *, tail: bool = False, errors: str = "strict") -> str:
    """The text of the regular file ``path`` (UTF-8). A file over ``limit`` bytes raises :class:`UnsafeFile`,
    unless ``tail``: then its last ``limit`` bytes are read. ``OSError`` when it cannot be opened.

    The file is opened without blocking (a FIFO with no writer would block ``open`` itself), then checked
    on the open descriptor (no swap between a check and the read), and read up to the bound only."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            what = next((name for test, name in _KINDS if test(st.st_mode)), "not a plain file")
            raise UnsafeFile(f"{path} is not a regular file ({what})")
        size = st.st_size
        if size > limit:
            if not tail:
                raise UnsafeFile(f"{path} is {size:,} bytes, more than the {limit:,} bytes a file of this kind "
                                 "may have")
            os.lseek(fd, size - limit, os.SEEK_SET)
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks).decode("utf-8", errors=errors)
    finally:
        os.close(fd)
