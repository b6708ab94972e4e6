"""The learning rate's schedule (`rlfleet.trainer.schedule`) as a pure function; the
trainer's engine stepping it, across a kill and resume, is `test_trainer_loop`'s."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from rlfleet.trainer.schedule import lr_factor

updates = st.integers(min_value=0, max_value=10_000)
lengths = st.integers(min_value=0, max_value=2_000)
floors = st.floats(min_value=0, max_value=1)


@given(updates, lengths, lengths, floors)
def test_the_rate_rises_through_the_warm_up_and_never_rises_after(
    update: int, warmup: int, decay: int, floor: float
) -> None:
    now, then = lr_factor(update, warmup, decay, floor), lr_factor(update + 1, warmup, decay, floor)
    assert 0 <= now <= 1
    if update + 1 < warmup:
        assert then > now
    elif update >= warmup:
        assert then <= now
        assert now >= floor - 1e-12


@given(lengths, st.integers(min_value=1, max_value=2_000), floors)
def test_the_decay_starts_at_the_full_rate_and_ends_at_the_floor(
    warmup: int, decay: int, floor: float
) -> None:
    assert lr_factor(warmup, warmup, decay, floor) == 1.0
    assert math.isclose(lr_factor(warmup + decay, warmup, decay, floor), floor, abs_tol=1e-12)
    assert math.isclose(lr_factor(warmup + 10 * decay, warmup, decay, floor), floor, abs_tol=1e-12)


@given(updates, lengths, floors)
def test_no_decay_holds_the_full_rate_once_warm(update: int, warmup: int, floor: float) -> None:
    assert lr_factor(warmup + update, warmup, 0, floor) == 1.0
