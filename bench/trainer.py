"""Benchmark: the trainer's batch-invariant kernels, step throughput, and router replay.

Prints one JSON object; ratios compare numbers measured in this same run.

- `invariant_overhead`: seconds per training step (forward, backward, optimiser step
  through DeepSpeed) with batch-invariant kernels over the same with default kernels,
  on the same batch of the tiny MoE. `train_tokens_per_s` is tokens per second of that
  step in batch-invariant mode (the production default), `default_tokens_per_s` without.
- `mismatch_*`: real vLLM (CPU, bf16) samples completions and reports each token's
  log-prob and the experts it routed to; the trainer (fp32 master weights) scores the
  same tokens with router replay and without. `mismatch_kl_*` is the k3 estimate of
  KL(vLLM || trainer) per generated token, `mismatch_abs_*` the mean |delta log-prob|,
  `routing_agreement` the share of (token, layer) expert sets the trainer's own router
  picks identically.
- `prompt_sharing_speedup`: seconds per training step on a GRPO-shaped batch (8 groups of
  16 attempts at one 48-token prompt, answers of 2 to 9 tokens, the demo's shape) scored
  with each sequence whole over the same scored with each group's prompt run once.

`--quick` runs all of it at the smallest sizes (vLLM and DeepSpeed still start), to check
the script.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlfleet.launch.caches import own_temporary_caches

SAMPLE_PROMPTS = 16
SAMPLE_N = 4
SAMPLE_TOKENS = 48
LONG_ANSWERS = 32
GROUPS, GROUP_SIZE = 8, 16  # the demo's batch
TIMED_STEPS = 5  # after a warm-up step
QUICK = {
    "SAMPLE_PROMPTS": 2,
    "SAMPLE_N": 2,
    "SAMPLE_TOKENS": 8,
    "LONG_ANSWERS": 4,
    "GROUPS": 2,
    "GROUP_SIZE": 4,
    "TIMED_STEPS": 1,
}


def sample_with_vllm(model: Path, out: Path) -> None:
    """Runs in a child process: vLLM samples and records log-probs and routed experts."""
    from vllm import LLM, SamplingParams

    from rlfleet.rollout.engine import vllm_experts
    from rlfleet.weightsync import vllm_options

    llm = LLM(
        model=str(model),
        dtype="bfloat16",
        max_model_len=512,
        enforce_eager=True,
        seed=0,
        # Cached prompt tokens are not run, so their experts would not be recorded.
        enable_prefix_caching=False,
        **vllm_options(worker_extension=vllm_experts.EXTENSION),
    )
    vllm_experts.start(llm)
    prompts = [
        f"<|im_start|>user\nTask {i}: add {i * 7} and {i * 13}.<|im_end|>\n<|im_start|>assistant\n"
        for i in range(SAMPLE_PROMPTS)
    ]
    params = SamplingParams(
        n=SAMPLE_N, max_tokens=SAMPLE_TOKENS, min_tokens=SAMPLE_TOKENS, logprobs=0, seed=0
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    samples = []
    for request, experts in zip(outputs, vllm_experts.take(llm, outputs), strict=True):
        for completion, routed in zip(request.outputs, experts, strict=True):
            samples.append(
                {
                    "tokens": list(request.prompt_token_ids) + list(completion.token_ids),
                    "prompt_len": len(request.prompt_token_ids),
                    "logprobs": [
                        e[t].logprob
                        for t, e in zip(completion.token_ids, completion.logprobs, strict=True)
                    ],
                    "experts": routed.tolist(),
                }
            )
    out.write_text(json.dumps(samples))


def mismatch(model_dir: Path, samples: list[dict]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from rlfleet.trainer.objective import Mismatch
    from rlfleet.trainer.scoring import Batch, prepare, token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prepare(model, tiled=True).eval()
    batch = Batch.of(
        [torch.tensor(s["tokens"]) for s in samples],
        [torch.tensor(s["experts"]) for s in samples],
    )
    behaviour = torch.zeros(batch.targets.shape)
    mask = torch.zeros_like(behaviour)
    for row, s in enumerate(samples):
        span = slice(s["prompt_len"] - 1, len(s["tokens"]) - 1)
        behaviour[row, span] = torch.tensor(s["logprobs"])
        mask[row, span] = 1
    result = {}
    own: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda mod, args, out: own.append(out[2].clone()))
        for name, m in model.named_modules()
        if name.endswith("mlp.gate")
    ]
    with torch.no_grad():
        for replay in (True, False):
            own.clear()
            trainer = token_logprobs(model, batch, tiled=True, replay=replay)
            found = Mismatch.of(trainer, behaviour, mask)
            key = "replay" if replay else "no_replay"
            result[f"mismatch_kl_{key}"] = found.kl
            result[f"mismatch_abs_{key}"] = found.mean_abs
            result[f"mismatch_max_abs_{key}"] = found.max_abs
    for hook in hooks:
        hook.remove()
    # The last pass routed by the trainer's own top-k: how often did it agree with vLLM?
    real = batch.real.reshape(-1)
    agree = []
    for layer, chosen in enumerate(own):
        reported = batch.experts[:, :, layer].reshape(-1, chosen.shape[-1])
        same = (chosen.sort(-1).values == reported.sort(-1).values).all(-1)
        agree.append(same[real].float().mean())
    result["routing_agreement"] = float(torch.stack(agree).mean())
    return result


def _segment(tokens: list[int], prompt: int, gen: torch.Generator):
    from rlfleet.api.wire import Segment

    answer = len(tokens) - prompt
    experts = torch.randint(0, 8, ((len(tokens) - 1) * 4,), generator=gen)
    return Segment(
        tokens=tokens,
        prompt_len=prompt,
        generated=[1] * answer,
        logprobs=[-2.0] * answer,
        versions=[0] * answer,
        routed_experts=experts.to(torch.int16).numpy().astype("<u2").tobytes(),
        moe_layers=2,
        top_k=2,
    )


def _long_answers(gen: torch.Generator) -> list:
    """`LONG_ANSWERS` sequences of 64 to 256 tokens, each its own prompt."""
    segments = []
    for _ in range(LONG_ANSWERS):
        n = int(torch.randint(64, 257, (1,), generator=gen))
        tokens = torch.randint(0, 256, (n,), generator=gen).tolist()
        segments.append((_segment(tokens, 32, gen), float(torch.randn(1, generator=gen))))
    return segments


def _grpo_groups(gen: torch.Generator) -> list:
    """`GROUPS` groups of `GROUP_SIZE` short answers to one 48-token prompt each."""
    segments = []
    for _ in range(GROUPS):
        prompt = torch.randint(0, 256, (48,), generator=gen).tolist()
        for _ in range(GROUP_SIZE):
            answer = torch.randint(0, 256, (int(torch.randint(2, 10, (1,), generator=gen)),))
            tokens = prompt + answer.tolist()
            segments.append((_segment(tokens, 48, gen), float(torch.randn(1, generator=gen))))
    return segments


def _micro_batches(segments: list, budget: int, share_prompts: bool = True) -> list:
    from rlfleet.trainer.rows import make_rows, routed_experts, split_by_tokens
    from rlfleet.trainer.scoring import Batch

    found = []
    for chunk in split_by_tokens(segments, budget):
        rows = make_rows([s for s, _ in chunk], [a for _, a in chunk], 0)
        if not share_prompts:  # the same rows, each sequence laid out whole
            whole = Batch.of(
                [torch.tensor(s.tokens) for s, _ in chunk], [routed_experts(s) for s, _ in chunk]
            )
            rows = dataclasses.replace(rows, batch=whole)
        found.append(rows)
    return found


def _seconds_per_step(policy, micro_batches) -> float:
    tokens = sum(rows.tokens for rows in micro_batches)
    policy.train_step(micro_batches, tokens)  # warm-up
    runs = []
    for _ in range(TIMED_STEPS):
        started = time.perf_counter()
        policy.train_step(micro_batches, tokens)
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def step_timing(model_dir: Path, work: Path) -> dict[str, float]:
    from rlfleet.launch.settings import TrainerConfig
    from rlfleet.trainer.policy import Policy

    gen = torch.Generator().manual_seed(0)
    long_answers, groups = _long_answers(gen), _grpo_groups(gen)
    tokens = sum(len(s.tokens) for s, _ in long_answers)
    seconds = {}
    for invariant in (True, False):
        config = TrainerConfig(
            run="bench",
            nats_url="nats://unused",
            model=model_dir,
            checkpoint_dir=work / f"ckpt-{invariant}",
            batch_invariant=invariant,
            learning_rate=1e-5,
        )
        policy = Policy(config)
        budget = config.micro_batch_tokens
        seconds[invariant] = _seconds_per_step(policy, _micro_batches(long_answers, budget))
        if invariant:
            shared = _micro_batches(groups, budget)
            whole = _micro_batches(groups, budget, share_prompts=False)
            seconds["shared"] = _seconds_per_step(policy, shared)
            seconds["whole"] = _seconds_per_step(policy, whole)
    return {
        "step_tokens": tokens,
        "invariant_step_s": seconds[True],
        "default_step_s": seconds[False],
        "invariant_overhead": seconds[True] / seconds[False],
        "train_tokens_per_s": tokens / seconds[True],
        "default_tokens_per_s": tokens / seconds[False],
        "grpo_shared_step_s": seconds["shared"],
        "grpo_whole_step_s": seconds["whole"],
        "prompt_sharing_speedup": seconds["whole"] / seconds["shared"],
    }


def main(quick: bool) -> None:
    own_temporary_caches("rlfleet-bench-trainer-caches-")  # this invocation's, removed after
    from rlfleet.models.tiny import init_model

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = init_model("tiny-moe", work / "tiny-moe")
        samples_path = work / "samples.json"
        subprocess.run(
            [sys.executable, __file__, "--sample", str(model), str(samples_path)]
            + (["--quick"] if quick else []),
            check=True,
            env=os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        result = {"benchmark": "trainer", "model": "tiny-moe"}
        result |= mismatch(model, json.loads(samples_path.read_text()))
        result["replay_kl_reduction"] = result["mismatch_kl_no_replay"] / max(
            result["mismatch_kl_replay"], 1e-12
        )
        result |= step_timing(model, work)
    rounded = {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in result.items()}
    print(json.dumps(rounded))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smallest sizes: check the script")
    parser.add_argument("--sample", nargs=2, type=Path, help=argparse.SUPPRESS)  # the vLLM child
    arguments = parser.parse_args()
    if arguments.quick:
        globals().update(QUICK)
    if arguments.sample:
        sample_with_vllm(*arguments.sample)
    else:
        main(arguments.quick)
