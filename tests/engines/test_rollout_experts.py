"""Routed experts recorded inside real vLLM workers line up with the tokens they routed."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from router_agreement import agreement, trainer_model

from rlfleet.api.wire import Segment, Trajectory
from rlfleet.rollout.engine import vllm_experts
from rlfleet.trainer.scoring import Batch, token_logprobs
from rlfleet.trainer.validation import ModelShape, problem


def test_vllm_reports_the_experts_of_every_token_it_ran(tiny_moe: Path, vllm_probe: dict) -> None:
    report = vllm_probe["experts"]
    assert report["layers"] == 2
    samples = report["samples"]
    assert len(samples) == 6
    # A continuation reuses the first sample's KV blocks; the experts of the tokens it
    # did not run come from the recorder's mirror of the cache and match the first run.
    continued = report["continued"]
    cached = continued["cached"]
    assert cached >= 32
    assert continued["experts"][:cached] == samples[0]["experts"][:cached]
    samples = [*samples, continued]
    for s in samples:
        experts = np.array(s["experts"])
        # One row per token run through the model: all but the last, which was only sampled.
        assert experts.shape == (len(s["tokens"]) - 1, 2, 2)
        assert experts.min() >= 0 and experts.max() < 8
        assert (experts[..., 0] != experts[..., 1]).all()

    # The rows belong to the right tokens: the trainer's own router (fp32) agrees with
    # them almost everywhere; rows shifted or swapped between requests would agree on ~4%.
    model = trainer_model(tiny_moe)
    reported = [(s["tokens"], np.array(s["experts"])) for s in samples]
    assert min(agreement(model, reported)) > 0.9, agreement(model, reported)

    # The engine's log-probs are what the trainer's off-policy correction divides by: they
    # are of the distribution the tokens were sampled from, temperature included, and the
    # trainer scored at the same temperature with the same routing agrees with them.
    def gap(s: dict, temperature: float) -> float:
        one = Batch.of([torch.tensor(s["tokens"])], [torch.tensor(s["experts"])])
        with torch.no_grad():
            scored = token_logprobs(model, one, tiled=True, replay=True, temperature=temperature)[
                0, s["prompt_len"] - 1 :
            ]
        return float((scored - torch.tensor(s["logprobs"])).abs().mean())

    hot, temperature = report["hot"]["sample"], report["hot"]["temperature"]
    hot_gap = gap(hot, temperature)
    assert gap(samples[0], 1.0) < 0.02
    assert hot_gap < 0.02
    assert gap(hot, 1.0) > 4 * hot_gap

    # And they make trajectories the trainer accepts for router replay.
    s = samples[0]
    generated = len(s["tokens"]) - s["prompt_len"]
    trajectory = Trajectory(
        run="r",
        task_id="t",
        group_id="g",
        group_size=1,
        attempt=0,
        reward=1.0,
        reward_breakdown={},
        segments=[
            Segment(
                tokens=s["tokens"],
                prompt_len=s["prompt_len"],
                generated=[1] * generated,
                logprobs=s["logprobs"],
                versions=[0] * generated,
                routed_experts=np.array(s["experts"], dtype="<u2").tobytes(),
                moe_layers=2,
                top_k=2,
            )
        ],
        worker="w",
        created_at=time.time(),
    )
    shape = ModelShape(vocab_size=320, moe_layers=2, num_experts=8, top_k=2)
    assert problem(trajectory, shape, "r", needs_experts=True) is None


def _step(new: list[str] = (), finished: list[str] = ()) -> SimpleNamespace:
    """A scheduler's output as the recorder reads it: requests new to the step, none
    resumed, and those finished since the last step."""
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=([0],), num_computed_tokens=0) for r in new
        ],
        scheduled_cached_reqs=cached,
        finished_req_ids=set(finished),
    )


def test_records_nobody_takes_are_dropped_past_a_bound(monkeypatch) -> None:
    # A production server records every request its engine runs, and takes only the
    # completions it captures: others' records (another endpoint's, aborted ones) must
    # not pile up for as long as the server runs.
    monkeypatch.setattr(vllm_experts, "KEEP_FINISHED", 3)
    recorder = vllm_experts._Recorder(layers=2, block_size=16)
    recorder.track(_step(new=[f"chatcmpl-{i}-abcd1234" for i in range(5)]))
    assert len(recorder.requests) == 5  # running: kept however many
    recorder.track(_step(finished=[f"chatcmpl-{i}-abcd1234" for i in range(4)]))
    assert list(recorder.requests) == ["chatcmpl-4-abcd1234"]
    assert len(recorder.finished) == 3  # one step's finished, kept for a take
    recorder.track(_step(finished=["chatcmpl-4-abcd1234"]))
    assert len(recorder.finished) == 3 and "chatcmpl-4-abcd1234" in recorder.finished
