"""The sandbox's jail, one limit at a time, on real processes: off unless configured; when on, an
unprivileged user, no network, CPU time, memory, output size and wall clock each bounded."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from participants.environments import ToolError
from participants.environments.sandbox import LiveShell, SandboxEnvironment, SandboxLimits
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
    assert out[0] == "65534" and out[1] == "65534" and out[-2] != "0"


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
    with pytest.raises(ToolError) as err:
        SandboxEnvironment(SandboxLimits(user="root")).open_live(TASK)
    assert err.value.code == "sandbox_unavailable"
    with pytest.raises(ToolError) as err:
        SandboxEnvironment(SandboxLimits(user="no-such-user-rb")).open_live(TASK)
    assert err.value.code == "sandbox_unavailable"
