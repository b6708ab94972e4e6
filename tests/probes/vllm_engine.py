"""Generates from a checkpoint with vLLM, under the rollout engine's prefill options, and
writes as JSON: one sampled completion's tokens and log-probs, and how many of a batch
of seeded requests, whose prompts together exceed a step's token budget, completed.
One engine for both: each start costs the suite half a minute."""

import json
import sys
from pathlib import Path

MAX_TOKENS = 16
MAX_MODEL_LEN = 1024
PROMPT_TOKENS = 400
REQUESTS = 16


def main() -> None:
    from vllm import LLM, SamplingParams

    from rlfleet.rollout.worker import prefill_options

    llm = LLM(
        model=sys.argv[1],
        dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
        seed=0,
        **prefill_options(MAX_MODEL_LEN),
    )
    prompt = "<|im_start|>user\n12+30=<|im_end|>\n<|im_start|>assistant\n"
    params = SamplingParams(
        max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=0, temperature=1.0, seed=7
    )
    completion = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    logprobs = [
        entry[token].logprob
        for token, entry in zip(completion.token_ids, completion.logprobs, strict=True)
    ]
    prompts = [
        {"prompt_token_ids": [(7 * i + j) % 300 + 5 for j in range(PROMPT_TOKENS)]}
        for i in range(REQUESTS)
    ]
    seeded = [SamplingParams(max_tokens=4, temperature=1.0, seed=i) for i in range(REQUESTS)]
    outputs = llm.generate(prompts, seeded, use_tqdm=False)
    step_tokens = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    Path(sys.argv[2]).write_text(
        json.dumps(
            {
                "generated": {
                    "token_ids": list(completion.token_ids),
                    "logprobs": logprobs,
                    "max_tokens": MAX_TOKENS,
                },
                "seeded_batch": {
                    "requests": REQUESTS,
                    "prompt_tokens": REQUESTS * PROMPT_TOKENS,
                    "step_tokens": step_tokens,
                    "completed": sum(len(o.outputs[0].token_ids) == 4 for o in outputs),
                },
            }
        )
    )


if __name__ == "__main__":
    main()
