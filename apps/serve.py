"""`rollbook serve KIND --config FILE [--port P] [--host H]`: one server process on the shared database.

Any number of instances of a kind may serve against one database: each records itself in the log
(adapters.membership) and owns the work it accepts (engine/ownership.py)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable

from aiohttp import web

from adapters import database
from adapters.http_client import set_default_timeouts
from adapters.http_server import AFTER_BIND, run_bounded
from adapters.membership import Lease, MembershipReader, discard_unsent, paused_checkpoint_open
from adapters.postgres import PostgresEventStore
from adapters.telemetry import configure_tracing
from apps.config import Config, Kind
from apps.processes import free_port, instance_id
from engine.membership import WorkerOf
from participants.agent.external import Driver, ExternalAgents, gym_drivers
from participants.agent.harness import HarnessDriver
from participants.base.app import PARTICIPANT
from participants.base.instances import Joining
from participants.base.observability import TELEMETRY
from participants.base.routing import Peers
from participants.environments.nemo_gym_relay import register, start_all, stop_all


def build(kind: Kind, config: Config, dsn: str, worker: WorkerOf | None = None) -> web.Application:
    """One server process: an instance of its own, or (`worker`) one of a front's workers."""
    instance = f"{worker.parent}-w{worker.worker}" if worker is not None else instance_id(kind)
    # Every kind knows the configured NeMo Gym servers as environments; only the resources server,
    # which relays to them, starts those that no operator runs (on a free port unless one is given).
    register(config.gym_servers(free_port if kind == "resources" else None))
    if kind == "resources":  # started now: one that cannot import says so here, not at a rollout's first call
        start_all(lambda line: print(f"rollbook serve resources: {line}", file=sys.stderr, flush=True))
    store = PostgresEventStore.connect(dsn, writer=instance, pool=config.database_pool(dsn))
    stoppers = [stop_all]  # the NeMo Gym servers and agents this process started
    # Every client this server builds to call its peers waits on them within these bounds.
    set_default_timeouts(config.limits.peer_timeouts())
    if kind == "model":
        from adapters.token_store import FilesystemTokenStore, PostgresTokenStore
        from participants.model.app import build_model_app
        from participants.model.backends import BackendSettings, make_backend

        s = config.servers["model"]
        backend = make_backend(s.backend, BackendSettings(url=s.url, model=s.model, api_key=s.api_key,
                                                          policy_version=s.policy_version, latency_s=s.latency_s,
                                                          token_latency_s=s.token_latency_s,
                                                          connect_s=config.limits.connect_s,
                                                          silence_s=config.limits.reply_s))
        tokens = FilesystemTokenStore(s.token_store_root or "tokens") if s.token_store == "filesystem" else PostgresTokenStore(store)
        app = build_model_app(store, backend, tokens, config.credentials, instance=instance, progress_s=s.progress_s)
    elif kind == "resources":
        from participants.resources.app import build_resources_app

        sandbox = config.sandbox.limits() if config.sandbox is not None else None
        app = build_resources_app(store, config.credentials, instance=instance, sandbox=sandbox)
    elif kind == "agent":
        from participants.agent.app import build_agent_app

        # The agent calls these three and the model instances the log records, and no other address:
        # none comes from a request. The environment
        # server is where NeMo Gym rows received on the agent's POST /run run as episodes.
        env = config.servers.get("environment")
        timeouts = config.limits.peer_timeouts()
        drivers: dict[str, Driver] = {**gym_drivers(config.gym_agents(free_port), timeouts),
                                      **{n: HarnessDriver(n, h, timeouts) for n, h in config.harnesses().items()}}
        agents = ExternalAgents(drivers) if drivers else None
        if agents is not None:  # started now, as the resources server starts its NeMo Gym servers
            agents.start_all(lambda line: print(f"rollbook serve agent: {line}", file=sys.stderr, flush=True))
            stoppers.append(agents.stop)
        app = build_agent_app(store, config.credentials, config.url("model"), config.url("resources"), instance=instance,
                              environment_url=env.base_url if env else None, agents=agents)
    else:
        from participants.environment.app import build_environment_app

        app = build_environment_app(store, config.credentials, config.url("agent"), config.url("resources"),
                                    instance=instance, environments=config.environments())

    # Spans only where the config names an OTLP endpoint; /metrics is served either way.
    configure_tracing(app[TELEMETRY], config.telemetry.otlp_endpoint if config.telemetry else None)

    async def close_store(app: web.Application) -> None:
        for stop in stoppers:
            stop()
        await store.close()

    app.on_cleanup.append(close_store)
    _record_instance(app, kind, instance, config, store, worker, stoppers)
    return app


# The exit status of a server that lost its lease (EX_TEMPFAIL): started again, it joins as a new instance.
LEASE_LOST_EXIT = 75


def _lease_lost(kind: Kind, instance: str, lease_s: float, stoppers: list[Callable[[], None]]) -> Callable[[float], None]:
    def lapse(silent_s: float) -> None:
        # Cut off from the log, it cannot know its work was not taken over: it does none from here on.
        # What it started (NeMo Gym servers, agents) goes with it; a sandbox's jail ends with its server.
        print(f"rollbook serve {kind}: instance {instance} renewed no lease for {silent_s:.1f} s of its {lease_s:g} s: "
              f"it exits now, before another instance can take its work over; start it again to rejoin",
              file=sys.stderr, flush=True)
        for stop in stoppers:
            with contextlib.suppress(Exception):
                stop()
        discard_unsent()  # nothing it sent into the partition may land after it is gone
        os._exit(LEASE_LOST_EXIT)
    return lapse


def _record_instance(app: web.Application, kind: Kind, instance: str, config: Config, store: PostgresEventStore,
                     worker: WorkerOf | None, stoppers: list[Callable[[], None]]) -> None:
    """The instance joins the deployment once it listens (engine/membership.py), and leaves at shutdown."""
    lease = Lease(store, kind, instance, config.url(kind), workers=config.servers[kind].workers,
                  lease_s=config.limits.instance_lease_s, of=worker,
                  on_lapse=_lease_lost(kind, instance, config.limits.instance_lease_s, stoppers))
    reader = MembershipReader(store)
    participant = app[PARTICIPANT]
    joining = Joining(participant, lease, reader, lambda: paused_checkpoint_open(store))
    # Every caller reaches the live instances and workers of its callee kinds (participants/base/routing.py).
    for peers in vars(participant).values():
        if isinstance(peers, Peers):
            peers.source = lambda k=peers.kind: reader.live_addresses(k)
    participant.address = config.url(kind)
    app.setdefault(AFTER_BIND, []).append(joining.join)

    async def leave(app: web.Application) -> None:
        await joining.leave()

    app.on_shutdown.append(leave)


def with_address(config: Config, kind: Kind, host: str | None, port: int | None) -> Config:
    """The config with this instance's own address: another instance of a kind on another port or host."""
    s = config.servers[kind]
    update = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    return config.model_copy(update={"servers": {**config.servers, kind: s.model_copy(update=update)}})


def serve(kind: Kind, config: Config, config_path: str | None = None, worker: WorkerOf | None = None) -> None:
    """Serve KIND: one process, or (`workers = N`, with the config file to hand the workers) a front
    and N worker processes behind it (apps/workers.py)."""
    dsn = database.prepare_database(config.dsn)
    s = config.servers[kind]
    if worker is None and s.workers > 1 and config_path is not None:
        from apps.workers import serve_front

        serve_front(kind, config, config_path, dsn)
        return
    run_bounded(build(kind, config, dsn, worker), s.bind or s.host, s.port, config.limits.server_limits())


def worker_of(flag: str | None) -> WorkerOf | None:
    """The hidden `--worker-of FRONT,PARENT,INDEX` a front hands each worker it starts."""
    if flag is None:
        return None
    front, parent, index = flag.rsplit(",", 2)
    return WorkerOf(front, parent, int(index))
