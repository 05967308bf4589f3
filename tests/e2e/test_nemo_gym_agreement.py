"""`rollbook export` and NeMo Gym's `TokenSource` see the same tokens, on a run crashed mid-generation.

A run is stopped while its calls are mid-generation (checkpoint-and-stop cuts them), every server is
SIGKILLed, fresh processes restore and finish it. Then, for every finished rollout, the export's
record and the snapshot a trainer freezes through NeMo Gym's `TokenSource` (rollbook's transport,
adapters/nemo_gym_tokens.py, under Gym's key `R-aN` for attempt N) must agree call for call and
token for token: ids, loss mask, logprobs, policy version, and Gym's lineage digest.
"""

from __future__ import annotations

import asyncio
import json
import signal
import tempfile
from pathlib import Path

import psycopg

from apps import config as cfg
from apps.processes import ServerProcesses, free_port
from participants.environments.tasks import make_tasks
from testkit import nemo_gym_env
from tests.e2e.test_export import export
from tests.e2e.test_run_command import Run, wait_for_a_generation_under_way

nemo_gym_env.ensure()

from nemo_gym.token_id_capture.records import compute_digest  # noqa: E402

from adapters.nemo_gym_tokens import RollbookTokenCapture  # noqa: E402
from engine.token_capture import capture_key  # noqa: E402


async def freeze_all(dsn: str, keys: list[str]) -> list:
    capture = RollbookTokenCapture(dsn)
    try:
        return [await capture.freeze(k) for k in keys]
    finally:
        await capture.close()


def test_export_and_nemo_gym_token_source_agree_token_for_token_after_a_crash(dsn: str) -> None:
    work = Path(tempfile.mkdtemp(prefix="rbgym-"))
    tasks = make_tasks(4, seed=5, envs=["blackjack", "math", "workplace"])
    (work / "tasks.jsonl").write_text("".join(json.dumps(t.to_json()) + "\n" for t in tasks))
    # Slow tokens (about 2 s a reply) keep each generation in flight well past the stop, so the stop below lands mid-generation.
    servers = {k: cfg.ServerConfig(port=free_port(), token_latency_s=0.2 if k == "model" else 0.0) for k in cfg.KINDS}
    config = cfg.Config(dsn=dsn, control_token="c0ntrol-t0ken", data_token="data-t0ken", servers=servers, run=cfg.RunConfig(
        run_id="gym", tasks=str(work / "tasks.jsonl"), checkpoint_every_s=3600, concurrency=4))
    cfg.write(config, work / "rollbook.toml")
    procs = ServerProcesses(cfg.load(work / "rollbook.toml"), work / "rollbook.toml", work)
    procs.start()
    try:
        crash = Run(work / "rollbook.toml")
        crash.wait_for("finished")  # the others are mid-turn, most of them mid-generation
        wait_for_a_generation_under_way(dsn)
        crash.proc.send_signal(signal.SIGTERM)  # checkpoint and stop: prepare cuts every generation in flight
        seen = crash.wait_for("stopped")
        stopped_at = [e for e in seen if e.get("event") == "checkpoint"]
        # The stop's checkpoint must have gone through: one refused at prepare cuts nothing.
        assert stopped_at and stopped_at[-1]["published"], stopped_at
        assert crash.proc.wait(timeout=30) == 0
        procs.kill()  # SIGKILL every server
        procs.start()
        again = Run(work / "rollbook.toml")
        again.wait_for("done", timeout=120)
        assert again.proc.wait(timeout=30) == 0
    finally:
        procs.stop()
    with psycopg.connect(dsn) as conn:
        cut_mid = conn.execute("SELECT count(*) FROM rollbook.events WHERE kind = 'call_cut' "
                               "AND (data->>'tokens')::int > 0").fetchone()[0]
        # The rerun continues each rollout from the log in its own attempt where it can: what shows
        # the crash was crossed mid-generation is a cut call whose generation was continued.
        continued = conn.execute("SELECT count(*) FROM rollbook.events WHERE kind = 'call_completed' "
                                 "AND data->'continuation'->>'mode' = 'continued'").fetchone()[0]
    records = export(dsn, "gym", work / "gym.jsonl")
    assert len(records) == 4 and continued >= 1 and cut_mid >= 1, (len(records), continued, cut_mid)

    snapshots = asyncio.run(freeze_all(dsn, [capture_key(r["rollout_id"], r["attempt"]) for r in records]))
    turns = 0
    for record, snap in zip(records, snapshots, strict=True):
        assert not snap.incomplete, record["rollout_id"]
        assert [e.model_call_id for e in snap.entries] == [t["call_id"] for t in record["turns"]]
        for turn, entry in zip(record["turns"], snap.entries, strict=True):
            prompt, generated = entry.prompt_token_ids, entry.generation_token_ids
            assert turn["token_ids"] == prompt + generated
            assert turn["loss_mask"] == [0] * len(prompt) + [1] * len(generated)
            assert turn["logprobs"] == [0.0] * len(prompt) + entry.generation_log_probs
            assert turn["policy_version"] == entry.policy_version
            assert entry.digest == compute_digest(turn["token_ids"]) and entry.cum_len == len(turn["token_ids"])
            turns += 1
    print(f"agreement: {len(records)} rollouts, {turns} calls, {continued} continued, "
          f"{cut_mid} cut mid-generation")
