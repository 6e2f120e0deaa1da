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


def many_blobs(seed: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """40 isotropic blobs of 75 points in 64-D (``make_blobs``, centres in [-10, 10]^64,
    std 1): each of 10 initial k-means clusters holds about 4, and from the default start
    the search settles at 5 clusters before the growth step."""
    from sklearn.datasets import make_blobs

    x, y = make_blobs(n_samples=3000, centers=40, n_features=64, cluster_std=1.0, center_box=(-10, 10),
                      random_state=seed)
    return x.astype(np.float32), y
