"""Rollout benchmark: multi-turn sessions through the worker's vLLM engine vs Hugging Face.

64 concurrent sessions of 5 turns on the tiny MoE: every session shares the system
prompt, each turn generates a varied number of tokens (exact, 16-112) and appends an
observation, so each turn's prompt is the last one grown. The worker's engine serves
them continuously with prefix caching; the baseline runs the same sessions through
Hugging Face `generate`, batched per turn (the batch waits for its longest member),
same model and dtype, in the same run. Only the tokens sessions asked for are counted.
The harness path: the same sessions as chat messages through the worker's episode
endpoint (an OpenAI client per episode, the chat template rendering every call, each
call captured) against the direct loop on token ids, on one engine in the same run.
Also: a sandbox's start-up until its server answers, and tool-call round trips.
Prints one JSON object; `--quick` runs the same at the smallest sizes, to check the script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from rlfleet.launch.caches import own_temporary_caches
from rlfleet.rollout.environment.session import request_seed, sampling, user_turn_text

SESSIONS = 64
TURNS = 5
WARMUP_SESSIONS = 8
SANDBOXES = 20  # started one after another, each timed
READS = 10  # tool calls timed in each
# --quick: every part still runs (the engine's continuous batching needs several sessions).
QUICK = {"SESSIONS": 4, "TURNS": 2, "WARMUP_SESSIONS": 2, "SANDBOXES": 2, "READS": 2}
SYSTEM = "<|im_start|>system\nYou are a careful agent. " + "Rules apply. " * 20 + "<|im_end|>\n"


def plan(seed: int = 0) -> tuple[list[str], list[list[int]]]:
    rng = random.Random(seed)
    prompts = [
        f"{SYSTEM}<|im_start|>user\nTask {i}: {rng.randint(0, 10**6)}<|im_end|>\n"
        "<|im_start|>assistant\n"
        for i in range(SESSIONS)
    ]
    lengths = [[rng.randint(16, 112) for _ in range(TURNS)] for _ in range(SESSIONS)]
    return prompts, lengths


def observation(turn: int) -> str:
    return "<|im_end|>\n" + user_turn_text(f"exit code 0\nresult of step {turn}")


async def on_the_engine(model: Path) -> dict:
    """The engine's parts, on one engine made as the worker makes it."""
    from rlfleet.launch.settings import WorkerConfig
    from rlfleet.rollout.engine.driver import Engine
    from rlfleet.rollout.worker.loop import make_llm

    config = WorkerConfig(run="bench", nats_url="", model=str(model), max_model_len=2048)
    engine = Engine(make_llm(config), follow_weights=False)
    await engine.start()
    try:
        return await vllm_sessions(engine) | await harness_vs_direct(engine)
    finally:
        await engine.close()


async def vllm_sessions(engine) -> dict:
    from vllm import SamplingParams

    prompts, lengths = plan()

    async def session(index: int) -> None:
        context = engine.encode(prompts[index])  # as the worker's sessions encode
        for turn, length in enumerate(lengths[index]):
            params = SamplingParams(max_tokens=length, min_tokens=length, temperature=1.0)
            completion = await engine.generate(context, params)
            context += completion.token_ids
            context += engine.encode(observation(turn))

    await asyncio.gather(*(session(i) for i in range(WARMUP_SESSIONS)))
    before = engine.stats.generated_tokens, engine.stats.cached_tokens, engine.stats.prompt_tokens
    started = time.perf_counter()
    await asyncio.gather(*(session(i) for i in range(SESSIONS)))
    seconds = time.perf_counter() - started
    generated = engine.stats.generated_tokens - before[0]
    cached = engine.stats.cached_tokens - before[1]
    prompt = engine.stats.prompt_tokens - before[2]
    return {
        "vllm_tokens_per_s": generated / seconds,
        "vllm_seconds": seconds,
        "generated_tokens": generated,
        "prefix_cache_hit_fraction": cached / prompt,
    }


def _messages(index: int) -> list[dict]:
    system = SYSTEM.removeprefix("<|im_start|>system\n").removesuffix("<|im_end|>\n")
    # Another task than the direct loop's: neither is served from the other's cache.
    task = plan()[0][index].split("<|im_start|>user\n")[1].split("<|im_end|>")[0] + " again"
    return [{"role": "system", "content": system}, {"role": "user", "content": task}]


async def _direct(engine, temperature: float, index: int, lengths: list[int]) -> None:
    """A session on token ids, as the agent environment drives the engine: each call with
    the sampling settings the endpoint gives the same call (`session.sampling`, seeded per
    call), so that the two differ by the endpoint alone."""
    context = engine.encode(plan()[0][index])
    for turn, length in enumerate(lengths):
        params = sampling(length, temperature, [], request_seed(index, turn))
        completion = await engine.generate(context, params)
        context += completion.token_ids + engine.encode(observation(turn))


async def _through_endpoint(endpoint, index: int, lengths: list[int]) -> int:
    """The same session as an OpenAI-SDK harness plays it; its resegmented calls."""
    capture = endpoint.open(seed=index)
    client = endpoint.client(capture)  # as a Harness's
    messages = _messages(index)
    try:
        for turn, length in enumerate(lengths):
            reply = await client.chat.completions.create(
                model="bench", messages=messages, max_tokens=length
            )
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            messages.append({"role": "user", "content": f"exit code 0\nresult of step {turn}"})
    finally:
        endpoint.close_episode(capture)
    return capture.resegmented


async def harness_vs_direct(engine) -> dict:
    from rlfleet.launch.settings import SessionConfig
    from rlfleet.rollout.environment.endpoint import Endpoint

    session = SessionConfig(max_turns=TURNS, turn_tokens=112, context_tokens=2048)
    endpoint = Endpoint(engine, session, "hermes", "bench")
    await endpoint.start()
    lengths = plan()[1]

    async def timed(play, count: int = SESSIONS) -> tuple[float, list]:
        before, started = engine.stats.generated_tokens, time.perf_counter()
        outcomes = await asyncio.gather(
            *(play(i, lengths[i]) for i in range(count)), return_exceptions=True
        )
        return (engine.stats.generated_tokens - before) / (time.perf_counter() - started), outcomes

    try:
        await timed(lambda i, turns: _through_endpoint(endpoint, i, turns), WARMUP_SESSIONS)
        direct, _ = await timed(lambda i, turns: _direct(engine, session.temperature, i, turns))
        harness, outcomes = await timed(lambda i, turns: _through_endpoint(endpoint, i, turns))
    finally:
        await endpoint.close()
    failed: dict[str, int] = {}
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            failed[type(outcome).__name__] = failed.get(type(outcome).__name__, 0) + 1
    return {
        "direct_tokens_per_s": direct,
        "harness_tokens_per_s": harness,
        "harness_vs_direct": harness / direct,
        "resegmented_calls": sum(o for o in outcomes if isinstance(o, int)),
        "episodes_failed": failed,
    }


def hf_sessions(model: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    prompts, lengths = plan()
    pad = tokenizer.pad_token_id

    def run(count: int) -> tuple[int, float]:
        contexts = [tokenizer.encode(p, add_special_tokens=False) for p in prompts[:count]]
        generated = 0
        started = time.perf_counter()
        for turn in range(TURNS):
            wanted = [lengths[i][turn] for i in range(count)]
            width = max(map(len, contexts))
            ids = torch.tensor([[pad] * (width - len(c)) + c for c in contexts])
            mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
            with torch.no_grad():
                out = hf.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=max(wanted),
                    min_new_tokens=max(wanted),
                    do_sample=True,
                    temperature=1.0,
                    pad_token_id=pad,
                )
            for i in range(count):
                new = out[i, width : width + wanted[i]].tolist()
                contexts[i] = contexts[i] + new
                contexts[i] += tokenizer.encode(observation(turn), add_special_tokens=False)
                generated += len(new)
        return generated, time.perf_counter() - started

    run(WARMUP_SESSIONS)
    generated, seconds = run(SESSIONS)
    return {"hf_tokens_per_s": generated / seconds, "hf_seconds": seconds}


async def sandbox_latency() -> dict:
    from rlfleet.rollout.environment.envclient import local_pool

    with tempfile.TemporaryDirectory() as start:
        (Path(start) / "notes.txt").write_text("hello\n")
        async with local_pool(max_sessions=4, warm=2) as pool:
            starts, reads, runs = await _sandbox_calls(pool, Path(start))
    return {
        "sandbox_claim_ms": 1000 * statistics.median(starts),
        "tool_rtt_ms": 1000 * statistics.median(reads),
        "tool_run_rtt_ms": 1000 * statistics.median(runs),
    }


async def _sandbox_calls(pool, start: Path) -> tuple[list, list, list]:
    starts, reads, runs = [], [], []
    for _ in range(SANDBOXES):
        began = time.perf_counter()
        async with await pool.create(start) as sandbox:
            await sandbox.call({"tool": "read", "path": "notes.txt"})
            starts.append(time.perf_counter() - began)
            for _ in range(READS):
                began = time.perf_counter()
                await sandbox.call({"tool": "read", "path": "notes.txt"})
                reads.append(time.perf_counter() - began)
            began = time.perf_counter()
            await sandbox.call({"tool": "run", "command": "echo hi"})
            runs.append(time.perf_counter() - began)
    return starts, reads, runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smallest sizes: check the script")
    if parser.parse_args().quick:
        globals().update(QUICK)
    own_temporary_caches("rlfleet-bench-rollout-caches-")  # this invocation's, removed after
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the JSON alone
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from rlfleet.models.tiny import init_model

    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-rollout-") as root:
        model = init_model("tiny-moe", Path(root) / "tiny-moe")
        result = {"bench": "rollout", "sessions": SESSIONS, "turns": TURNS}
        result |= asyncio.run(on_the_engine(model))
        result |= hf_sessions(model)
        result["vllm_vs_hf"] = result["vllm_tokens_per_s"] / result["hf_tokens_per_s"]
        result |= asyncio.run(sandbox_latency())
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
