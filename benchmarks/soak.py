"""Many more sequences of the control-operation state machine than CI runs, one seed each.

    .venv/bin/python benchmarks/soak.py --seeds 500 [--steps 12] [--machine control|processes|partitions] [--out PATH]

One hypothesis run of --seeds examples, seeded with --first, every invariant checked after every
step and at the end, of one of three machines:
- `control` (the default): testkit/stateful_control.ControlMachine, sequences of dispatch, prepare,
  commit, publish, resume, crash-and-restore, retire, forget against the four servers in process,
  on one throwaway embedded PostgreSQL (about 1 s a sequence);
- `processes`: testkit/stateful_processes.FaultMachine, the same operations plus the real faults
  over two instances of every kind (SIGKILL of every instance of any subset of the four kinds, of
  one instance of one kind, of a coordinator process mid-checkpoint, a PostgreSQL restart, dropped
  connections) on an embedded PostgreSQL of its own (several seconds a sequence);
- `partitions` (root): testkit/stateful_partitions.PartitionMachine, the processes machine with each
  instance set on a host of its own (a network namespace) and PostgreSQL on an address of the
  machine's own, plus a host cut from PostgreSQL or from the other host for a while, then healed; it
  counts the takeovers (work of a lease-stopped instance that another instance went on with).

The last two draw each sequence whole before it runs (testkit/programs.py): real processes do not
replay a sequence exactly, so a violation is printed with its seed, shrunk by hypothesis to a short
sequence only for `control`; for them a traceback in any server's log counts as a violation too.
Prints a table (each operation that took effect, counted over every sequence including shrinking,
and for the process machines the share of sequences in which a commit, a publish, a restore, a
partition and a takeover took effect) and writes JSON; never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, seed, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

from adapters import database  # noqa: E402
from testkit import netns, pg, programs, stateful_control, stateful_partitions, stateful_processes  # noqa: E402
from testkit.log_queries import tracebacks  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=500, help="sequences to run")
    p.add_argument("--first", type=int, default=0, help="the seed of the run")
    p.add_argument("--steps", type=int, default=12, help="steps per sequence at most")
    p.add_argument("--machine", choices=["control", "processes", "partitions"], default="control",
                   help="in-process control operations, real processes and real faults, or those on hosts with partitions")
    p.add_argument("--out", type=Path, default=None, help="default benchmarks/results/soak[-processes].json")
    args = p.parse_args()
    if args.out is None:
        args.out = ROOT / "benchmarks" / "results" / ("soak.json" if args.machine == "control" else f"soak-{args.machine}.json")
    failures: list[dict[str, object]] = []
    started = time.perf_counter()
    world = None
    hosts = None
    if args.machine == "control":
        server = pg.primary_server()
        base: type = stateful_control.ControlMachine
        tally_of_run = stateful_control.TALLY
    elif args.machine == "processes":
        server, restart = pg.restartable_server()
        base, tally_of_run = stateful_processes.FaultMachine, stateful_processes.TALLY
    else:
        hosts = netns.Hosts()
        dsn, restart, stop_db = stateful_partitions.tcp_database(hosts, "rollbook_soak")
        base, tally_of_run = stateful_partitions.PartitionMachine, stateful_processes.TALLY
    try:
        if args.machine == "control":
            base.dsn = server.new_database()
        else:
            work = Path(tempfile.mkdtemp(prefix="rbsoak-"))
            print(f"server logs: {work}", file=sys.stderr)
            if hosts is not None:
                world = stateful_partitions.start_hosted_world(hosts, dsn, restart, work)
            else:
                world = stateful_processes.start_world(database.scratch_database(server.admin_dsn, "rollbook_soak"),
                                                       restart, work)
            base.world = world
        every = 25 if args.machine == "control" else 5  # sequences between two progress lines
        # One hypothesis run of --seeds examples, seeded by --first: hypothesis varies the sequences
        # across examples (its first one is always the simplest) and shrinks a failing one.
        def progress(tally: dict[str, int]) -> None:
            # hypothesis may run past max_examples (a repeated sequence does not count), so every few
            # sequences the tally so far is printed and saved: a run cut short still leaves its figures
            if tally.get("sequences_checked", 0) % every == 0:
                print(f"{tally['sequences_checked']} sequences checked, 0 violations, {time.perf_counter() - started:.0f} s: "
                      f"{json.dumps(dict(sorted(tally.items())))}", file=sys.stderr, flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({"partial": True, "machine": args.machine, "seeds": args.seeds,
                                                "first": args.first, "operations": dict(sorted(tally.items()))},
                                               indent=2) + "\n")

        machine = seed(args.first)(type("SoakMachine", (base,), {"progress": staticmethod(progress)}))
        try:
            if args.machine != "control":  # drawn whole before they run: real processes do not replay
                programs.run_drawn(machine, examples=args.seeds, most=args.steps, chosen=args.first)
            else:
                run_state_machine_as_test(machine, settings=settings(
                    max_examples=args.seeds, stateful_step_count=args.steps, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True))
        except Exception as exc:  # a violation, already shrunk: report it with the seed that found it
            print(f"seed {args.first}: VIOLATION {type(exc).__name__}: {str(exc)[:400]}\n"
                  f"reproduce: benchmarks/soak.py --machine {args.machine} --first {args.first} --seeds {args.seeds} "
                  f"--steps {args.steps}", file=sys.stderr)
            traceback.print_exc(limit=3)
            failures.append({"seed": args.first, "error": f"{type(exc).__name__}: {str(exc)[:1000]}"})
    finally:
        if world is not None:
            world.stop()
            # No server may print a traceback for any of these faults.
            for found in tracebacks(world.log_dir):
                print(f"TRACEBACK in a server log: {found[:400]}", file=sys.stderr)
                failures.append({"seed": args.first, "error": f"server traceback: {found[:1000]}"})
        if hosts is not None:
            stop_db()
            hosts.close()
        else:
            server.close()
    elapsed = time.perf_counter() - started
    result = {"machine": args.machine, "seeds": args.seeds, "first": args.first, "steps": args.steps, "violations": len(failures),
              "failures": failures, "seconds": round(elapsed, 1), "operations": dict(sorted(tally_of_run.items()))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'machine':<36}{args.machine:>10}")
    print(f"{'sequences asked':<36}{args.seeds:>10}")
    print(f"{'violations':<36}{len(failures):>10}")
    for op, n in sorted(tally_of_run.items()):
        print(f"{op:<36}{n:>10}")
    print(f"{'seconds':<36}{elapsed:>10.1f}")
    # The operations the fault machine must line up (a cut committed, published and restored): in how
    # many of the checked sequences each took effect at least once.
    checked = tally_of_run.get("sequences_checked", 0)
    for op in ("commit", "publish", "online", "crash_and_restore", "kill_instance", "kill_worker", "kill_servers",
               "restart_postgres", "partition_db", "partition_db_outlived_a_lease", "partition_hosts", "takeovers"):
        n = tally_of_run.get(f"sequences_with_{op}", 0)
        if checked and (n or args.machine != "control"):
            print(f"{'sequences with ' + op:<36}{n:>10}  {n / checked:.0%} of {checked}")
    print(json.dumps({k: v for k, v in result.items() if k != "failures"}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
