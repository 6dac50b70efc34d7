"""pass@k against hand-computed values and a brute-force count over every k-subset."""

import itertools
import math
from fractions import Fraction

import pytest

from megatron_grpo.eval.pass_at_k import mean_pass_at_k, pass_at_k


def brute_force(n: int, c: int, k: int) -> Fraction:
    """The fraction of k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize(
    "n, c, k",
    [(n, c, k) for n in range(1, 9) for c in range(n + 1) for k in range(1, n + 1)],
)
def test_matches_brute_force(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(float(brute_force(n, c, k)), abs=1e-12)


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (4, 1, 1, 0.25),  # pass@1 is the fraction correct
        (10, 3, 1, 0.3),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (6, 0, 3, 0.0),
        (6, 4, 3, 1.0),  # n - c < k: every subset holds a correct one
    ],
)
def test_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def test_stable_where_the_binomials_overflow_a_float():
    n, c, k = 2000, 3, 500  # C(2000, 500) is about 10^486
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


def test_mean_over_problems():
    assert mean_pass_at_k([0, 2, 5], n=5, k=2) == pytest.approx((0.0 + 0.7 + 1.0) / 3)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="n=4, c=5, k=1"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="at least one problem"):
        mean_pass_at_k([], n=4, k=1)
