"""A NeMo Gym resources server that shows what it was given and fails the ways real ones do.

Run with NeMo Gym's Python, by rollbook's launcher (participants/environments/nemo_gym_launcher.py),
from this folder's parent on sys.path. It imports a sibling module as a top-level one (as NeMo Gym's
`calendar` and `citation_if` do), declares config fields of its own (one required, set by its
configs/*.yaml), sees no module of the launcher's own folder (`ng_run` puts none of its own on
sys.path: grl_tetris's `import gymnasium` must find gymnasium, not rollbook's module of that name),
finds its environment's scripts first on PATH (ng_run's environments are activated),
needs a row field in its seed (as `example_session_state_mgmt` does), and has a
tool for each way a reply goes wrong: plain text (as `citation_if`'s), a 500 from a live process,
and a process that dies mid-call.
"""

import importlib.util
import os
import sys

from fastapi import Request
from fastapi.responses import PlainTextResponse
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_gym.server_utils import SESSION_ID_KEY
from pydantic import BaseModel, ConfigDict
from sibling import TERMINAL  # a sibling module: importable only with this folder on sys.path

if importlib.util.find_spec("nemo_gym_launcher") is not None:
    raise ImportError("the launcher's own folder is on sys.path: its modules shadow the server's imports")
if os.environ["PATH"].split(os.pathsep)[0] != os.path.dirname(sys.executable):  # ng_run's environment is activated
    raise ImportError("its environment's scripts (uv, for a server that builds an environment) are not first on PATH")


class ConfiguredResourcesServerConfig(BaseResourcesServerConfig):
    greeting: str  # required: its configs/*.yaml sets it
    step: int = 1
    bonus: int = 0


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class SeedRequest(BaseSeedSessionRequest):
    start: int  # from the row, as simple_agent posts it


class ConfiguredResourcesServer(SimpleResourcesServer):
    ray_enabled = False
    config: ConfiguredResourcesServerConfig
    sessions: dict = {}

    def setup_webserver(self):
        app = super().setup_webserver()
        app.post("/show")(self.show)
        app.post("/add")(self.add)
        app.post("/plain")(self.plain)
        app.post("/broken")(self.broken)
        app.post("/die")(self.die)
        return app

    async def seed_session(self, request: Request, body: SeedRequest) -> BaseSeedSessionResponse:
        self.sessions[request.session[SESSION_ID_KEY]] = body.start
        return BaseSeedSessionResponse()

    async def show(self, request: Request, body: Body) -> dict:
        c = self.config
        return {"greeting": c.greeting, "step": c.step, "bonus": c.bonus,
                "value": self.sessions.get(request.session[SESSION_ID_KEY])}

    async def add(self, request: Request, body: Body) -> dict:
        sid = request.session[SESSION_ID_KEY]
        self.sessions[sid] = self.sessions.get(sid, 0) + self.config.step
        return {"value": self.sessions[sid]}

    async def plain(self, request: Request, body: Body) -> PlainTextResponse:
        return PlainTextResponse(TERMINAL)

    async def broken(self, request: Request, body: Body) -> dict:
        raise RuntimeError("this tool is broken")

    async def die(self, request: Request, body: Body) -> dict:
        os._exit(1)

    async def verify(self, request: Request, body: BaseVerifyRequest) -> BaseVerifyResponse:
        value = self.sessions.get(request.session[SESSION_ID_KEY])
        return BaseVerifyResponse(**body.model_dump(), reward=float(value or 0))


if __name__ == "__main__":
    ConfiguredResourcesServer.run_webserver()
