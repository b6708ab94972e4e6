"""Publish a run's versions as one of WORLD trainer ranks, gathering over gloo as trainer
ranks do; argv: URL RUN CONFIG_JSON VERSIONS RANK WORLD INIT_METHOD FAIL_AT OUT.

VERSIONS is a `torch.save`d list of state dicts, one per version; this rank publishes the
tensors `owned_names` gives it. Rank 1 closes its NATS connection before version FAIL_AT
(-1: never), so its shard puts fail. OUT gets, per version, the manifests or the error.
"""

import asyncio
import json
import sys
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from rlfleet.bus import connection
from rlfleet.weightsync import Part, Publisher, SyncConfig, WeightStream, owned_names


async def main(
    url: str, run: str, config_json: str, versions: str, rank: int, world: int, fail_at: int
) -> list[dict]:
    def gather(obj: object) -> list[object]:
        gathered: list[object] = [None] * world
        dist.all_gather_object(gathered, obj)
        return gathered

    config = SyncConfig(**json.loads(config_json))
    nc = await connection.connect(url)
    publisher = Publisher(WeightStream(nc, run, config), config, part=Part(rank, world, gather))
    results: list[dict] = []
    for version, tensors in enumerate(torch.load(versions)):
        if rank == 1 and version == fail_at:
            await nc.close()
        sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
        owned = owned_names(sizes, rank, world)
        try:
            manifests = await publisher.publish({n: tensors[n] for n in owned}, version)
        except Exception as error:
            results.append({"version": version, "error": type(error).__name__})
            break
        results.append({"version": version, "manifests": msgspec.to_builtins(manifests)})
    if not nc.is_closed:
        await nc.close()
    return results


if __name__ == "__main__":
    url, run, config_json, versions, rank, world, init_method, fail_at, out = sys.argv[1:10]
    dist.init_process_group("gloo", init_method=init_method, rank=int(rank), world_size=int(world))
    try:
        results = asyncio.run(
            main(url, run, config_json, versions, int(rank), int(world), int(fail_at))
        )
    finally:
        dist.destroy_process_group()
    Path(out).write_text(json.dumps(results))
