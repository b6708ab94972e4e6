"""vLLM samples with routed experts recorded in its workers; argv: CHECKPOINT OUT_JSON.

The engine is made with the rollout worker's options. A second round continues the
first sample, as a multi-turn session does, so its prompt comes mostly from the prefix
cache. A third samples at a temperature above 1, as a run that explores does.
"""

import json
import sys
from pathlib import Path

PROMPTS = [
    "<|im_start|>user\n12+30=<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nreverse the string abcdef<|im_end|>\n<|im_start|>assistant\n",
    "hi",
]
HOT = 1.5


def main() -> None:
    from vllm import LLM, SamplingParams

    from rlfleet.rollout import vllm_experts
    from rlfleet.rollout.worker import engine_options

    llm = LLM(
        model=sys.argv[1],
        dtype="bfloat16",
        max_model_len=256,
        enforce_eager=True,
        seed=0,
        enable_prefix_caching=True,
        block_size=32,
        **engine_options(),
    )
    layers = vllm_experts.start(llm)
    params = SamplingParams(n=2, max_tokens=20, min_tokens=5, logprobs=0, seed=3)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)

    def sample(request, completion, routed) -> dict:
        return {
            "tokens": list(request.prompt_token_ids) + list(completion.token_ids),
            "prompt_len": len(request.prompt_token_ids),
            "logprobs": [
                e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs, strict=True)
            ],
            "experts": routed.tolist(),
            "cached": request.num_cached_tokens or 0,
        }

    samples = [
        sample(request, completion, routed)
        for request, experts in zip(outputs, vllm_experts.take(llm, outputs), strict=True)
        for completion, routed in zip(request.outputs, experts, strict=True)
    ]
    turn = samples[0]["tokens"] + list(range(40, 60))
    params = SamplingParams(max_tokens=10, min_tokens=5, logprobs=0, seed=4)
    again = llm.generate([{"prompt_token_ids": turn}], params, use_tqdm=False)
    continued = sample(again[0], again[0].outputs[0], vllm_experts.take(llm, again)[0][0])
    params = SamplingParams(max_tokens=20, logprobs=0, seed=5, temperature=HOT)
    hot = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    tempered = sample(hot[0], hot[0].outputs[0], vllm_experts.take(llm, hot)[0][0])
    Path(sys.argv[2]).write_text(
        json.dumps(
            {
                "layers": layers,
                "samples": samples,
                "continued": continued,
                "hot": {"temperature": HOT, "sample": tempered},
            }
        )
    )


if __name__ == "__main__":
    main()
