"""Generates from a checkpoint with vLLM and writes the tokens and their log-probs as JSON."""

import json
import sys
from pathlib import Path

MAX_TOKENS = 16


def main() -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=512, enforce_eager=True, seed=0)
    prompt = "<|im_start|>user\n12+30=<|im_end|>\n<|im_start|>assistant\n"
    params = SamplingParams(
        max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=0, temperature=1.0, seed=7
    )
    completion = llm.generate([prompt], params)[0].outputs[0]
    logprobs = [
        entry[token].logprob
        for token, entry in zip(completion.token_ids, completion.logprobs, strict=True)
    ]
    Path(sys.argv[2]).write_text(
        json.dumps(
            {
                "token_ids": list(completion.token_ids),
                "logprobs": logprobs,
                "max_tokens": MAX_TOKENS,
            }
        )
    )


if __name__ == "__main__":
    main()
