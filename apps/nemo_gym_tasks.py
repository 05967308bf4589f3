"""`rollbook tasks from-gym IN.jsonl [--env NAME]`: NeMo Gym rows to rollbook's task file (`rollbook run`'s `tasks`).

With `--env`, each row is a data row of a configured NeMo Gym resources server (`[nemo_gym.<NAME>]`,
e.g. its `data/example.jsonl`): the task of environment NAME whose `params.row` is the row itself, its
id the row's `id` (else its index), its prompt the row's system and user messages.

A materialized row (`task_id: {taskset, task_id}` plus `task_input`) becomes the task its
`task_input` names (participants.base.nemo_gym_rows.GymTaskInput); a flat row (`responses_create_params`, ...)
becomes the task the per-row rule picks (participants.base.nemo_gym_rows.flat_row_task). One JSON task per
output line, in input order. A row no rule accepts stops the conversion with its line number and
nothing is written.

With `--repeats N` (NeMo Gym's `num_repeats`), each data row becomes N tasks, tagged as NeMo Gym's
collector tags its repeats: `_ng_task_index` (the row's index) and `_ng_rollout_index` (0..N-1). A
server that compares a prompt's rollouts with each other (genrm_compare's cohort of
`num_rollouts_per_prompt`) reads them at verify, and a run's `concurrency` must admit a whole cohort.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from engine.errors import InvalidRequest, RollbookError
from participants.base.nemo_gym_rows import GymTaskInput, TaskId, flat_row_task, task_for
from participants.environments import Task
from participants.environments.nemo_gym_relay import task_from_row as gym_task


def task_from_row(row: Any) -> Task:
    if not isinstance(row, dict):
        raise InvalidRequest("a row must be a JSON object")
    if isinstance(row.get("task_id"), dict) and "task_input" in row:
        return task_for(TaskId.model_validate(row["task_id"]), GymTaskInput.model_validate(row["task_input"]))
    if "responses_create_params" in row:
        return task_for(*flat_row_task(row))
    raise InvalidRequest("neither a materialized row (task_id and task_input) nor a flat row (responses_create_params)")


TASK_INDEX, ROLLOUT_INDEX = "_ng_task_index", "_ng_rollout_index"  # NeMo Gym's names (nemo_gym.global_config)


def convert(lines: list[str], source: str, env: str | None = None, repeats: int = 1) -> list[Task]:
    """Every row's task; with `env` (a configured NeMo Gym server, `[nemo_gym.<env>]`), each data row as
    it is (its own tools, ground truth and verify fields) becomes a task of that environment, `repeats`
    tasks of it past one."""
    if repeats < 1:
        raise InvalidRequest(f"repeats must be at least 1, not {repeats}")
    if repeats != 1 and env is None:
        raise InvalidRequest("repeats take an env: a repeat is tagged as a NeMo Gym server's data row")
    tasks = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if env is None:
                tasks.append(task_from_row(row))
            elif not isinstance(row, dict):
                raise InvalidRequest("a row must be a JSON object")
            elif repeats == 1:
                tasks.append(gym_task(env, row, n - 1))
            else:
                index = len(tasks) // repeats
                tasks += [repeated(gym_task(env, {**row, TASK_INDEX: index, ROLLOUT_INDEX: r}, n - 1), r)
                          for r in range(repeats)]
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"{source}:{n}: not JSON ({exc})", line=n) from exc
        except ValidationError as exc:
            problem = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:3])
            raise InvalidRequest(f"{source}:{n}: {problem}", line=n) from exc
        except RollbookError as exc:
            raise InvalidRequest(f"{source}:{n}: {exc.detail}", line=n) from exc
    return tasks


def repeated(task: Task, rollout: int) -> Task:
    """A repeat of a row's task: an id of its own, the rollout index after the row's."""
    return replace(task, task_id=f"{task.task_id}.{rollout}")


def _from_gym(args: argparse.Namespace) -> int:
    tasks = convert(Path(args.input).read_text().splitlines(), args.input, args.env, args.repeats)
    text = "".join(json.dumps(t.to_json(), sort_keys=True) + "\n" for t in tasks)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def add_parser(sub: Any) -> None:
    tasks = sub.add_parser("tasks", help="task files: convert NeMo Gym rows")
    tsub = tasks.add_subparsers(dest="tasks_command", required=True)
    fg = tsub.add_parser("from-gym", help="NeMo Gym rows (materialized or flat) to rollbook's task file")
    fg.add_argument("input", help="a NeMo Gym JSONL file")
    fg.add_argument("-o", "--output", help="write here instead of standard output")
    fg.add_argument("--env", help="a NeMo Gym resources server of the config ([nemo_gym.<env>]): each data row "
                                  "(its data/example.jsonl) becomes a task of that environment")
    fg.add_argument("--repeats", type=int, default=1,
                    help="with --env: each row this many times, tagged _ng_task_index and _ng_rollout_index as NeMo "
                         "Gym's collector tags its num_repeats")
    fg.set_defaults(func=_from_gym)
