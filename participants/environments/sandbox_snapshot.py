"""A sandbox session at a boundary: its files, working directory and exported environment, and a fresh
jail rebuilt from them.

After each command the server (root, on the host) reads the session's tree through its init's
`/proc/<pid>/root`: the session's tmpfs, the only place it can write (`ROOTS`). Nothing there is
followed: every directory is opened relative to its parent with `O_NOFOLLOW`, a symbolic link is
recorded as its target, and a file is read only once it is known to be a regular file. The shell
is idle while this runs (it waits on its input) and a session with any other process running is
not read at all (`unrestorable`), so nothing moves under the walk.

What is stored (engine.file_blobs): each file's content once, named by its digest, and a manifest
blob holding the tree (path -> type, mode, size, digest or link target), the working directory and
the environment. A file is read again only when its inode, size, mtime or ctime changed (the kernel
sets ctime; a session cannot put it back), and a manifest lists only what changed since the last
full manifest it names as its base, until that is more than a quarter of the tree: a command's
snapshot costs what it changed, plus a walk of the tree's metadata.

Not kept: modification times (a restored file is as new as its restore; the manifest would
otherwise differ between two runs of the same commands), hard links (each name gets its own copy),
shell variables that are not exported, functions, aliases, jobs and `$?`. A socket in the tree
(or any file type but a file, folder, link or FIFO) makes the session unrestorable at that boundary.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidCheckpointState
from engine.file_blobs import Blob, checked

ROOTS = ("home/sandbox", "tmp", "var/tmp", "dev/shm")  # the session's tmpfs: everything it can write
HOME = "home/sandbox"
FORMAT = 1
DELTA_FLOOR = 64  # a manifest may list this many changes against its base, whatever the tree's size
SHELL_STATE_BYTES = 65_536  # the working directory and environment together
# What the server asks the shell after each command, and after a restore to check it.
SHELL_STATE_COMMAND = "pwd; env -0 </dev/null\n"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

Load = Callable[[Sequence[str]], dict[str, bytes]]  # digests -> contents, as the blob store has them


class Unrestorable(Exception):
    """The session's state cannot be kept or rebuilt; the message says why, for a person."""


@dataclass
class Known:
    """What the server last stored of one live session's tree: only what differs is read and stored."""

    stats: dict[str, tuple[int, int, int, int, str]] = field(default_factory=dict)  # path -> ino, size, mtime, ctime, digest
    base: str | None = None  # the full manifest later ones are deltas of
    base_files: dict[str, dict[str, Any]] = field(default_factory=dict)
    stored: set[str] = field(default_factory=set)  # blobs this server stored or read for the session


@dataclass(frozen=True)
class Snapshot:
    digest: str
    blobs: tuple[Blob, ...]  # not stored before: the manifest and the files that changed
    changed: int  # entries the manifest lists against its base (all of them for a full one)


def manifest_of(files: dict[str, dict[str, Any]], cwd: str, env: dict[str, str], known: Known,
                new: list[Blob]) -> Snapshot:
    """The manifest blob of this tree and shell state, a delta of `known.base` while that stays small."""
    delta: dict[str, dict[str, Any] | None] = {p: e for p, e in files.items() if known.base_files.get(p) != e}
    delta.update({p: None for p in known.base_files if p not in files})
    full = known.base is None or len(delta) > max(DELTA_FLOOR, len(files) // 4)
    listed: dict[str, dict[str, Any] | None] = dict(files) if full else delta
    body = {"format": FORMAT, "base": None if full else known.base, "files": listed, "cwd": cwd, "env": env}
    names = sorted({e["h"] for e in listed.values() if e is not None and e["t"] == "f"}
                   | ({known.base} if not full and known.base else set()))
    blob = Blob(json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), tuple(names))
    if full:
        known.base, known.base_files = blob.digest, dict(files)
    blobs = [*new, blob] if blob.digest not in known.stored else new
    known.stored.update(b.digest for b in blobs)
    return Snapshot(blob.digest, tuple(blobs), len(listed))


def read_tree(root: str, known: Known) -> tuple[dict[str, dict[str, Any]], list[Blob]]:
    """The tree under `root` (a jail's root seen from the host) and the file blobs not stored yet."""
    files: dict[str, dict[str, Any]] = {}
    new: dict[str, Blob] = {}
    stats: dict[str, tuple[int, int, int, int, str]] = {}
    for top in ROOTS:
        top_fd = _open_dir(root, top)
        try:
            if top == HOME:
                files[HOME] = {"t": "d", "m": stat.S_IMODE(os.fstat(top_fd).st_mode)}
            for folder, dirs, names, dir_fd in os.fwalk(".", dir_fd=top_fd, follow_symlinks=False):
                prefix = top if folder == "." else f"{top}/{folder[2:]}"
                for name in [*dirs, *names]:
                    path = f"{prefix}/{name}"
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    files[path] = _entry(path, name, dir_fd, st, known, stats, new)
        finally:
            os.close(top_fd)
    known.stats = stats
    return files, list(new.values())


def _entry(path: str, name: str, dir_fd: int, st: os.stat_result, known: Known,
           stats: dict[str, tuple[int, int, int, int, str]], new: dict[str, Blob]) -> dict[str, Any]:
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISDIR(st.st_mode):
        return {"t": "d", "m": mode}
    if stat.S_ISLNK(st.st_mode):
        return {"t": "l", "to": os.readlink(name, dir_fd=dir_fd)}
    if stat.S_ISFIFO(st.st_mode):
        return {"t": "p", "m": mode}
    if not stat.S_ISREG(st.st_mode):
        raise Unrestorable(f"/{path} is a {_kind(st.st_mode)}, which a snapshot cannot hold")
    key = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    seen = known.stats.get(path)
    if seen is not None and seen[:4] == key:
        digest = seen[4]
    else:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            if os.fstat(fd).st_ino != st.st_ino:
                raise Unrestorable(f"/{path} changed while it was read")
            content = _read_all(fd)
        finally:
            os.close(fd)
        blob = Blob(content)
        digest = blob.digest
        if digest not in known.stored:
            new[digest] = blob
    stats[path] = (*key, digest)
    return {"t": "f", "m": mode, "s": st.st_size, "h": digest}


def _write_all(fd: int, content: bytes) -> None:
    view = memoryview(content)
    while view:
        view = view[os.write(fd, view):]


def _kind(mode: int) -> str:
    return "socket" if stat.S_ISSOCK(mode) else "device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "special file"


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _open_dir(root: str, path: str) -> int:
    """`path` under `root`, each component opened without following a link."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in path.split("/"):
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


# ---- the shell's state ---------------------------------------------------------------------


def parse_shell_state(output: str) -> tuple[str, dict[str, str]]:
    """The working directory and exported environment from SHELL_STATE_COMMAND's output."""
    cwd, _, rest = output.partition("\n")
    if not cwd.startswith("/") or "\ufffd" in output:
        raise Unrestorable("the shell did not report its working directory and environment")
    env: dict[str, str] = {}
    for item in rest.split("\0"):
        if not item:
            continue
        name, eq, value = item.partition("=")
        if not eq or not _NAME.fullmatch(name):
            raise Unrestorable(f"the shell's environment holds {name[:40]!r}, which no shell can export again")
        env[name] = value
    return cwd, env


def restore_script(cwd: str, env: dict[str, str], now: dict[str, str]) -> str:
    """What makes a fresh shell, whose environment is `now`, stand in `cwd` with exactly `env`."""
    lines = [f"cd -- {_quote(cwd)} || exit 97"]
    lines += [f"unset {name}" for name in sorted(set(now) | {"OLDPWD"}) if name not in env and name != "PWD"]
    lines += [f"export {name}={_quote(value)}" for name, value in sorted(env.items()) if name != "PWD"]
    return "\n".join(lines) + "\n"


def _quote(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"


# ---- restore -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stored:
    """A manifest as the blob store gives it back, every blob checked."""

    files: dict[str, dict[str, Any]]
    cwd: str
    env: dict[str, str]
    contents: dict[str, bytes]  # digest -> a file's content
    base: str  # the full manifest it is, or is a delta of
    base_files: dict[str, dict[str, Any]]


def load_manifest(digest: str, load: Load) -> Stored:
    """The tree, working directory and environment a manifest gives, and every file's content, each
    blob checked against its digest (InvalidCheckpointState names the first that is missing or wrong)."""
    body = _manifest(digest, load)
    base_digest, base = digest, body
    if body.get("base"):
        base_digest, base = body["base"], _manifest(body["base"], load)
        if base.get("base"):
            raise InvalidCheckpointState(f"manifest {digest}: its base {body['base']} is a delta too")
    files: dict[str, dict[str, Any]] = dict(base["files"])
    for path, entry in body["files"].items():
        if entry is None:
            files.pop(path, None)
        else:
            files[path] = entry
    for path in files:
        _check_path(path)
    wanted = sorted({e["h"] for e in files.values() if e["t"] == "f"})
    contents = checked(wanted, load(wanted))
    return Stored(files, body["cwd"], dict(body["env"]), contents, base_digest, dict(base["files"]))


def _manifest(digest: str, load: Load) -> dict[str, Any]:
    raw = checked([digest], load([digest]))[digest]
    body = json.loads(raw)
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise InvalidCheckpointState(f"blob {digest} is not a sandbox manifest of format {FORMAT}")
    return body


def _check_path(path: str) -> None:
    parts = path.split("/")
    inside = path == HOME or any(path.startswith(r + "/") for r in ROOTS)
    if not inside or any(p in ("", ".", "..") for p in parts) or "\0" in path:
        raise InvalidCheckpointState(f"a manifest names {path[:80]!r}, outside what a session can write")


def write_tree(root: str, stored: Stored, uid: int, known: Known) -> None:
    """The tree into a fresh jail's root (nothing runs in it yet), owned by the session's uid; `known`
    learns each file's inode and times and the manifests, so the next snapshot is as small as if the
    session had never moved."""
    files, contents = stored.files, stored.contents
    folders: dict[str, int] = {}
    modes: list[tuple[str, int]] = []
    try:
        for top in ROOTS:
            folders[top] = _open_dir(root, top)
        for path in sorted(files):
            entry = files[path]
            if path == HOME:
                modes.append((path, entry["m"]))
                continue
            parent, name = path.rsplit("/", 1)
            pfd = folders[parent]
            kind = entry["t"]
            if kind == "d":
                os.mkdir(name, 0o700, dir_fd=pfd)
                folders[path] = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
                os.fchown(folders[path], uid, uid)
                modes.append((path, entry["m"]))
            elif kind == "l":
                os.symlink(entry["to"], name, dir_fd=pfd)
                os.chown(name, uid, uid, dir_fd=pfd, follow_symlinks=False)
            elif kind == "p":
                os.mkfifo(name, 0o600, dir_fd=pfd)
                os.chown(name, uid, uid, dir_fd=pfd, follow_symlinks=False)
                os.chmod(name, entry["m"], dir_fd=pfd)
            else:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=pfd)
                try:
                    _write_all(fd, contents[entry["h"]])
                    os.fchown(fd, uid, uid)
                    os.fchmod(fd, entry["m"])
                    st = os.fstat(fd)
                finally:
                    os.close(fd)
                known.stats[path] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, entry["h"])
        for path, mode in reversed(modes):  # last, deepest first: a folder made read-only is already full
            os.fchmod(folders[path], mode)
    finally:
        for fd in folders.values():
            os.close(fd)
    known.stored.update(contents)
    known.stored.add(stored.base)
    known.base, known.base_files = stored.base, stored.base_files
