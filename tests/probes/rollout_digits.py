"""A small rollout loop for the trainer's learning test; argv: ARGS_JSON OUT_JSON.

Plays the rollout side with real vLLM: each round samples `groups` prompts x
`group_size` attempts, rewards each completion by the share of its tokens that are
digits (a verifiable reward a random tiny model scores ~3% on), publishes the
trajectories with the experts vLLM routed each token to (for router replay), then
waits for the trainer's next version and switches vLLM to it through weightsync.
ARGS_JSON: {"checkpoint", "nats_url", "run", "prompt" (with {n}), "rounds", "groups",
"group_size", "max_tokens"}; completions are exactly max_tokens long.
"""

import asyncio
import json
import sys
import time
from pathlib import Path

DIGITS = {str(d) for d in range(10)}


def main() -> None:
    from vllm import LLM, SamplingParams

    from rlfleet.api.wire import Segment, Trajectory, encode_trajectory, trajectory_subject
    from rlfleet.bus import connection
    from rlfleet.rollout.engine import vllm_experts
    from rlfleet.weightsync import SyncConfig, vllm_options, vllm_start, vllm_update

    args = json.loads(Path(sys.argv[1]).read_text())
    llm = LLM(
        model=args["checkpoint"],
        dtype="bfloat16",
        max_model_len=256,
        enforce_eager=True,
        seed=0,
        enable_prefix_caching=False,  # every prompt token is run, so its experts are recorded
        **vllm_options(worker_extension=vllm_experts.EXTENSION),
    )
    vllm_experts.start(llm)
    tokenizer = llm.get_tokenizer()
    vllm_start(llm, args["nats_url"], args["run"], None, SyncConfig(snapshot_every=4))
    loop = asyncio.new_event_loop()
    nc = loop.run_until_complete(connection.connect(args["nats_url"]))
    js = nc.jetstream()
    version = vllm_update(llm, 0).version
    rounds = []
    for round_ in range(args["rounds"]):
        prompts = [args["prompt"].format(n=round_ * 100 + g) for g in range(args["groups"])]
        params = SamplingParams(
            n=args["group_size"],
            max_tokens=args["max_tokens"],
            min_tokens=args["max_tokens"],
            logprobs=0,
            temperature=1.0,
            seed=round_,
        )
        rewards = []
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for g, (request, experts) in enumerate(
            zip(outputs, vllm_experts.take(llm, outputs), strict=True)
        ):
            for attempt, (out, routed) in enumerate(zip(request.outputs, experts, strict=True)):
                pieces = [tokenizer.decode([t]) for t in out.token_ids]
                reward = sum(p in DIGITS for p in pieces) / len(pieces)
                rewards.append(reward)
                tokens = list(request.prompt_token_ids) + list(out.token_ids)
                generated = len(out.token_ids)
                trajectory = Trajectory(
                    run=args["run"],
                    task_id=f"digits-{round_}-{g}",
                    group_id=f"{round_}-{g}",
                    group_size=args["group_size"],
                    attempt=attempt,
                    reward=reward,
                    reward_breakdown={"digits": reward},
                    segments=[
                        Segment(
                            tokens=tokens,
                            prompt_len=len(request.prompt_token_ids),
                            generated=[1] * generated,
                            logprobs=[
                                e[t].logprob
                                for t, e in zip(out.token_ids, out.logprobs, strict=True)
                            ],
                            versions=[version] * generated,
                            routed_experts=routed.astype("<u2").tobytes(),
                            moe_layers=routed.shape[1],
                            top_k=routed.shape[2],
                        )
                    ],
                    worker="probe",
                    created_at=time.time(),
                )
                loop.run_until_complete(
                    js.publish(trajectory_subject(args["run"]), encode_trajectory(trajectory))
                )
        rounds.append({"version": version, "reward": sum(rewards) / len(rewards)})
        print(f"round {round_}: version {version}, reward {rounds[-1]['reward']:.3f}", flush=True)
        if round_ + 1 < args["rounds"]:
            version = vllm_update(llm, version + 1).version
    loop.run_until_complete(nc.close())
    Path(sys.argv[2]).write_text(json.dumps({"rounds": rounds}))


if __name__ == "__main__":
    main()
