"""Sync a receiver to a run's newest version; argv: URL DOMAIN RUN CONFIG_JSON OUT.

Prints "fetching" when its first shard request goes out, so a test can kill it there.
"""

import asyncio
import json
import sys
from pathlib import Path

from rlfleet.bus import connection
from rlfleet.weightsync.config import SyncConfig
from rlfleet.weightsync.receiver import Receiver
from rlfleet.weightsync.transport import WeightStream


async def main(url: str, domain: str, run: str, config: str) -> dict:
    nc = await connection.connect(url)
    stream = WeightStream(nc, run, SyncConfig(**json.loads(config)), domain=domain)
    fetch = stream.fetch_shard

    async def announced(*args, **kwargs):
        print("fetching", flush=True)
        return await fetch(*args, **kwargs)

    stream.fetch_shard = announced
    receiver = Receiver(stream)
    version = await receiver.sync()
    await nc.close()
    return {"version": version, "digest": receiver.state.digest()}


if __name__ == "__main__":
    result = asyncio.run(main(*sys.argv[1:5]))
    Path(sys.argv[5]).write_text(json.dumps(result))
