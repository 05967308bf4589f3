"""NeMo Gym's own head server for a config, run with the NeMo Gym virtual environment's Python.

`ng_run` would start this head server, a Ray cluster, and every server of the config that has an
`entrypoint` (each in a uv virtual environment of its own). The test needs only the head server,
which is what `ng_collect_rollouts` asks for the merged config, so it starts NeMo Gym's HeadServer
class directly on the config given as Hydra overrides, and writes the merged config (what `ng_run`
hands its servers in NEMO_GYM_CONFIG_DICT) to the path in $NEMO_GYM_RESOLVED_CONFIG.
"""

import os

from nemo_gym.global_config import get_global_config_dict
from nemo_gym.server_utils import HeadServer
from omegaconf import OmegaConf

config = get_global_config_dict()
with open(os.environ["NEMO_GYM_RESOLVED_CONFIG"], "w") as f:
    f.write(OmegaConf.to_yaml(config))
server, thread, instance = HeadServer.run_webserver()
instance.mark_ready()
thread.join()
