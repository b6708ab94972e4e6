"""One vLLM engine made as a rollout worker makes it (`engine_options`, `prefill_options`,
prefix caching) from a checkpoint; argv: CHECKPOINT OUT_JSON. Writes as JSON:

- samples with the routed experts recorded in its workers; a second round continues the
  first sample, as a multi-turn session does, so its prompt comes mostly from the prefix
  cache; a third samples at a temperature above 1, as a run that explores does;
- one sampled completion's tokens and log-probs;
- how many of a batch of seeded requests, whose prompts together exceed a step's token
  budget, completed.

One engine for all: each start costs the suite half a minute.
"""

import json
import sys
from pathlib import Path

MAX_TOKENS = 16
MAX_MODEL_LEN = 1024
PROMPT_TOKENS = 400
REQUESTS = 16
PROMPTS = [
    "<|im_start|>user\n12+30=<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nreverse the string abcdef<|im_end|>\n<|im_start|>assistant\n",
    "hi",
]
HOT = 1.5


def sampled_logprobs(completion) -> list[float]:
    """The log-prob of each token a completion sampled (vLLM's logprobs=0)."""
    return [
        entry[token].logprob
        for token, entry in zip(completion.token_ids, completion.logprobs, strict=True)
    ]


def experts(llm, layers: int) -> dict:
    from vllm import SamplingParams

    from rlfleet.rollout.engine import vllm_experts

    params = SamplingParams(n=2, max_tokens=20, min_tokens=5, logprobs=0, seed=3)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)

    def sample(request, completion, routed) -> dict:
        return {
            "tokens": list(request.prompt_token_ids) + list(completion.token_ids),
            "prompt_len": len(request.prompt_token_ids),
            "logprobs": sampled_logprobs(completion),
            "experts": routed.tolist(),
            "cached": request.num_cached_tokens or 0,
        }

    samples = [
        sample(request, completion, routed)
        for request, routes in zip(outputs, vllm_experts.take(llm, outputs), strict=True)
        for completion, routed in zip(request.outputs, routes, strict=True)
    ]
    turn = samples[0]["tokens"] + list(range(40, 60))
    params = SamplingParams(max_tokens=10, min_tokens=5, logprobs=0, seed=4)
    again = llm.generate([{"prompt_token_ids": turn}], params, use_tqdm=False)
    continued = sample(again[0], again[0].outputs[0], vllm_experts.take(llm, again)[0][0])
    params = SamplingParams(max_tokens=20, logprobs=0, seed=5, temperature=HOT)
    hot = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    tempered = sample(hot[0], hot[0].outputs[0], vllm_experts.take(llm, hot)[0][0])
    return {
        "layers": layers,
        "samples": samples,
        "continued": continued,
        "hot": {"temperature": HOT, "sample": tempered},
    }


def generated(llm) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=0, temperature=1.0, seed=7
    )
    completion = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    return {
        "token_ids": list(completion.token_ids),
        "logprobs": sampled_logprobs(completion),
        "max_tokens": MAX_TOKENS,
    }


def seeded_batch(llm) -> dict:
    from vllm import SamplingParams

    prompts = [
        {"prompt_token_ids": [(7 * i + j) % 300 + 5 for j in range(PROMPT_TOKENS)]}
        for i in range(REQUESTS)
    ]
    seeded = [SamplingParams(max_tokens=4, temperature=1.0, seed=i) for i in range(REQUESTS)]
    outputs = llm.generate(prompts, seeded, use_tqdm=False)
    return {
        "requests": REQUESTS,
        "prompt_tokens": REQUESTS * PROMPT_TOKENS,
        "step_tokens": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
        "completed": sum(len(o.outputs[0].token_ids) == 4 for o in outputs),
    }


def main() -> None:
    from vllm import LLM

    from rlfleet.rollout.engine import vllm_experts
    from rlfleet.rollout.worker.loop import engine_options, prefill_options

    llm = LLM(
        model=sys.argv[1],
        dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
        seed=0,
        enable_prefix_caching=True,
        block_size=32,
        **engine_options(),
        **prefill_options(MAX_MODEL_LEN),
    )
    layers = vllm_experts.start(llm)
    report = {
        "experts": experts(llm, layers),
        "generated": generated(llm),
        "seeded_batch": seeded_batch(llm),
    }
    Path(sys.argv[2]).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
