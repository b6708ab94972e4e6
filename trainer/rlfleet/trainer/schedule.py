"""The learning rate over a run, as a fraction of the spec's `learningRate`."""

from __future__ import annotations

import math


def lr_factor(update: int, warmup: int, decay: int, floor: float) -> float:
    """The factor for optimiser update `update` (counted from 0).

    A linear ramp over `warmup` updates: Adam's first updates move every weight by about
    lr whatever the gradient's size, and ramping keeps a policy's first noisy RL steps from
    undoing its warm start. Then a half cosine from 1 down to `floor` over `decay` updates,
    and `floor` after: a run of a known length ends on small steps, so its last version sits
    where the run was heading rather than one full-sized noisy step away (the demo's end
    evaluation spread 0.05 between runs of one recipe at a constant rate). `decay` 0 holds
    1 for good, as an open-ended run wants.
    """
    if update < warmup:
        return (update + 1) / warmup
    if decay == 0:
        return 1.0
    progress = min(1.0, (update - warmup) / decay)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
