"""vLLM generating before and after weightsync updates; argv: ARGS_JSON OUT_JSON.

ARGS_JSON: {"checkpoint", and for updates "rounds": [{"version", "publish": DIR}],
"hub_url", "leaf_url", "run", "domain", "config"}. Each round publishes DIR's weights
as the version (playing the trainer), updates vLLM to it through the region's leaf
node, and generates. Without "rounds" it only generates from the checkpoint. Greedy
decoding with log-probs, so two engines on the same weights agree exactly.
"""

import asyncio
import json
import sys
from pathlib import Path

PROMPTS = [
    "<|im_start|>user\n12+30=<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nreverse abc<|im_end|>\n<|im_start|>assistant\n",
]
MAX_TOKENS = 12


def generate(llm) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=0, temperature=0)
    samples = []
    for request in llm.generate(PROMPTS, params, use_tqdm=False):
        out = request.outputs[0]
        samples.append(
            {
                "token_ids": list(out.token_ids),
                "logprobs": [
                    e[t].logprob for t, e in zip(out.token_ids, out.logprobs, strict=True)
                ],
                "weight_versions": sorted({span.version for span in out.weight_versions or []}),
            }
        )
    return samples


def main() -> None:
    from vllm import LLM

    from rlfleet.bus import auth
    from rlfleet.models.tiny import read_weights
    from rlfleet.weightsync import (
        Publisher,
        SyncConfig,
        WeightStream,
        vllm_options,
        vllm_start,
        vllm_update,
    )

    args = json.loads(Path(sys.argv[1]).read_text())
    rounds = args.get("rounds", [])
    options = vllm_options() if rounds else {}
    llm = LLM(
        model=args["checkpoint"],
        dtype="bfloat16",
        max_model_len=256,
        enforce_eager=True,
        seed=0,
        **options,
    )
    report: dict = {"rounds": []}
    if not rounds:
        report["rounds"].append({"samples": generate(llm)})
    else:
        config = SyncConfig(**args["config"])
        loop = asyncio.new_event_loop()
        hub = loop.run_until_complete(auth.connect(args["hub_url"]))
        publisher = Publisher(WeightStream(hub, args["run"], config), config)
        vllm_start(llm, args["leaf_url"], args["run"], args["domain"], config)
        for step in rounds:
            weights = read_weights(Path(step["publish"]))
            manifests = loop.run_until_complete(publisher.publish(weights, step["version"]))
            update = vllm_update(llm, step["version"])
            report["rounds"].append(
                {
                    "version": update.version,
                    "kinds": [m.kind for m in manifests],
                    "published_digest": manifests[0].state_digest,
                    "digest": update.digest,
                    "pause_ms": update.pause_s * 1000,
                    "samples": generate(llm),
                }
            )
        loop.run_until_complete(hub.close())
    Path(sys.argv[2]).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
