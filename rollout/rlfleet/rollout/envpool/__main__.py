"""`python -I -m rlfleet.rollout.envpool SETTINGS_JSON`: one environment session server."""

import asyncio
import json
import logging
import sys

from rlfleet.rollout.envpool.server import serve

if __name__ == "__main__":  # an image's import check imports every module, this one too
    logging.basicConfig(level=logging.INFO, format="envsessions %(levelname)s %(message)s")
    asyncio.run(serve(json.loads(sys.argv[1])))
