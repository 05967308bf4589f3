"""The program that builds a sandbox session's jail: namespaces, its root, limits, the shell (docs/sandbox.md)."""

# Run as root by a fresh interpreter (-I -S: no site, no user paths). Three processes:
#  - this one (the server's child) unshares the namespaces, forks init, and stays outside them to
#    end the session: on SIGTERM, or when the server is gone, it SIGKILLs init and waits for it;
#  - init, PID 1 of the new PID namespace, builds the session's root and pivots into it, forks the
#    shell and reaps whatever is orphaned to it; when the shell exits, so does init, and the kernel
#    kills everything left in the namespace before init's parent sees it exit;
#  - the shell, forked by init: limits, then the session's uid and gid, no_new_privs, exec.
JAIL = r"""
import ctypes, json, os, platform, resource, signal, sys
a = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x20000000 | 0x40000000  # mount cgroup uts ipc pid net
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217, "armv7l": 218, "i686": 217}
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 38, 22
# Per architecture: the seccomp audit arch, and the numbers of clone, unshare, clone3 and keyctl.
SECCOMP = {"x86_64": (0xC000003E, 56, 272, 435, 250), "aarch64": (0xC00000B7, 220, 97, 435, 219)}
CLONE_NEWUSER = 0x10000000
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_CLEAR, KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING = 1, 7, -4, -5

class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

def fail(exc):
    os.write(1, ("rollbook-sandbox-failed %s\n" % (exc,)).encode(errors="replace"))
    os._exit(126)

def ok(rc, what):
    if rc != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, "%s: %s" % (what, os.strerror(errno)))

def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    ok(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), "mount %s" % target)

def build_root(root):
    # One tmpfs holds everything the session may write, so disk_mb is a quota for all of it together.
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=%dk,nr_inodes=%d,mode=755" % (a["disk_kb"], a["inodes"]))
    for path in a["system"]:
        if os.path.islink(path):
            os.symlink(os.readlink(path), root + path)
        elif os.path.isdir(path):
            os.makedirs(root + path)  # a harness's folder may lie deeper than the system's
            mount(path, root + path, None, MS_BIND | MS_REC)
            mount(None, root + path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    for folder, mode in (("/dev", 0o755), ("/dev/shm", 0o1777), ("/tmp", 0o1777), ("/var", 0o755), ("/var/tmp", 0o1777),
                         ("/proc", 0o555), ("/home", 0o755), (a["home"], 0o700)):
        os.mkdir(root + folder)
        os.chmod(root + folder, mode)
    os.chown(root + a["home"], a["uid"], a["gid"])
    for name in a["devices"]:
        open(root + "/dev/" + name, "w").close()
        mount("/dev/" + name, root + "/dev/" + name, None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, root + "/dev/" + name)
    # Mounted by PID 1 of the new PID namespace: it lists the session's processes only.
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(root)
    if platform.machine() not in PIVOT_ROOT:
        raise OSError("pivot_root: no system call number known for %s" % platform.machine())
    ok(libc.syscall(PIVOT_ROOT[platform.machine()], b".", b"."), "pivot_root")
    ok(libc.umount2(b".", 2), "umount the host's root")  # MNT_DETACH: the host's tree leaves this namespace
    os.chdir("/")

def no_user_namespaces():
    # A user namespace would make the session root of its own mounts (a tmpfs past disk_mb, say) and of
    # whatever else the kernel lets a namespace's root do: clone and unshare with CLONE_NEWUSER fail.
    # clone3 passes its flags in memory a filter cannot read, so it is refused as unknown (ENOSYS),
    # which makes the C library fall back to clone; another architecture's calls are refused outright.
    arch, clone, unshare, clone3 = SECCOMP[platform.machine()][:4]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    program = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, eperm), (ld, 0, 0, 0),
               (jge, 5, 0, 0x40000000),  # x32 system calls
               (jeq, 6, 0, clone3), (jeq, 1, 0, unshare), (jeq, 0, 3, clone),
               (ld, 0, 0, 16), (jset, 0, 1, CLONE_NEWUSER),
               (ret, 0, 0, eperm), (ret, 0, 0, allow), (ret, 0, 0, enosys)]
    # Jump offsets count instructions skipped: 10 is eperm, 11 allow, 12 enosys.
    filters = (SockFilter * len(program))(*[SockFilter(*i) for i in program])
    fprog = SockFprog(len(program), filters)
    ok(libc.prctl(PR_SET_SECCOMP, 2, ctypes.byref(fprog), 0, 0), "prctl(PR_SET_SECCOMP)")

def own_keyring():
    # Keyrings are per uid and outlive processes; a later session of this uid must not find what an
    # earlier one left in them, and this one must not share a session keyring with anyone.
    keyctl = SECCOMP[platform.machine()][4]
    for ring in (KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING):
        ok(libc.syscall(keyctl, KEYCTL_CLEAR, ring), "keyctl(KEYCTL_CLEAR)")
    if libc.syscall(keyctl, KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        ok(-1, "keyctl(KEYCTL_JOIN_SESSION_KEYRING)")

def shell():
    # At the memory limit the kernel kills a process of the group: the shell's and its children's come
    # first (they inherit this), so the jail's root and init, which end the session, are left alone.
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    for name, soft, hard in a["limits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    os.setgroups([])
    os.setgid(a["gid"])
    os.setuid(a["uid"])
    if os.getuid() != a["uid"] or os.geteuid() != a["uid"] or os.getgid() != a["gid"] or os.getgroups():
        raise OSError("the user did not change")
    own_keyring()
    ok(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    no_user_namespaces()
    os.chdir(a["home"])
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # python ignores it, and an ignored signal survives exec
    os.execve(a["shell"], [a["shell"]], a["env"])

def init():
    try:
        ok(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
        build_root("/tmp")  # a mount point this namespace alone sees; after the pivot it is the root
        ok(libc.sethostname(b"sandbox", 7), "sethostname")
        pid = os.fork()
        if pid == 0:
            try:
                shell()
            except Exception as exc:
                fail(exc)
    except Exception as exc:
        fail(exc)
    while True:
        reaped, status = os.wait()  # orphans of the session are reparented here
        if reaped == pid:
            os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))

try:
    if platform.machine() not in SECCOMP:
        raise OSError("seccomp: no system call numbers known for %s" % platform.machine())
    # Before anything else: every process of the session, this one included, is charged to its groups.
    for group in a["cgroups"]:
        with open(group + "/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
    ok(libc.unshare(NAMESPACES), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted from here on reaches the host
except Exception as exc:
    fail(exc)
watched = {signal.SIGCHLD, signal.SIGTERM}
signal.pthread_sigmask(signal.SIG_BLOCK, watched)
child = os.fork()
if child == 0:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, watched)
    init()
while True:
    got = signal.sigtimedwait(watched, 1.0)
    if (got is not None and got.si_signo == signal.SIGTERM) or os.getppid() != a["server"]:
        os.kill(child, signal.SIGKILL)
    done, status = os.waitpid(child, os.WNOHANG)
    if done:
        os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
"""
