"""How often the ranks that wait for the main rank's work look at the store."""

import pytest

from megatron_grpo.train.main_wait import poll_pause


@pytest.mark.parametrize(
    ("waited_s", "pause_s"), [(0.0, 0.002), (0.01, 0.002), (0.2, 0.02), (3.0, 0.3), (60.0, 0.5)]
)
def test_the_pause_is_a_tenth_of_the_wait_within_bounds(waited_s, pause_s):
    assert poll_pause(waited_s) == pytest.approx(pause_s)


def test_a_short_rollout_is_seen_at_most_about_ten_percent_late():
    """Walk the waiter's schedule: for any work length, the first look after the end."""
    for work_s in (0.05, 0.16, 0.3, 1.0, 7.0):
        t = 0.0
        while t < work_s:
            t += poll_pause(t)
        assert t - work_s <= max(0.1 * work_s, 0.002) + 1e-9, work_s


def test_a_long_wait_looks_twice_a_second():
    looks, t = 0, 0.0
    while t < 600.0:
        t += poll_pause(t)
        looks += 1
    assert looks < 1200 + 100  # 600 s at 2 looks a second, plus the short start
