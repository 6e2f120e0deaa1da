"""Generated labelled blobs shared by several tests."""

import numpy as np


def grid_blobs(side: int, per: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """side² isotropic 2-D blobs of ``per`` points on a jittered grid of pitch 10, stds
    1.6·U(0.7, 1.3): neighbours ~5 standard deviations apart (bench/k_suite.py's blobs2d-50)."""
    rng = np.random.default_rng(seed)
    k = side * side
    centres = np.array([(i % side, i // side) for i in range(k)], dtype=np.float64) * 10 + rng.normal(size=(k, 2))
    stds = 1.6 * rng.uniform(0.7, 1.3, size=k)
    y = np.repeat(np.arange(k), per)
    return (centres[y] + rng.normal(size=(len(y), 2)) * stds[y, None]).astype(np.float32), y
