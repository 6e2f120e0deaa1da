"""The distributed search over real gloo process groups (2 processes, no Ray).

Each test spawns two ranks with ``torch.multiprocessing`` and a file-store rendezvous,
runs :class:`~deepdpm_core.training.search.Search` with :class:`TorchDistCommunicator` and
DDP-wrapped nets, and compares with the same search in this process (W = 1).
"""

from __future__ import annotations

import os
import pickle
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepdpm_core.config import Config, from_dict
from deepdpm_core.training import Search, start_fit
from pipeline.fit.distributed import TorchDistCommunicator, ddp_wrapper, load_rank_rows
from pipeline.io.feature_rows import rank_rows
from tests.support.blobs import grid_blobs, many_blobs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _config(**overrides) -> Config:
    base = {
        "device": "cpu",
        "init": {"n_clusters": 4, "max_points": 700},  # k-means sees a sample of the 1000 rows
        "optim": {"batch_size": 64},
        "schedule": {"max_epochs": 12, "warmup_epochs": 2, "move_every": 2},
        "small_data": {"max_rows": 0},  # the net search (test_small_data_fit_is_the_same_on_two_ranks: EM)
    }
    return from_dict(base).with_overrides(overrides)


def _mixture(n: int = 1001, seed: int = 0) -> np.ndarray:
    """Imbalanced 4-D mixture of 5 Gaussians."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=6.0, size=(5, 4))
    sizes = rng.multinomial(n, [0.4, 0.25, 0.15, 0.12, 0.08])
    return np.concatenate([c + rng.normal(size=(s, 4)) for c, s in zip(centres, sizes, strict=True)]
                          ).astype(np.float32)


# ------------------------------------------------------------------ spawning ranks
def _rank_main(rank: int, world: int, store: str, job, args, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = job(rank, world, *args)
    except BaseException as exc:  # noqa: BLE001 - the parent re-raises it
        result = RuntimeError(f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_ranks(tmp_path: Path, job, *args, world: int = 2) -> list:
    """Run ``job(rank, world, *args)`` on ``world`` gloo ranks; returns each rank's result."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank_main, args=(world, str(tmp_path / "store"), job, args, str(tmp_path)),
             nprocs=world, join=True)
    results = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(world)]
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def _trainer(config: Config, x: np.ndarray, distributed: bool) -> Search:
    if not distributed:
        return start_fit(config, torch.from_numpy(x))
    return start_fit(config, torch.from_numpy(x), comm=TorchDistCommunicator(), wrap=ddp_wrapper())


# ------------------------------------------------------------------------- jobs
def _first_epoch_stats(rank: int, world: int, x: np.ndarray, configs: list[Config]):
    return [_stats_pass(rank, world, x, config) for config in configs]


def _stats_pass(rank: int, world: int, x: np.ndarray, config: Config):
    """Statistics of the first epoch's pass over the data, reduced over ranks."""
    part = x[slice(*rank_rows(len(x), rank, world))]
    search = _trainer(config, part, distributed=world > 1)
    search.initialize()
    comm = search.comm
    calls, sent = getattr(comm, "all_reduce_calls", 0), getattr(comm, "all_reduce_bytes", 0)
    soft, sub, losses = search.run_epoch()
    traffic = (getattr(comm, "all_reduce_calls", 0) - calls, getattr(comm, "all_reduce_bytes", 0) - sent)
    return soft.flat().numpy(), sub.flat().numpy(), losses, search.state.means.numpy(), traffic


def _fit(rank: int, world: int, parts: list[np.ndarray], config: Config):
    search = _trainer(config, parts[rank], distributed=True)
    search.fit()
    search.check_consistency()
    return search.history, search.checksum()


def _diverge(rank: int, world: int, x: np.ndarray, config: Config):
    search = _trainer(config, x[slice(*rank_rows(len(x), rank, world))], distributed=True)
    search.initialize()
    search.step_epoch()
    search.check_consistency()  # identical so far
    if rank == 1:
        search.state.means[0, 0] += 1e-3
    try:
        search.check_consistency()
    except RuntimeError as exc:
        return str(exc)
    return None


def _resume(rank: int, world: int, x: np.ndarray, state: dict, config: Config):
    part = x[slice(*rank_rows(len(x), rank, world))]
    search = start_fit(config, part, comm=TorchDistCommunicator(), wrap=ddp_wrapper(), state=state)
    for _ in range(3):
        search.step_epoch()
    search.check_consistency()
    try:  # other data than the checkpoint's: refused on every rank alike
        start_fit(config, part[: len(part) // 2], comm=TorchDistCommunicator(), state=state)
    except Exception as exc:  # noqa: BLE001
        refused = f"{type(exc).__name__}: {exc}"
    return search.history, search.n_clusters, refused


# ------------------------------------------------------------------------ tests
def test_first_epoch_statistics_of_two_ranks_equal_one_process(tmp_path):
    # the first epoch's statistics come from the initial model however the nets then train:
    # exact EM's from the mixture's E-step alone; the net search's from its first pass,
    # here one batch on any number of ranks, taken before the step (the training-only steps
    # follow the pass). Float32 GEMMs of other batch shapes move the responsibilities by
    # ~1e-8, and the statistics with them (relative to their scale: sums of signed rows cancel)
    x = _mixture()
    configs = [_config(**{"small_data.max_rows": len(x)}), _config(**{"optim.batch_size": len(x)})]
    one = _first_epoch_stats(0, 1, x, configs)
    two = run_ranks(tmp_path, _first_epoch_stats, x, configs)
    for rank in range(2):
        for (soft, sub, losses, means, (calls, sent)), ref, steps in zip(two[rank], one, (0, 1), strict=True):
            # the same k-means sample and centres on any number of ranks, so the same initial
            # mixture up to the summation order of its float64 statistics
            np.testing.assert_allclose(means, ref[3], rtol=1e-12, atol=1e-15)
            # statistics of 500 + 501 rows added by the all-reduce = those of 1001 rows
            np.testing.assert_allclose(soft, ref[0], rtol=1e-6, atol=1e-6 * np.abs(ref[0]).max())
            # hard subcluster statistics come from float32 centred GEMMs over each rank's
            # rows (stats.grouped_stats): equal to float32 round-off of the spread
            np.testing.assert_allclose(sub, ref[1], rtol=1e-6, atol=1e-6 * np.abs(ref[1]).max())
            assert soft[: means.shape[0]].sum() == pytest.approx(len(x), rel=1e-6)  # float32 softmax
            assert losses == pytest.approx(ref[2], rel=1e-5)
            # the net search's step count (max, 8 bytes) and ONE statistics all-reduce per epoch,
            # with the loss sums and the row count (exact EM has no cluster loss: no net trains)
            k, d = means.shape
            sums = 3 if steps else 2
            assert calls == steps + 1
            assert sent == 8 * steps + 8 * (3 * k * (1 + d + d * d) + sums)


def test_an_empty_rank_follows_the_single_process_fit_exactly(tmp_path):
    # rank 1 holds no rows: it runs empty batches in lock-step, its zero gradients and
    # statistics change nothing, so the fit is the single-process one (lr scaling off,
    # because W = 2 otherwise doubles the global batch the learning rate is scaled for)
    # (with the sparse top-m E-step, the ImageNet-scale path, from K > 2 on)
    x = _mixture(600)
    config = _config(**{"optim.lr_scaling": "none", "estep.dense_max_k": 2, "estep.top_m": 2})
    single = start_fit(config, torch.from_numpy(x))
    single.fit()
    (hist0, sum0), (hist1, sum1) = run_ranks(tmp_path, _fit, [x, x[:0]], config)
    drop = lambda h: [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in h]  # noqa: E731
    assert drop(hist0) == drop(hist1) == drop(single.history)
    assert sum0 == sum1 == pytest.approx(single.checksum(), rel=1e-12)
    assert any(r["splits_accepted"] or r["merges_accepted"] for r in single.history)


def _unequal_blobs() -> tuple[np.ndarray, int]:
    """15 blobs of unequal sizes (60..760 rows, 5,418 in all) in 50-D."""
    from sklearn.datasets import make_blobs

    sizes = [60 + 50 * i for i in range(15)]
    x, _ = make_blobs(n_samples=sizes, n_features=50, cluster_std=1.0, center_box=(-6, 6), random_state=4)
    return x.astype(np.float32), 15


@pytest.mark.parametrize("data", ["mixture", "unequal 50-D blobs", "2-D blob grid (births)",
                                  "40 blobs in 64-D (growth)"])
def test_small_data_fit_is_the_same_on_two_ranks(tmp_path, data):
    # exact EM (small_data): no minibatch order to differ, the E-step is per row and the
    # statistics are all-reduced, so two ranks take the one process's moves (births'
    # k-means included), and the net fitted at the end labels the rows alike
    if data == "mixture":
        x, k = _mixture(), None
    elif data == "unequal 50-D blobs":
        x, k = _unequal_blobs()
    elif data == "2-D blob grid (births)":  # 49 blobs that need births (tests/core/moves/test_births.py)
        x, k = grid_blobs(7, 60, 1)[0], 49
    else:  # settles at 5 clusters, then grows (tests/core/training/test_growth.py)
        x, k = many_blobs()[0], 40
    config = _config(**{"small_data.max_rows": 10_000, "schedule.max_epochs": 60,
                        "init.n_clusters": 8 if k is None else "auto", "init.max_points": 200_000,
                        "optim.batch_size": "auto"})
    single = start_fit(config, torch.from_numpy(x))
    single.fit()
    half = len(x) // 2
    (hist0, _), (hist1, _) = run_ranks(tmp_path, _fit, [x[:half], x[half:]], config)
    keep = ("epoch", "n_clusters", "move", "splits_accepted", "merges_accepted")
    path = lambda h: [tuple(r[k] for k in keep) for r in h]  # noqa: E731
    assert path(hist0) == path(hist1) == path(single.history)
    assert any(r["splits_accepted"] or r["merges_accepted"] for r in single.history)
    if k is not None:
        assert single.n_clusters == k
    grown = lambda h: [(r["epoch"], r.get("grown")) for r in h if "grown" in r]  # noqa: E731
    assert grown(hist0) == grown(hist1) == grown(single.history)
    assert bool(grown(single.history)) == (k == 40)
    assert hist0[-1]["distil_agreement"] == pytest.approx(single.history[-1]["distil_agreement"], abs=0.01)


def test_diverged_ranks_fail_loudly(tmp_path):
    messages = run_ranks(tmp_path, _diverge, _mixture(), _config())
    for message in messages:
        assert message is not None and "ranks diverged at epoch 1" in message


@pytest.mark.parametrize("suffix", [".npy", ".npz", ".parquet"])
def test_rank_slices_cover_the_input_in_order(tmp_path, suffix):
    from pipeline.io.table_writing import features_table

    x = _mixture(103)
    path = tmp_path / f"x{suffix}"
    if suffix == ".npy":
        np.save(path, x)
    elif suffix == ".npz":
        np.savez_compressed(path, X=x.astype(np.float64), y=np.zeros(len(x), int))
    else:
        import pyarrow.parquet as pq

        pq.write_table(features_table(x, np.arange(len(x)), None), path, row_group_size=10)
    for world in (1, 2, 3):
        parts = [load_rank_rows(path, len(x), r, world) for r in range(world)]
        assert [s for _, s in parts] == [rank_rows(len(x), r, world)[0] for r in range(world)]
        np.testing.assert_array_equal(np.concatenate([p for p, _ in parts]), x)
    # more ranks than rows: the last ones get empty slices of the right width
    empty, start = load_rank_rows(path, len(x), 0, 201)
    assert empty.shape == (0, 4) and start == 0


def test_a_one_process_checkpoint_resumes_on_two_ranks(tmp_path):
    # statistics add up over any split of the rows, so a run may resume with another W
    x, config = _mixture(), _config()
    single = start_fit(config, torch.from_numpy(x))
    single.initialize()
    for _ in range(4):
        single.step_epoch()
    state = single.state_dict()
    for history, k, refused in run_ranks(tmp_path, _resume, x, state, config):
        assert [r["epoch"] for r in history] == list(range(1, 8))
        assert history[:4] == single.history
        assert k >= 1
        assert refused.startswith("CheckpointError: the data differ from the checkpoint's: 500 rows")
