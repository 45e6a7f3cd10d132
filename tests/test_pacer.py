"""The pacing of `auto`'s shadow work in the control loop (sidecar/server/pacer.py)."""

from __future__ import annotations

import pytest

from sidecar.server.pacer import Pacer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_saturated_work_gets_its_share_of_the_loop_in_slices():
    clock = Clock()
    pacer = Pacer(share=0.25, slice_seconds=0.001, clock=clock)
    worked = []

    def work(deadline: float) -> bool:  # always more to do: uses its whole slice
        worked.append(deadline - clock.now)
        clock.now = deadline
        return True

    loop_time = 0.0
    for _ in range(2000):
        wait = pacer.run(work)
        assert wait is not None and wait >= 0.0
        step = max(wait, 0.0002)  # the loop waits, or serves requests meanwhile
        clock.now += step
        loop_time += step
    assert max(worked) <= 0.001 + 1e-12
    total = pacer.spent + loop_time
    assert pacer.spent / total == pytest.approx(0.25, abs=0.02)


def test_nothing_left_lets_the_loop_wait_and_a_spent_budget_says_how_long():
    clock = Clock()
    pacer = Pacer(share=0.5, slice_seconds=0.002, clock=clock)
    assert pacer.run(lambda deadline: False) is None

    def overrun(deadline: float) -> bool:  # one chain runs past the slice
        clock.now = deadline + 0.001
        return True

    wait = pacer.run(overrun)  # the budget is 1 ms short: 3 ms to a whole slice at rate 1
    assert wait == pytest.approx(0.003)
    calls = []
    assert pacer.run(lambda d: calls.append(d) or True) == pytest.approx(0.003)
    assert calls == []  # no budget yet: the work is not called
    clock.now += 0.003
    assert pacer.run(lambda deadline: False) is None  # a whole slice back: it runs


@pytest.mark.parametrize("share, slice_seconds", [(0.0, 0.001), (1.0, 0.001), (0.5, 0.0)])
def test_bad_settings_are_refused(share, slice_seconds):
    with pytest.raises(ValueError):
        Pacer(share=share, slice_seconds=slice_seconds)
