"""The unbiased pass@k estimator (Chen et al. 2021, "Evaluating Large Language Models
Trained on Code").

With n samples of a problem of which c are correct, the chance that k of them drawn
without replacement hold at least one correct one is

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n-c+1}^{n} (1 - k / i),

the product form avoiding the huge binomials. A sample counts as correct when its
reward reaches a threshold (1.0 for the 0/1 verifiers).
"""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that k of n samples, c of them correct, include a correct one."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def mean_pass_at_k(num_correct: Sequence[int], n: int, k: int) -> float:
    """pass@k averaged over problems, each with n samples and ``num_correct[j]`` correct."""
    if not num_correct:
        raise ValueError("mean_pass_at_k needs at least one problem")
    return sum(pass_at_k(n, c, k) for c in num_correct) / len(num_correct)
