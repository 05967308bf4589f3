"""The sandbox's jail, one limit at a time, on real processes and the real kernel: off unless
configured; when on, an unprivileged user, no network, CPU time, memory, output size and wall clock
each bounded; and each session alone in its jail, attacked the ways a hostile policy would: signals,
files, processes, forks, disk, leftovers and oversized commands aimed at another session or the host."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

from participants.environments import ToolError
from participants.environments import sandbox as sandbox_module
from participants.environments.sandbox import LiveShell, SandboxEnvironment, SandboxLimits
from participants.environments.sandbox_host import claim_uid, make_cgroups, remove_cgroups
from participants.environments.tasks import make_task

TASK = make_task("sandbox", 0)

# The jail drops to another user, which takes root: CI and this project's machines run as root.


def run(env: SandboxEnvironment, shell: LiveShell, command: str) -> dict:
    return env.call_live(shell, "run", {"command": command}).output


@pytest.fixture
def jailed() -> Iterator[tuple[SandboxEnvironment, LiveShell]]:
    # A wall clock well past the CPU limit: on a loaded 2-core machine 1 s of CPU can take several.
    env = SandboxEnvironment(SandboxLimits(cpu_s=1, memory_mb=256, output_bytes=1000, timeout_s=30))
    shell = env.open_live(TASK)
    yield env, shell
    env.close_live(shell)


def test_without_limits_the_sandbox_opens_no_shell() -> None:
    with pytest.raises(ToolError) as err:
        SandboxEnvironment().open_live(TASK)
    assert err.value.code == "sandbox_disabled"


def test_commands_run_as_an_unprivileged_user_without_supplementary_groups(jailed) -> None:
    env, shell = jailed
    out = run(env, shell, "id -u; id -G; touch /root/x 2>&1; echo $?")["output"].split("\n")
    assert out[0] == out[1] == str(shell.uid) and shell.uid >= SandboxLimits.uid_base and out[-2] != "0"


def test_commands_have_no_network_not_even_this_machines_loopback(jailed) -> None:
    env, shell = jailed
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        probe = f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)\" 2>&1; echo rc=$?"
        out = run(env, shell, probe)["output"]
    assert "rc=1" in out and ("unreachable" in out or "refused" in out), out
    assert run(env, shell, "grep -c : /proc/net/dev")["output"].strip() == "1"  # loopback only, and it is down


def test_cpu_time_is_limited(jailed) -> None:
    env, shell = jailed
    out = run(env, shell, "( while :; do :; done ); echo rc=$?")["output"]
    assert "rc=152" in out  # 128 + SIGXCPU: the CPU limit ended it, not the wall clock (that would end the session)
    assert run(env, shell, "echo alive")["output"] == "alive\n"  # only the command died


def test_memory_is_limited(jailed) -> None:
    env, shell = jailed
    out = run(env, shell, "python3 -c 'x = bytearray(400 * 1024 * 1024)' 2>&1; echo rc=$?")["output"]
    assert "MemoryError" in out and "rc=1" in out


def test_output_is_capped_and_the_session_goes_on(jailed) -> None:
    env, shell = jailed
    out = run(env, shell, "head -c 100000 /dev/zero | tr '\\0' y")["output"]
    assert out.startswith("y" * 1000) and out.endswith("[output truncated: 99000 more bytes]")
    assert run(env, shell, "echo next")["output"] == "next\n"


def test_wall_clock_ends_the_session() -> None:
    env = SandboxEnvironment(SandboxLimits(timeout_s=0.5))
    shell = env.open_live(TASK)
    try:
        with pytest.raises(ToolError) as err:
            run(env, shell, "sleep 30")
        assert err.value.code == "timeout"
        assert shell.process.poll() is not None
    finally:
        env.close_live(shell)


def test_a_jail_that_cannot_drop_privileges_opens_no_shell() -> None:
    # A uid range that names only an existing account (nobody's) leaves no uid for a session.
    with pytest.raises(ToolError) as err:
        SandboxEnvironment(SandboxLimits(uid_base=65534, uids=1)).open_live(TASK)
    assert err.value.code == "sandbox_unavailable" and "in use" in err.value.message


# -- one session against another, the host and the server ------------------------------------


@pytest.fixture
def pair() -> Iterator[tuple[SandboxEnvironment, LiveShell, LiveShell]]:
    """Two sessions open at once, as two rollouts of one run: the attacker and its victim."""
    env = SandboxEnvironment(SandboxLimits(max_processes=16, disk_mb=8, timeout_s=30))
    attacker = env.open_live(TASK)
    victim = env.open_live(TASK)
    yield env, attacker, victim
    env.close_live(attacker)
    env.close_live(victim)


def attack(env: SandboxEnvironment, shell: LiveShell, command: str) -> str:
    """The attacker's command; its own session may die of it, which is its own loss."""
    try:
        return run(env, shell, command)["output"]
    except ToolError as exc:
        assert exc.code == "session_lost", exc
        return ""


def host_processes_with(token: str) -> list[int]:
    """Pids, as the host sees them, of processes whose command line holds `token`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass  # exited while we looked
    return found


def host_processes_of(uid: int) -> list[int]:
    """Pids, as the host sees them, of processes whose real uid is `uid`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                if any(line.split()[1:2] == [str(uid)] for line in f if line.startswith("Uid:")):
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_each_session_has_its_own_uid_and_no_way_to_gain_privileges(pair) -> None:
    """Attack: a session acting as another (same uid: its files, its signals, its process count),
    or running a setuid binary to become root."""
    env, attacker, victim = pair
    ids = [run(env, s, "id -u; id -g; grep NoNewPrivs /proc/self/status")["output"].split() for s in (attacker, victim)]
    assert ids[0][0] != ids[1][0] and "0" not in (ids[0][0], ids[1][0]), ids
    assert all(i[0] == i[1] and i[-1] == "1" for i in ids), ids


def test_kill_all_from_one_session_leaves_another_sessions_shell_alive(pair) -> None:
    """Attack: `kill -9 -1` in one session, which as a shared user killed every other session's shell."""
    env, attacker, victim = pair
    job = run(env, victim, "sleep 60 & echo $!")["output"].strip()
    attack(env, attacker, "kill -9 -1")
    assert run(env, victim, f"kill -0 {job} && echo alive")["output"] == "alive\n"


def test_tmp_var_tmp_and_dev_shm_are_private_to_each_session(pair) -> None:
    """Attack: a file planted in a shared /tmp, /var/tmp or /dev/shm for a later or concurrent session to
    read or trip over (and the reverse: reading what another session left there)."""
    env, attacker, victim = pair
    planted = attack(env, attacker, "for d in /tmp /var/tmp /dev/shm; do echo x > $d/planted-rb && echo ok; done")
    assert planted.split() == ["ok", "ok", "ok"]
    seen = run(env, victim, "ls -A /tmp /var/tmp /dev/shm; cat /tmp/planted-rb 2>/dev/null || echo unread")["output"]
    assert "planted" not in seen and seen.endswith("unread\n"), seen


def test_a_session_sees_and_reaches_only_its_own_processes(pair) -> None:
    """Attack: `ps` or /proc to find another session's processes (and from there its files, environment
    or a pid to signal); also the server's and the host's."""
    env, attacker, victim = pair
    run(env, victim, "sleep 4242 &")
    seen = attack(env, attacker, "ps -eo pid,args; cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
    assert "4242" not in seen and "postgres" not in seen and "pytest" not in seen, seen
    pids = attack(env, attacker, "ls /proc | grep -c '^[0-9]'").strip()
    assert int(pids) <= 5, pids  # init, the shell, the pipeline
    assert "sleep 4242" in run(env, victim, "ps -eo args | grep -v grep | grep 'sleep 4242'")["output"]


def test_a_session_sees_no_host_files_and_can_write_none() -> None:
    """Attack: reading the host's files (a world-readable file, the server's configuration and code,
    /run and its sockets) or filling the disk the host and PostgreSQL use."""
    folder = tempfile.mkdtemp()
    os.chmod(folder, 0o755)
    secret = os.path.join(folder, "host-secret")
    with open(secret, "w") as f:
        f.write("host secret\n")
    os.chmod(secret, 0o644)
    env = SandboxEnvironment(SandboxLimits(timeout_s=30))
    shell = env.open_live(TASK)
    try:
        out = run(env, shell, f"cat {secret} {__file__} 2>&1; ls /; ls -d /run /var/lib 2>&1")["output"]
        assert "host secret" not in out and "def test_" not in out, out
        assert out.split("\n")[2:13] == ["bin", "dev", "etc", "home", "lib", "lib64", "proc", "sbin", "tmp", "usr", "var"]
        writes = run(env, shell, "for p in /x /usr/x /etc/x /var/x /proc/x /dev/x; do touch $p 2>/dev/null && echo $p; done")
        assert writes["output"] == "", writes
    finally:
        env.close_live(shell)
        os.unlink(secret)
        os.rmdir(folder)


def test_a_fork_bomb_in_one_session_does_not_stop_another_from_forking(pair) -> None:
    """Attack: use up the process limit (per uid; one uid for all sessions starved every other
    session's shell, which died on "Cannot fork")."""
    env, attacker, victim = pair
    # The loop's shell dies at the first fork refused, leaving the attacker's uid one process short of its limit.
    attack(env, attacker, "sh -c 'i=0; while [ $i -lt 40 ]; do sleep 60 & i=$((i + 1)); done' 2>/dev/null")
    assert len(host_processes_of(attacker.uid)) >= 15  # its shell and 14 sleeps: max_processes is 16
    assert run(env, victim, "sh -c '/bin/echo forked; /bin/echo twice'")["output"] == "forked\ntwice\n"


def test_disk_quota_covers_all_a_session_writes_and_only_that_session() -> None:
    """Attack: fill the disk (the old file limit was per file: many files filled the host's disk).
    The quota is one total for the working dir, /tmp, /var/tmp and /dev/shm together."""
    env = SandboxEnvironment(SandboxLimits(disk_mb=8, file_mb=64, timeout_s=30))
    attacker, victim = env.open_live(TASK), env.open_live(TASK)
    try:
        write = "head -c 3000000 /dev/zero 2>&1 >{}/fill; echo rc=$?"
        out = [attack(env, attacker, write.format(d)) for d in ("~", "/tmp", "/dev/shm")]
        assert "rc=0" in out[0] and "rc=0" in out[1] and "No space left" in out[2] and "rc=1" in out[2], out
        assert "rc=0" in run(env, victim, write.format("/tmp"))["output"]
        assert "rc=0" in run(env, victim, write.format("/var/tmp"))["output"]
    finally:
        env.close_live(attacker)
        env.close_live(victim)


def test_every_process_of_a_session_ends_when_it_closes() -> None:
    """Attack: outlive the session with a `setsid` loop (a new session and process group) and a loop
    that ignores SIGTERM and SIGHUP, to tamper with later sessions or the host."""
    env = SandboxEnvironment(SandboxLimits(timeout_s=30))
    shell = env.open_live(TASK)
    tokens = ["rb-setsid-" + os.urandom(4).hex(), "rb-trap-" + os.urandom(4).hex()]
    run(env, shell, f"setsid sh -c 'while :; do sleep 1; done' {tokens[0]} & "
                    f"sh -c 'trap \"\" TERM HUP INT; while :; do sleep 1; done' {tokens[1]} &")
    time.sleep(0.3)
    assert all(host_processes_with(t) for t in tokens)
    closed = time.monotonic()
    env.close_live(shell)
    while any(host_processes_with(t) for t in tokens) and time.monotonic() - closed < 2.0:
        time.sleep(0.05)
    assert not any(host_processes_with(t) for t in tokens)


def test_a_command_longer_than_the_limit_is_a_tool_error_and_the_session_goes_on(jailed) -> None:
    """Attack: a 900 KB command, which as one argv string of the syntax check failed with E2BIG and
    came back as a server error with a traceback. Commands up to the limit go through stdin."""
    env, shell = jailed
    with pytest.raises(ToolError) as err:
        run(env, shell, "echo " + "x" * 900_000)
    assert err.value.code == "command_too_long"
    assert run(env, shell, "printf %s " + "y" * 60_000 + " | wc -c")["output"].strip() == "60000"
    assert run(env, shell, "if then fi")["exit_code"] == 2  # a syntax error is the command's outcome
    assert run(env, shell, "echo next")["output"] == "next\n"


def test_a_lone_surrogate_in_a_command_is_bad_arguments_and_the_session_goes_on(jailed) -> None:
    """Bad input tried: `"\\ud800"` written as a JSON escape in a command's arguments. It reached the
    shell's stdin and raised UnicodeEncodeError: a Traceback in the resources server and a 500 that
    failed the rollout. Now it is refused as the command's arguments, naming where."""
    env, shell = jailed
    for command in ("echo \ud800", "printf %s \udfff-tail"):
        with pytest.raises(ToolError) as err:
            run(env, shell, command)
        assert err.value.code == "bad_arguments" and "lone surrogate" in err.value.message
    assert run(env, shell, "echo next \u00e9\U0001f600")["output"] == "next \u00e9\U0001f600\n"


@pytest.mark.parametrize("shell_path", ["/bin/false", "/no/such/shell"])
def test_a_shell_that_does_not_start_is_a_start_failure_not_a_session(monkeypatch, shell_path: str) -> None:
    """Attack surface: the jail said ready before exec, so a shell that never ran was handed out as a
    session and its first command scored as the model's failure."""
    monkeypatch.setattr(sandbox_module, "SHELL", shell_path)
    with pytest.raises(ToolError) as err:
        SandboxEnvironment(SandboxLimits()).open_live(TASK)
    assert err.value.code == "sandbox_unavailable" and "could not start" in err.value.message


def test_a_shell_left_idle_is_ended() -> None:
    """Attack: a rollout that fails (or whose caller goes away) without closing its session kept its
    shell, and whatever it left running, for as long as the server ran."""
    env = SandboxEnvironment(SandboxLimits(idle_s=1.0))
    shell = env.open_live(TASK)
    run(env, shell, "sleep 600 &")
    shell.ended.wait(5.0)
    assert shell.process.poll() is not None
    with pytest.raises(ToolError) as err:
        run(env, shell, "echo late")
    assert err.value.code == "session_lost"


# -- what one session may hold of the machine: memory, processes, CPU, keys, runtime state ------

MB = 1024 * 1024


@pytest.fixture
def small() -> Iterator[tuple[SandboxEnvironment, LiveShell]]:
    """A session bounded to 128 MB of memory and 16 MB of disk, the attacks below aim for 256 MB or more."""
    env = SandboxEnvironment(SandboxLimits(disk_mb=16, memory_mb=128, timeout_s=60))
    shell = env.open_live(TASK)
    yield env, shell
    env.close_live(shell)


def test_a_session_cannot_mount_a_tmpfs_of_its_own_in_a_user_namespace(small) -> None:
    """Attack: `unshare -Urm` makes the session root of a new user namespace, where it mounts a tmpfs
    past disk_mb and fills it (1 GiB held in RAM by a 16 MB session)."""
    env, shell = small
    out = attack(env, shell, "unshare -Urm sh -c 'mount -t tmpfs t /tmp && head -c 300000000 /dev/zero > /tmp/f "
                             "&& echo filled' 2>&1; echo rc=$?")
    assert "filled" not in out and "rc=0" not in out, out
    out = attack(env, shell, "unshare -U true 2>&1; echo rc=$?")
    assert "rc=1" in out and "Operation not permitted" in out, out


# Four 64 MB segments, each filled and detached, never removed: no process holds them once it exits.
SHM_ATTACK = r"""python3 -c '
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
for n in range(4):
    seg = libc.shmget(0, 64 << 20, 0o1600)
    at = libc.shmat(seg, None, 0)
    ctypes.memset(at, 1, 64 << 20)
    libc.shmdt(ctypes.c_void_p(at))
    print("held", n + 1, flush=True)
' 2>&1; awk 'NR > 1 { s += $15 } END { print "rss", s }' /proc/sysvipc/shm"""


def test_system_v_shared_memory_counts_against_the_session_and_dies_with_it(small) -> None:
    """Attack: 16 x 64 MB System V segments, then every process exits: 1 GiB held by no process,
    outside every per-process limit, until the session closes."""
    env, shell = small
    out = attack(env, shell, SHM_ATTACK)
    held = [int(line.split()[1]) for line in out.splitlines() if line.startswith("rss ")]
    assert "held 4" not in out and held and held[0] <= 128 * MB, out
    env.close_live(shell)
    again = env.open_live(TASK)
    try:
        assert run(env, again, "wc -l < /proc/sysvipc/shm")["output"].strip() == "1"  # the header: no segment
    finally:
        env.close_live(again)


def test_a_memfd_counts_against_the_session(small) -> None:
    """Attack: memfd_create + posix_fallocate holds 1 GiB outside the session's tmpfs and its address
    space (the pages are never mapped), in memfds each under file_mb."""
    env, shell = small
    out = attack(env, shell, "python3 -c 'import os\nfor n in range(4):\n    os.posix_fallocate(os.memfd_create(\"x\"), 0, 60 << 20)"
                             "\nprint(\"held\")' 2>&1; echo rc=$?")
    assert "held" not in out, out


def test_a_sessions_memory_all_together_stays_within_memory_mb(small) -> None:
    """Attack: every way at once (files in the tmpfs, System V segments, a memfd, the heap), each
    under its own limit, together past memory_mb; the kernel's count of the session's peak is the check."""
    env, shell = small
    attack(env, shell, "head -c 15000000 /dev/zero > ~/fill; " + SHM_ATTACK)
    attack(env, shell, "python3 -c 'import os, time\nfor n in range(2):\n    os.posix_fallocate(os.memfd_create(\"x\"), 0, 60 << 20)"
                       "\ntime.sleep(30)' >/dev/null 2>&1 &")
    attack(env, shell, "python3 -c 'x = bytearray(100 << 20)' 2>&1")
    with open(os.path.join(shell.cgroups[0], "memory.max_usage_in_bytes")) as f:
        peak = int(f.read())
    # The kernel charges memory to a group in batches of pages (MEMCG_CHARGE_BATCH, 64 pages): its
    # peak may read a page or so past the limit (128.004 MiB was seen once), never the attack's 256 MB.
    assert peak <= 128 * MB + 64 * 4096, peak / MB


def test_a_session_uses_at_most_its_share_of_the_cpus() -> None:
    """Attack: 60 `setsid` busy loops, each a session of its own and so out of the shell's autogroup,
    made a host task 23-38 times slower."""
    env = SandboxEnvironment(SandboxLimits(cpus=0.25, cpu_s=60, timeout_s=30))
    shell = env.open_live(TASK)
    try:
        run(env, shell, "i=0; while [ $i -lt 8 ]; do setsid sh -c 'while :; do :; done' & i=$((i + 1)); done")

        def cpu_s() -> float:
            ticks = 0
            for pid in host_processes_of(shell.uid):
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    ticks += int(fields[11]) + int(fields[12])
                except OSError:
                    pass
            return ticks / os.sysconf("SC_CLK_TCK")

        time.sleep(0.5)
        before, start = cpu_s(), time.monotonic()
        time.sleep(2.0)
        used = (cpu_s() - before) / (time.monotonic() - start)
        assert used <= 0.4, used  # 0.25 of a core, and some rounding
    finally:
        env.close_live(shell)


def test_a_machine_that_cannot_bound_a_session_refuses_it(tmp_path) -> None:
    """Attack surface: a kernel or host with no writable memory cgroup ran sessions with no memory
    bound at all; now the sandbox refuses to start and says which bound it cannot set."""
    with pytest.raises(ToolError) as err:
        SandboxEnvironment(SandboxLimits(cgroup_root=str(tmp_path))).open_live(TASK)
    assert err.value.code == "sandbox_unsupported" and "memory cgroup" in err.value.message, err.value
    assert not host_processes_with(str(tmp_path))


def test_a_group_left_with_a_smaller_memory_bound_takes_a_larger_one(tmp_path) -> None:
    """Input: a session's group left by a server that died (SIGKILLed, it never removed it) with
    memory_mb 64, then a session of the same uid with memory_mb 256, as a harness's jail asks for
    more than the sandbox's tool sessions. The kernel refused the larger memory bound while the
    group's memory + swap bound was smaller (EINVAL), and the session did not start."""
    uid, lock = claim_uid(str(tmp_path), 250_000, 1)
    try:
        groups = make_cgroups("/sys/fs/cgroup", uid, 64, 8, 1.0)  # left behind: never removed
        groups = make_cgroups("/sys/fs/cgroup", uid, 256, 8, 1.0)
        memory = next(g for g in groups if "/memory/" in g)
        with open(os.path.join(memory, "memory.limit_in_bytes")) as f:
            assert int(f.read()) == 256 * 1024 * 1024
        remove_cgroups(groups)
    finally:
        os.close(lock)


KEYS = r"""python3 -c '
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
ADD_KEY, REQUEST_KEY, KEYCTL, KEY_SPEC_USER_KEYRING, KEYCTL_SEARCH = 248, 249, 250, -4, 10
if sys.argv[1] == "plant":
    print("planted", libc.syscall(ADD_KEY, b"user", b"rb-secret", b"the first session", 17, KEY_SPEC_USER_KEYRING) > 0)
else:
    found = libc.syscall(REQUEST_KEY, b"user", b"rb-secret", None, 0)
    searched = libc.syscall(KEYCTL, KEYCTL_SEARCH, KEY_SPEC_USER_KEYRING, b"user", b"rb-secret", 0)
    print("found", found > 0 or searched > 0)
' """


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the attack's system call numbers are x86_64's")
def test_a_key_left_by_one_session_is_not_found_by_the_next_of_the_same_uid() -> None:
    """Attack: `add_key(user, @u)` in one session, `request_key` in the next one given the same uid:
    keyrings are the uid's, and outlive its processes, so the second read the first one's secret."""
    env = SandboxEnvironment(SandboxLimits(uid_base=201_500, uids=1, timeout_s=30))
    first = env.open_live(TASK)
    try:
        assert run(env, first, KEYS + "plant")["output"] == "planted True\n"
    finally:
        env.close_live(first)
    second = env.open_live(TASK)
    try:
        assert second.uid == first.uid
        assert run(env, second, KEYS + "find")["output"] == "found False\n"
    finally:
        env.close_live(second)


def test_a_local_user_cannot_disable_the_sandbox_by_making_its_state_folder_first(tmp_path) -> None:
    """Attack: a non-root user made `$TMPDIR/rollbook-sandbox-uids` before the server did, and every
    session was refused (`sandbox_unavailable`). The state lives under /run/rollbook, root's alone."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o1777)
    os.chmod(tmp, 0o1777)
    taken = tmp / "rollbook-sandbox-uids"
    taken.mkdir()
    os.chown(taken, 65534, 65534)  # made by nobody, as any local user could
    script = ("from participants.environments.sandbox import SandboxEnvironment, SandboxLimits\n"
              "from participants.environments.tasks import make_task\n"
              "env = SandboxEnvironment(SandboxLimits(timeout_s=30))\n"
              "shell = env.open_live(make_task('sandbox', 0))\n"
              "print(env.call_live(shell, 'run', {'command': 'echo opened'}).output['output'], end='')\n"
              "env.close_live(shell)\n")
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "TMPDIR": str(tmp)}, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout == "opened\n", done.stderr[-2000:]


@pytest.mark.parametrize("owner, mode", [(65534, 0o700), (0, 0o777), (0, 0o770)])
def test_a_state_folder_another_user_owns_or_can_write_refuses_the_session(tmp_path, owner: int, mode: int) -> None:
    """Attack surface: a state folder made first by someone else, or writable by them, would let them
    take or block the uids; the sandbox refuses it and says why."""
    state = tmp_path / "state"
    state.mkdir()
    os.chown(state, owner, owner)
    os.chmod(state, mode)
    with pytest.raises(ToolError) as err:
        SandboxEnvironment(SandboxLimits(state_dir=str(state))).open_live(TASK)
    assert err.value.code == "sandbox_unavailable" and "must be a folder owned by root" in err.value.message, err.value
