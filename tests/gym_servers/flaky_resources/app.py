"""A NeMo Gym resources server whose tool replies change between runs: the negative control of replay.

It keeps per-session state the way NeMo Gym's servers do (process memory, keyed by the session
cookie) and names its tools like Workplace Assistant's mail tools, so the same tasks and the same
scripted play drive it; but every reply carries a nonce drawn when the process starts. Replaying a
session's recorded calls into a new process can therefore never give back the recorded replies.
Run with NeMo Gym's Python, by rollbook's launcher (participants/environments/nemo_gym_launcher.py).
"""

import uuid

from fastapi import Request
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

NONCE = uuid.uuid4().hex  # one per process: what makes a replay diverge


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class FlakyResourcesServer(SimpleResourcesServer):
    ray_enabled = False  # as Workplace Assistant: no Ray cluster for a server that needs none
    config: BaseResourcesServerConfig
    sessions: dict = {}

    def setup_webserver(self):
        app = super().setup_webserver()
        app.post("/email_search_emails")(self.search)
        app.post("/email_reply_email")(self.reply)
        return app

    async def seed_session(self, request: Request, body: BaseSeedSessionRequest) -> BaseSeedSessionResponse:
        self.sessions[request.session[SESSION_ID_KEY]] = []
        return BaseSeedSessionResponse()

    async def search(self, request: Request, body: Body) -> dict:
        self.sessions.setdefault(request.session[SESSION_ID_KEY], []).append("search")
        return {"output": {"emails": [{"email_id": "00000057", "sender/recipient": "carlos", "nonce": NONCE}]}}

    async def reply(self, request: Request, body: Body) -> dict:
        self.sessions.setdefault(request.session[SESSION_ID_KEY], []).append("reply")
        return {"output": f"replied ({NONCE})"}

    async def verify(self, request: Request, body: BaseVerifyRequest) -> BaseVerifyResponse:
        called = [o for o in body.response.output if o.type == "function_call"]
        return BaseVerifyResponse(**body.model_dump(), reward=1.0 if called else 0.0)


if __name__ == "__main__":
    FlakyResourcesServer.run_webserver()
