"""vLLM generating before and after weightsync updates; argv: ARGS_JSON OUT_JSON.

ARGS_JSON: {"checkpoint", "tensor_parallel"? (workers of the engine), and for updates
"rounds": [{"version", "publish"?: DIR, "requests"?, "fault"?}], "hub_url", "leaf_url",
"run", "domain", "config", "worker_extension"?}. Each round publishes
DIR's weights as the version (playing the trainer; without "publish", it is already),
updates vLLM to it through the region's leaf node, and generates. With "requests":
"inflight", long requests are running (and have sampled tokens) once every worker holds
the version, and the update happens at once; with "drain", it waits until they finish,
as rollout workers used to. With "fault": RANK (and "worker_extension":
"weightsync_faults.FaultyWorker"), worker RANK gets the first tensor of the update
corrupted, and the round reports the update's refusal ("refused") instead of samples.
Without "rounds" it only generates from the checkpoint, and "continue":
[{"prompt_token_ids", "max_tokens"}] generates those too. Greedy decoding with
log-probs, so two engines on the same weights agree exactly.
"""

import asyncio
import json
import sys
import time
from pathlib import Path

PROMPTS = [
    "<|im_start|>user\n12+30=<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nreverse abc<|im_end|>\n<|im_start|>assistant\n",
]
MAX_TOKENS = 12
LONG_TOKENS = 48  # long enough to still run when the update comes
SEEN_TOKENS = 2  # each long request has sampled this many before the version is offered


def _params(tokens: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=tokens, min_tokens=tokens, logprobs=0, temperature=0)


def _sample(request) -> dict:
    out = request.outputs[0]
    return {
        "prompt_token_ids": list(request.prompt_token_ids),
        "token_ids": list(out.token_ids),
        "logprobs": [e[t].logprob for t, e in zip(out.token_ids, out.logprobs, strict=True)],
        "weight_versions": sorted({span.version for span in out.weight_versions or []}),
        "spans": [[s.version, s.start, s.end] for s in out.weight_versions or []],
        "finish_reason": out.finish_reason,
    }


def generate(llm, prompts=PROMPTS, params=None) -> list[dict]:
    params = params or _params(MAX_TOKENS)
    return [_sample(r) for r in llm.generate(prompts, params, use_tqdm=False)]


def start_long(llm) -> None:
    """Long requests, stepped until each has sampled a few tokens (they keep running)."""
    engine, tokenizer = llm.llm_engine, llm.get_tokenizer()
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(
            f"long{index}", {"prompt_token_ids": tokenizer.encode(prompt)}, _params(LONG_TOKENS)
        )
    seen: dict[str, int] = {}
    while len(seen) < len(PROMPTS) or min(seen.values()) < SEEN_TOKENS:
        for out in engine.step():
            seen[out.request_id] = len(out.outputs[0].token_ids)


def held(llm) -> int:
    from rlfleet.weightsync import vllm_held

    version = vllm_held(llm)
    return -1 if version is None else version


def finish_long(llm) -> list[dict]:
    engine, done = llm.llm_engine, {}
    while engine.has_unfinished_requests():
        done |= {out.request_id: _sample(out) for out in engine.step() if out.finished}
    return [done[key] for key in sorted(done)]


def main() -> None:
    from vllm import LLM

    from rlfleet.bus import connection
    from rlfleet.models.tiny import read_weights
    from rlfleet.rollout.worker.loop import parallel_options
    from rlfleet.weightsync import (
        Publisher,
        SyncConfig,
        WeightStream,
        vllm_options,
        vllm_start,
        vllm_status,
        vllm_update,
        wait_for_version,
    )

    args = json.loads(Path(sys.argv[1]).read_text())
    rounds = args.get("rounds", [])
    extension = args.get("worker_extension")
    options = (vllm_options(extension) if extension else vllm_options()) if rounds else {}
    llm = LLM(
        model=args["checkpoint"],
        dtype="bfloat16",
        max_model_len=256,
        enforce_eager=True,
        seed=0,
        **parallel_options(args.get("tensor_parallel", 1)),
        **options,
    )
    report: dict = {"rounds": []}
    if not rounds:
        report["rounds"].append({"samples": generate(llm)})
        if "continue" in args:
            prompts = [{"prompt_token_ids": c["prompt_token_ids"]} for c in args["continue"]]
            params = [_params(c["max_tokens"]) for c in args["continue"]]
            report["continued"] = generate(llm, prompts, params)
    else:
        config = SyncConfig(**args["config"])
        loop = asyncio.new_event_loop()
        hub = loop.run_until_complete(connection.connect(args["hub_url"]))
        publisher = Publisher(WeightStream(hub, args["run"], config), config)
        vllm_start(llm, args["leaf_url"], args["run"], args["domain"], config)
        published: dict[int, tuple[list, str]] = {}
        for step in rounds:
            if "publish" in step:
                weights = read_weights(Path(step["publish"]))
                manifests = loop.run_until_complete(publisher.publish(weights, step["version"]))
                published[step["version"]] = manifests, manifests[0].state_digest
            manifests, published_digest = published[step["version"]]
            if "fault" in step:
                wait_for_version(lambda: held(llm), step["version"], 300.0, what="vLLM's workers")
                hit = llm.collective_rpc("probe_corrupt_next_received", args=(step["fault"],))
                assert sum(hit) == 1, hit
                try:
                    vllm_update(llm, step["version"])
                except RuntimeError as error:
                    refused = str(error)
                else:
                    refused = None
                report["rounds"].append(
                    {
                        "refused": refused,
                        "published_digest": published_digest,
                        "workers": vllm_status(llm),
                    }
                )
                continue
            requests, long, drain_wait_s = step.get("requests"), [], 0.0
            if requests:
                wait_for_version(lambda: held(llm), step["version"], 300.0, what="vLLM's workers")
                start_long(llm)
                offered = time.perf_counter()
                if requests == "drain":
                    long = finish_long(llm)
                drain_wait_s = time.perf_counter() - offered
            update = vllm_update(llm, step["version"])
            if requests == "inflight":
                long = finish_long(llm)
            report["rounds"].append(
                {
                    "long": long,
                    "drain_wait_ms": drain_wait_s * 1000,
                    "version": update.version,
                    "kinds": [m.kind for m in manifests],
                    "published_digest": published_digest,
                    "digest": update.digest,
                    "worker_digests": [s["digest"] for s in vllm_status(llm)],
                    "pause_ms": update.pause_s * 1000,
                    "samples": generate(llm),
                }
            )
        loop.run_until_complete(hub.close())
    Path(sys.argv[2]).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
