"""Many more sequences of the control-operation state machine than CI runs, one seed each.

    .venv/bin/python benchmarks/soak.py --seeds 500 [--steps 12] [--out PATH]

One hypothesis run of tests/stateful_control.ControlMachine with --seeds examples (sequences of
dispatch, prepare, commit, publish, resume, crash-and-restore, retire, forget against the four
servers in process, on one throwaway embedded PostgreSQL), seeded with --first, every invariant
checked after every step and at the end. A violation is shrunk by hypothesis to a short sequence
and printed with its seed and a reproduction blob. Prints a table (each operation that took
effect, counted over every sequence including shrinking) and writes JSON; never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, seed, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

from tests import pg  # noqa: E402
from tests.stateful_control import TALLY, ControlMachine  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=500, help="sequences to run")
    p.add_argument("--first", type=int, default=0, help="the seed of the run")
    p.add_argument("--steps", type=int, default=12, help="steps per sequence at most")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "soak.json")
    args = p.parse_args()
    server = pg.primary_server()
    failures: list[dict[str, object]] = []
    started = time.perf_counter()
    try:
        ControlMachine.dsn = server.new_database()
        # One hypothesis run of --seeds examples, seeded by --first: hypothesis varies the sequences
        # across examples (its first one is always the simplest) and shrinks a failing one.
        def progress(tally: dict[str, int]) -> None:
            if tally.get("sequences_checked", 0) % 25 == 0:
                print(f"{tally['sequences_checked']} sequences checked, {time.perf_counter() - started:.0f} s: "
                      f"{json.dumps(dict(sorted(tally.items())))}", file=sys.stderr, flush=True)

        machine = seed(args.first)(type("SoakMachine", (ControlMachine,), {"progress": staticmethod(progress)}))
        try:
            run_state_machine_as_test(machine, settings=settings(
                max_examples=args.seeds, stateful_step_count=args.steps, deadline=None, database=None,
                suppress_health_check=list(HealthCheck), print_blob=True))
        except Exception as exc:  # a violation, already shrunk: report it with the seed that found it
            print(f"seed {args.first}: VIOLATION {type(exc).__name__}: {str(exc)[:400]}", file=sys.stderr)
            traceback.print_exc(limit=3)
            failures.append({"seed": args.first, "error": f"{type(exc).__name__}: {str(exc)[:1000]}"})
    finally:
        server.close()
    elapsed = time.perf_counter() - started
    result = {"seeds": args.seeds, "first": args.first, "steps": args.steps, "violations": len(failures),
              "failures": failures, "seconds": round(elapsed, 1), "operations": dict(sorted(TALLY.items()))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'sequences asked':<28}{args.seeds:>10}")
    print(f"{'violations':<28}{len(failures):>10}")
    for op, n in sorted(TALLY.items()):
        print(f"{op:<28}{n:>10}")
    print(f"{'seconds':<28}{elapsed:>10.1f}")
    print(json.dumps({k: v for k, v in result.items() if k != "failures"}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
