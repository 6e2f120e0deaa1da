"""k-means initialisation: k-means++ seeding and its effect on imbalanced mixtures."""

import faiss
import numpy as np
import pytest
import torch
from sklearn.datasets import make_blobs

from deepdpm_core import DeepDPM
from deepdpm_core.bayes import linalg
from deepdpm_core.config import InitConfig
from deepdpm_core.data import make_mixture
from deepdpm_core.moves.initial import (
    initial_cluster_count,
    initial_clusters,
    kmeans_centers,
    nearest_center,
)
from deepdpm_core.moves.kmeans_pp import PP_SEQUENTIAL_SEEDS, kmeans_pp_seeds
from deepdpm_core.runtime.communicator import LocalCommunicator


def test_second_seed_follows_the_d2_distribution():
    # first seed uniform, second drawn with probability d(x_j, seed)^2 / sum_l d(x_l, seed)^2:
    # P(second = j) = (1/n) sum_i d_ij^2 / sum_l d_il^2, compared with 6000 draws
    x = np.array([[0.0], [1.0], [3.0], [7.0], [15.0]], dtype=np.float32)
    d2 = (x - x.T) ** 2
    exact = (d2 / d2.sum(1, keepdims=True)).mean(0)
    rng = np.random.default_rng(0)
    draws = 6000
    seconds = [float(kmeans_pp_seeds(x, 2, rng)[1, 0]) for _ in range(draws)]
    freq = np.array([seconds.count(float(v)) for v in x[:, 0]]) / draws
    sigma = np.sqrt(exact * (1 - exact) / draws)
    assert np.all(np.abs(freq - exact) < 4 * sigma + 1e-12), (freq, exact)


def test_a_seed_drawn_in_a_block_follows_the_d2_distribution():
    # drawn in blocks from the second seed on: the third is proposed by its distance to the
    # first alone and kept by its distance to both, P(third = j) = E[min(d_1j, d_2j)^2 / sum]
    x = np.array([[0.0], [1.0], [3.0], [7.0], [15.0]], dtype=np.float32)
    d2 = (x - x.T) ** 2
    exact = np.zeros(5)
    for a in range(5):
        for b in range(5):
            p_b = d2[a, b] / d2[a].sum()
            near = np.minimum(d2[a], d2[b])
            exact += p_b * near / near.sum() / 5
    rng = np.random.default_rng(0)
    draws = 6000
    thirds = [float(kmeans_pp_seeds(x, 3, rng, sequential=1)[2, 0]) for _ in range(draws)]
    freq = np.array([thirds.count(float(v)) for v in x[:, 0]]) / draws
    sigma = np.sqrt(exact * (1 - exact) / draws)
    assert np.all(np.abs(freq - exact) < 4 * sigma + 1e-12), (freq, exact)


@pytest.mark.parametrize("sequential", [PP_SEQUENTIAL_SEEDS, 1])
def test_seeds_are_distinct_rows_reproducible_and_survive_duplicates(sequential):
    x = np.random.default_rng(1).normal(size=(500, 6)).astype(np.float32)
    a = kmeans_pp_seeds(x, 200, np.random.default_rng(3), sequential)
    b = kmeans_pp_seeds(x, 200, np.random.default_rng(3), sequential)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (200, 6) and len(np.unique(a, axis=0)) == 200  # D² never redraws a seed
    assert all((x == row).all(1).any() for row in a)
    # two distinct rows, five seeds: the rest are drawn uniformly instead of failing
    twins = np.repeat(np.eye(2, dtype=np.float32), 50, axis=0)
    assert kmeans_pp_seeds(twins, 5, np.random.default_rng(0), sequential).shape == (5, 2)


def _pp_seeds_brute_force(x: np.ndarray, n_clusters: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ as written in the paper: every row's distance to every new seed."""
    chosen, d2 = [int(rng.integers(len(x)))], np.full(len(x), np.inf)
    for _ in range(n_clusters - 1):
        d2 = np.minimum(d2, ((x - x[chosen[-1]]) ** 2).sum(1))
        cum = np.cumsum(d2)
        chosen.append(min(int(np.searchsorted(cum, cum[-1] * rng.random(), side="right")), len(x) - 1))
    return x[chosen]


def test_seeds_ruled_out_by_the_triangle_inequality_are_those_of_brute_force():
    # 100 tight groups on an integer lattice: the distances are exact in float32, so the
    # rows a new seed is not measured against may change no draw; all the seeds drawn one
    # by one, most of them placed where few rows can come nearer
    rng = np.random.default_rng(0)
    centres = rng.integers(-40, 40, size=(100, 5)) * 10
    x = (centres[rng.integers(100, size=3000)] + rng.integers(-2, 3, size=(3000, 5))).astype(np.float32)
    np.testing.assert_array_equal(kmeans_pp_seeds(x, PP_SEQUENTIAL_SEEDS, np.random.default_rng(7)),
                                  _pp_seeds_brute_force(x, PP_SEQUENTIAL_SEEDS, np.random.default_rng(7)))


def _covered(x: np.ndarray, y: np.ndarray, centers: np.ndarray) -> int:
    """True clusters that are the majority of some centre's Voronoi cell."""
    index = faiss.IndexFlatL2(x.shape[1])
    index.add(centers)
    z = index.search(x, 1)[1][:, 0]
    return len({int(np.bincount(y[z == k]).argmax()) for k in np.unique(z)})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kmeans_pp_covers_more_true_clusters_of_an_imbalanced_mixture(seed):
    # 50 Gaussians with weights down to 0.2 %: from FAISS's uniformly drawn seeds k-means
    # gives 35-38 of them a centre, from k-means++ seeds 45 (measured, seeds 0-2)
    x, y = make_mixture(20000, 32, 50, imbalance=1.0, min_weight=0.1 / 50, random_state=0)
    x = x.astype(np.float32)
    pp = _covered(x, y, kmeans_centers(x, 50, 25, 200_000, np.random.default_rng(seed), "kmeans++"))
    uniform = _covered(x, y, kmeans_centers(x, 50, 25, 200_000, np.random.default_rng(seed), "random"))
    assert pp >= 43 and pp >= uniform + 4, (pp, uniform)


@pytest.mark.parametrize("seeding", ["kmeans++", "random"])
def test_kmeans_in_few_features_runs_on_zero_padded_rows_with_the_same_centres(seeding):
    """Rows of fewer than FAISS_MIN_DIM features are padded with zero columns for FAISS (a
    faster search, the same distances): the centres are those of FAISS on the rows as they
    are, from the same seeds."""
    x = make_blobs(3000, n_features=2, centers=40, random_state=0)[0].astype(np.float32)
    got = kmeans_centers(x, 60, 25, 200_000, np.random.default_rng(4), seeding)
    rng = np.random.default_rng(4)
    km = faiss.Kmeans(2, 60, niter=25, seed=int(rng.integers(1, 2**31 - 1)), max_points_per_centroid=51,
                      min_points_per_centroid=1, verbose=False)
    km.train(x, init_centroids=kmeans_pp_seeds(x, 60, rng) if seeding == "kmeans++" else None)
    assert got.shape == (60, 2) and got.flags.c_contiguous
    np.testing.assert_allclose(got, km.centroids, rtol=1e-5, atol=1e-5)


def test_auto_initial_k_is_ten_clusters_of_ten_rows_at_least_and_one_per_thousand_rows_past_exact_em():
    exact = 100_000  # small_data.max_rows: exact EM, whose growth adds what 10 clusters hold together
    assert [initial_cluster_count("auto", n, exact) for n in (1, 9, 20, 99, 100, 10_999)] == [1, 1, 2, 9, 10, 10]
    assert [initial_cluster_count("auto", n, exact) for n in (19_999, 70_000, 100_000)] == [10, 10, 10]
    # the minibatch search has no growth: one cluster per 1,000 rows
    assert [initial_cluster_count("auto", n, exact) for n in (100_001, 1_281_167)] == [100, 1281]
    assert [initial_cluster_count("auto", n, 0) for n in (99, 19_999, 70_000)] == [9, 19, 70]
    # exact EM at every N (the default): 10 clusters, growth adds what they hold together
    assert [initial_cluster_count("auto", n, None) for n in (70_000, 200_000, 1_281_167)] == [10, 10, 10]
    assert initial_cluster_count(3, 10**6, exact) == 3 and initial_cluster_count(1, 5, exact) == 1
    assert [InitConfig(n_clusters=k).rows_needed for k in ("auto", 30, 1)] == [2, 30, 2]


@pytest.mark.slow
def test_more_dimensions_than_points_per_cluster_are_not_one_cluster():
    """4 blobs in 256-D, 150 points each: from K = 1 the prior fitted to the one cluster
    takes the spread between the blobs for theirs and no split is accepted (K = 1); the
    default start (10 k-means clusters, merged down) finds the 4."""
    X, y = make_blobs(n_samples=600, centers=4, n_features=256, random_state=0)
    model = DeepDPM(random_state=0).fit(X)
    assert model.n_clusters_ == 4
    assert (np.bincount(model.labels_) == 150).all()



def _init_recording_kmeans(monkeypatch, n: int, k: int) -> tuple[list[int], list[np.ndarray], np.ndarray, np.ndarray]:
    """initial_clusters (defaults, seed 0) on n standard normal rows in 2-D with k clusters:
    the rows FAISS's k-means saw and its centres in the rows' 2 features (FAISS sees them
    with zero columns appended, which stay zero), each time it ran; the data; the labels."""
    rows, centers = [], []
    train = faiss.Kmeans.train

    def recording(self, x, *args, **kwargs):
        rows.append(len(x))
        out = train(self, x, *args, **kwargs)
        assert not self.centroids[:, 2:].any()
        centers.append(self.centroids[:, :2].copy())
        return out

    monkeypatch.setattr(faiss.Kmeans, "train", recording)
    x = np.random.default_rng(0).normal(size=(n, 2)).astype(np.float32)
    z, n_init = initial_clusters(torch.from_numpy(x), InitConfig(n_clusters=k), n, [n], LocalCommunicator(),
                                 np.random.default_rng(0))
    assert n_init == k and z.shape == (n,)
    return rows, centers, x, z.numpy()


def test_large_k_start_runs_kmeans_on_a_sample_sized_by_k_and_labels_every_row(monkeypatch):
    # K = 1,000: k-means on 40 sampled rows a cluster, not on all 50,000 rows
    rows, centers, x, z = _init_recording_kmeans(monkeypatch, 50_000, 1000)
    assert rows == [40_000]
    # and every row, sampled or not, goes to its nearest centre
    for s in range(0, len(x), 10_000):
        d2 = ((x[s : s + 10_000, None, :] - centers[0][None]) ** 2).sum(-1)
        np.testing.assert_allclose(d2[np.arange(len(d2)), z[s : s + 10_000]], d2.min(1), rtol=1e-4, atol=1e-6)


def test_the_nearest_centre_in_blocks_of_rows_is_that_of_all_rows_at_once(monkeypatch):
    """On a CPU :func:`nearest_center` takes blocks of rows (:func:`~deepdpm_core.bayes.cache_blocks`):
    the same labels as one pass over every row, the last block short."""
    gen = torch.Generator().manual_seed(0)
    x, centers = torch.randn(1000, 6, generator=gen), torch.randn(37, 6, generator=gen)
    whole = nearest_center(x, centers, chunk=len(x))
    monkeypatch.setattr(linalg, "CACHE_FLOATS", 37 * 64)  # blocks of 64 rows
    assert torch.equal(nearest_center(x, centers), whole)
    d2 = torch.cdist(x.double(), centers.double())
    assert torch.equal(d2.argmin(1), whole)


def test_start_up_to_200_clusters_is_k_means_on_all_rows_as_before(monkeypatch):
    # up to K = 200 and 200,000 rows the sample sized by K is every row: the same start,
    # label for label, as k-means++ and FAISS on all rows
    rows, _, x, z = _init_recording_kmeans(monkeypatch, 60_000, 150)
    assert rows == [60_000]
    reference = kmeans_centers(x, 150, 25, 200_000, np.random.default_rng(0), "kmeans++")
    np.testing.assert_array_equal(z, nearest_center(torch.from_numpy(x), torch.from_numpy(reference)).numpy())
