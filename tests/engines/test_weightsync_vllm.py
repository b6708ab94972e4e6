"""Weightsync inside real vLLM (CPU): updates in place equal a fresh start from the checkpoint,
also for requests that run across the update."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path

import msgspec

from rlfleet.bus.streams import ensure_run_streams
from rlfleet.local.nats import HUB_DOMAIN
from rlfleet.local.processes import run_in_session
from rlfleet.models.tiny import init_model, train_step
from rlfleet.weightsync.config import SyncConfig

PROBE = Path(__file__).parents[1] / "probes" / "vllm_weightsync.py"
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
CONFIG = SyncConfig(shard_bytes=256 << 10, chunk_bytes=64 << 10)


def _probe(args: dict, tmp_path: Path, name: str, env: dict[str, str] | None = None) -> dict:
    (tmp_path / f"{name}.args.json").write_text(json.dumps(args))
    argv = [
        sys.executable,
        str(PROBE),
        str(tmp_path / f"{name}.args.json"),
        str(tmp_path / f"{name}.json"),
    ]
    result = run_in_session(argv, env={**os.environ, **ENGINE_ENV, **(env or {})}, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return json.loads((tmp_path / f"{name}.json").read_text())


# A tensor-parallel engine whose two workers each follow the weights and load their own
# shard of every changed tensor (vLLM's CPU backend, one core each). One worker runs the
# same extension code through the same collective call; every rollout worker test
# updates such an engine in place (test_rollout_worker), so it is not run twice here.
TENSOR_PARALLEL = 2


def test_vllm_updated_in_place_matches_vllm_started_from_the_new_checkpoint(
    nats_servers, tmp_path: Path
) -> None:
    v0 = init_model("tiny-moe", tmp_path / "v0")
    v1 = train_step(v0, tmp_path / "v1", lr=1e-2)
    run, region = f"r{uuid.uuid4().hex[:8]}", nats_servers.region
    leaf = nats_servers.bed.leaves[region]

    async def streams() -> None:
        hub = await nats_servers.bed.hub.connect()
        try:
            assert await ensure_run_streams(hub, run, HUB_DOMAIN, [region]) == []
        finally:
            await hub.close()

    asyncio.run(streams())
    rounds = [
        {"version": 0, "publish": str(v0)},
        {"version": 1, "publish": str(v1), "requests": "inflight"},
    ]
    # Then version 2 (version 0's weights again), whose first tensor reaches the second
    # worker corrupted: refused; and the same version again, honestly.
    rounds += [{"version": 2, "publish": str(v0), "fault": 1}, {"version": 2}]
    env = leaf.client_env()
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(PROBE.parent), os.environ.get("PYTHONPATH")])
    )
    updated = _probe(
        {
            "checkpoint": str(v0),
            "tensor_parallel": TENSOR_PARALLEL,
            "rounds": rounds,
            "hub_url": nats_servers.bed.hub.url,
            "leaf_url": leaf.url,
            "run": run,
            "domain": region,
            "config": msgspec.to_builtins(CONFIG),
            "worker_extension": "weightsync_faults.FaultyWorker",
        },
        tmp_path,
        "updated",
        env,
    )
    before, after, *faulted = updated["rounds"]
    # Requests running across the update: the tokens sampled before it carry version 0,
    # those after it version 1, and none fails.
    switches = []
    for long in after["long"]:
        (old, start, switch), (new, resume, end) = long["spans"]
        assert (old, start, new, resume, end) == ("0", 0, "1", switch, len(long["token_ids"]))
        assert 0 < switch < end and long["finish_reason"] == "length"
        switches.append(switch)
    fresh = _probe(
        {
            "checkpoint": str(v1),
            "tensor_parallel": TENSOR_PARALLEL,
            "continue": [
                {
                    "prompt_token_ids": long["prompt_token_ids"] + long["token_ids"][:switch],
                    "max_tokens": len(long["token_ids"]) - switch,
                }
                for long, switch in zip(after["long"], switches, strict=True)
            ],
        },
        tmp_path,
        "fresh",
    )
    # After the switch they go on exactly as an engine started on version 1 continues
    # them: the same tokens with bitwise the same log-probs.
    assert [
        {"token_ids": long["token_ids"][switch:], "logprobs": long["logprobs"][switch:]}
        for long, switch in zip(after["long"], switches, strict=True)
    ] == [{k: c[k] for k in ("token_ids", "logprobs")} for c in fresh["continued"]]
    assert (before["version"], after["version"]) == (0, 1)
    assert (before["kinds"], after["kinds"]) == (["full"], ["delta"])
    # Every worker loaded exactly the published state: the digest each one computed of
    # the tensors it handed vLLM is the manifest's.
    assert after["digest"] == after["published_digest"]
    assert after["worker_digests"] == [after["published_digest"]] * TENSOR_PARALLEL
    # Every sample reports the version it was produced under.
    assert all(s["weight_versions"] == ["0"] for s in before["samples"])
    assert all(s["weight_versions"] == ["1"] for s in after["samples"])
    # In place, the new weights give exactly what a fresh engine on them gives.
    strip = [{k: s[k] for k in ("token_ids", "logprobs")} for s in after["samples"]]
    assert strip == [
        {k: s[k] for k in ("token_ids", "logprobs")} for s in fresh["rounds"][0]["samples"]
    ]
    assert [s["logprobs"] for s in before["samples"]] != [s["logprobs"] for s in after["samples"]]
    # A follower that received one bit wrong computes another digest than the leader's
    # verified one, and the update is refused (the engine stays paused); the workers
    # take their weights as unknown, so the next update reloads every tensor, all agree,
    # and the engine runs version 0's weights again exactly.
    refused, recovered = faulted
    published = refused["published_digest"]
    assert refused["refused"] is not None, "the corrupted worker was not noticed"
    assert f"worker 0: 2 {published}, worker 1: 2 " in refused["refused"]
    assert f"worker 1: 2 {published}" not in refused["refused"]
    assert refused["refused"].endswith(f"(verified: 2 {published})")
    assert [(w["loaded"], w["digest"]) for w in refused["workers"]] == [(None, None)] * 2
    assert recovered["version"] == 2 and recovered["digest"] == published
    assert recovered["worker_digests"] == [published] * TENSOR_PARALLEL
    assert all(s["weight_versions"] == ["2"] for s in recovered["samples"])
    assert [{k: s[k] for k in ("token_ids", "logprobs")} for s in recovered["samples"]] == [
        {k: s[k] for k in ("token_ids", "logprobs")} for s in before["samples"]
    ]
