"""Benchmark: acknowledging a training step's trajectories, one by one or all at once.

The trainer acks each trajectory it trained on (`ack_sync`, one round trip each) after
the step's checkpoint and publish, before it takes the next step: 128 a step in the demo.
On the bed's NATS (a hub alone), five steps' worth each way, twice, alternating. Prints
one JSON object: the median milliseconds for 128 acks in sequence and gathered.
`--quick` acks one step of 8 each way, to check the script.
"""

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from rlfleet.bus.patience import patiently
from rlfleet.local.nats import NatsBed, StandaloneNats

STEP = 128  # trajectories a step in the demo: 8 groups of 16
STEPS = 5
QUICK = {"STEP": 8, "STEPS": 1}


async def measure(bed: NatsBed) -> dict[str, float]:
    nc = await bed.hub.connect()
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="ACKS", subjects=["acks.>"]))
    out = {}
    for mode in ("sequential", "gathered", "sequential", "gathered"):
        for _ in range(STEP * STEPS):
            await js.publish("acks.x", b"x" * 2000)
        sub = await js.pull_subscribe(
            "acks.x",
            durable=f"d{time.time_ns()}",
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, max_ack_pending=10000),
        )
        took = []
        for _ in range(STEPS):
            msgs = []
            while len(msgs) < STEP:
                msgs += await sub.fetch(STEP - len(msgs), timeout=5)
            started = time.perf_counter()
            if mode == "sequential":
                for m in msgs:
                    await patiently(m.ack_sync, "ack")
            else:
                await asyncio.gather(*(patiently(m.ack_sync, "ack") for m in msgs))
            took.append(time.perf_counter() - started)
        out.setdefault(mode, []).extend(took)
        await js.purge_stream("ACKS")
    await nc.close()
    return {mode: round(statistics.median(t) * 1e3, 2) for mode, t in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smallest sizes: check the script")
    if parser.parse_args().quick:
        globals().update(QUICK)
    with tempfile.TemporaryDirectory() as root:
        nats = StandaloneNats(Path(root))
        try:
            print(json.dumps({"ms_per_step_of_acks": asyncio.run(measure(nats.bed))}))
        finally:
            nats.stop()


if __name__ == "__main__":
    main()
