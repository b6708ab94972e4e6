"""`python -I -m rlfleet.rollout.envpool SETTINGS_JSON`: one environment session server."""

import asyncio
import json
import logging
import sys

from rlfleet.rollout.envpool.server import serve

logging.basicConfig(level=logging.INFO, format="envsessions %(levelname)s %(message)s")
asyncio.run(serve(json.loads(sys.argv[1])))
