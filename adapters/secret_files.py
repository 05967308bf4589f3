"""Files that hold a credential: created owner-only from their first byte, and refused when others can read them.

A credential in a file is only as private as the file's mode. Another local user (a sandbox shell
running as `nobody`, say) reads any file that is open to group or others, so rollbook writes
every such file with mode 0600 from the moment it exists (never chmod after: a reader could open
it in between) and will not read a credential from one that is open to group or others.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from engine.errors import ConfigError

# Any permission bit for group or others: readable lets them see the secret, writable lets them
# replace it (and so choose the server a process trusts), so both are refused.
OPEN_TO_OTHERS = 0o077


def write_private(path: str | Path, text: str, owner: tuple[int, int] | None = None) -> None:
    """Write `text` to `path` with mode 0600, atomically: a reader sees the old file or the whole new
    one, and no one else ever sees either (the new file is 0600 before it has a byte). `owner`
    (uid, gid) hands the file to another user before it takes the old one's place."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")  # mkstemp: O_EXCL, 0600
    try:
        if owner is not None:
            os.fchown(fd, *owner)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def create_private(path: str | Path, text: str) -> bool:
    """Create `path` with mode 0600 holding `text`, unless it exists; return whether this call created it.
    Exclusive creation settles a race between two processes: the loser reads the winner's file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return True


def check_private(path: str | Path, what: str) -> None:
    """Refuse a file holding a credential that group or others may open."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & OPEN_TO_OTHERS:
        raise ConfigError(f"{what} {path} holds a credential and is open to group or others (mode {mode:04o})",
                          f"chmod 600 {path}")


def read_private(path: str | Path, what: str) -> str:
    """The text of a credential file, after checking that only its owner may open it."""
    try:
        check_private(path, what)
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} not found", "give the path of an existing file") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a directory", "give the path of a file") from None
