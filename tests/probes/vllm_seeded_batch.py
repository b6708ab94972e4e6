"""Generates, with the rollout engine's prefill options, seeded requests whose prompts
together exceed a step's token budget, and writes how many completed as JSON."""

import json
import sys
from pathlib import Path

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
    prompts = [
        {"prompt_token_ids": [(7 * i + j) % 300 + 5 for j in range(PROMPT_TOKENS)]}
        for i in range(REQUESTS)
    ]
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=i) for i in range(REQUESTS)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    Path(sys.argv[2]).write_text(
        json.dumps(
            {
                "requests": REQUESTS,
                "prompt_tokens": REQUESTS * PROMPT_TOKENS,
                "step_tokens": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
                "completed": sum(len(o.outputs[0].token_ids) == 4 for o in outputs),
            }
        )
    )


if __name__ == "__main__":
    main()
