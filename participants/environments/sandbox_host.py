"""What a sandbox session takes of the host: a uid no other session holds, and its own cgroups (memory
with tmpfs, shm and memfd counted, processes, CPU), made before its jail starts and emptied when it
ends. Runtime state lives in a folder only root can make or write.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pwd
import secrets
import stat
import time

from participants.environments.base import ToolError

# The controllers a session's group is made in, under `cgroup_root` (cgroup v1 hierarchies).
CONTROLLERS = ("memory", "pids", "cpu")
CFS_PERIOD_US = 100_000


def private_folder(path: str) -> None:
    """Makes `path` (0700, root's) or checks that it is that: a folder another user made or can write
    could be made first to refuse every session, or filled with claims."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ToolError("sandbox_unavailable", f"cannot make the sandbox's state folder {path}: {exc.strerror}") from None
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
        raise ToolError("sandbox_unavailable", f"{path} must be a folder owned by root that no group or other user can "
                                               f"write (it is uid {info.st_uid}, mode {stat.filemode(info.st_mode)}); "
                                               "remove it or fix it, then start again")


def claim_uid(state_dir: str, uid_base: int, uids: int) -> tuple[int, int]:
    """A uid of the range that no other session on this machine holds, and the fd that holds it.

    An flock on a file per uid, so servers sharing the machine (and the range) never share a uid,
    and a server that dies releases its uids with its processes (its jails die with it)."""
    private_folder(state_dir)
    locks = os.path.join(state_dir, "sandbox-uids")
    private_folder(locks)
    start = secrets.randbelow(uids)
    for n in range(uids):
        uid = uid_base + (start + n) % uids
        try:
            pwd.getpwuid(uid)
            continue  # an account's files and processes: never a session's
        except KeyError:
            pass
        fd = os.open(os.path.join(locks, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return uid, fd
    raise ToolError("sandbox_unavailable", f"all {uids} sandbox uids from {uid_base} are in use "
                                           "(the [sandbox] table's uid_base and uids)")


def _cgroup_write(group: str, name: str, value: str) -> None:
    # r+, never w: a file the kernel did not make is not a control file, and must not be created.
    with open(os.path.join(group, name), "r+") as f:
        f.write(value)


def cgroup_kill(group: str, deadline: float) -> bool:
    """SIGKILLs every process in `group` until none is left (True) or `deadline` passes."""
    while time.monotonic() < deadline:
        try:
            with open(os.path.join(group, "cgroup.procs")) as f:
                pids = [int(p) for p in f.read().split()]
        except FileNotFoundError:
            return True
        if not pids:
            return True
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    return False


def make_cgroups(cgroup_root: str, uid: int, memory_mb: int, max_processes: int, cpus: float) -> list[str]:
    """The session's group in each controller, its limits set, empty: what its jail joins first.

    Named by the session's uid, which the caller holds: a group left by a server that died is this
    session's to empty and reuse. Whatever cannot be set refuses the session: it never runs unbounded."""
    mb = 1024 * 1024
    groups = []
    for controller in CONTROLLERS:
        top = os.path.join(cgroup_root, controller, "rollbook")
        group = os.path.join(top, str(uid))
        try:
            for folder in (top, group):
                try:
                    os.mkdir(folder, 0o700)
                except FileExistsError:
                    pass
            if not cgroup_kill(group, time.monotonic() + 5.0):
                raise OSError(f"{group} still has processes")
            if controller == "memory":
                try:
                    _cgroup_write(group, "memory.limit_in_bytes", str(memory_mb * mb))
                except OSError as exc:
                    # A group left with a smaller memory + swap bound refuses a memory bound above it
                    # (EINVAL): that one goes up first.
                    if exc.errno != errno.EINVAL:
                        raise
                    _cgroup_write(group, "memory.memsw.limit_in_bytes", str(memory_mb * mb))
                    _cgroup_write(group, "memory.limit_in_bytes", str(memory_mb * mb))
                # Swap would let the session hold more than its limit: bound memory + swap together
                # where the kernel accounts swap, else keep the group's pages out of swap.
                try:
                    _cgroup_write(group, "memory.memsw.limit_in_bytes", str(memory_mb * mb))
                except OSError:
                    _cgroup_write(group, "memory.swappiness", "0")
            elif controller == "pids":
                _cgroup_write(group, "pids.max", str(max_processes + 2))  # and the jail's root and init
            else:
                _cgroup_write(group, "cpu.cfs_period_us", str(CFS_PERIOD_US))
                _cgroup_write(group, "cpu.cfs_quota_us", str(max(1000, int(cpus * CFS_PERIOD_US))))
        except OSError as exc:
            remove_cgroups(groups)
            raise ToolError("sandbox_unsupported", f"{controller} cgroup: cannot bound the session at {group} "
                                                   f"({exc}); the sandbox needs cgroup v1's {controller} controller "
                                                   "writable by root under cgroup_root") from None
        groups.append(group)
    return groups


def remove_cgroups(groups: list[str]) -> None:
    deadline = time.monotonic() + 5.0
    for group in groups:
        cgroup_kill(group, deadline)
        try:
            os.rmdir(group)
        except OSError:
            pass  # emptied but still busy for a moment: the next session of this uid reuses it
