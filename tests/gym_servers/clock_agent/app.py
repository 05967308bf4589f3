"""A NeMo Gym agent as many are written: simple_agent with the current time in its instructions.

Run again after a crash, it asks its model something else than it asked before, so rollbook cannot
answer it from the log: the test of a diverging agent runs it unchanged (tests/e2e/test_nemo_gym_simple_agent.py).
"""

import time

from fastapi import Body, Request, Response
from nemo_gym.openai_utils import NeMoGymResponse, NeMoGymResponseCreateParamsNonStreaming
from responses_api_agents.simple_agent.app import SimpleAgent


class ClockAgent(SimpleAgent):
    async def responses(
        self,
        request: Request,
        response: Response,
        body: NeMoGymResponseCreateParamsNonStreaming = Body(),  # noqa: B008 - how FastAPI declares a body
    ) -> NeMoGymResponse:
        body = body.model_copy(update={"instructions": f"The time is {time.time():.6f}."})
        return await super().responses(request, response, body)


if __name__ == "__main__":
    ClockAgent.run_webserver()
