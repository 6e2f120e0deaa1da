"""The benchmarks that docs/benchmarks.md quotes still run and report what they claim, at small
sizes.

Each script runs as a user runs it (a subprocess from the repository root) and its
``--json`` line is checked against what the run must have measured: the required keys,
times that add up, and results a correct run gives on easy data.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run_json(script: str, *args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # torch takes MKL's too
    done = subprocess.run([sys.executable, f"bench/{script}", *args, "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _bench_module(name: str):
    """The bench script ``name`` imported as a module (its sibling benches on the path)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_scale_bench_times_an_epoch_against_kmeans_and_fits():
    # K = 40 is above estep.dense_max_k (32): the sparse E-step path scale.py measures
    out = _run_json("scale.py", "--n", "6000", "--d", "8", "--k", "40", "--kmeans-iters", "2",
                    "--epochs", "2", "--fit", "--set", "prior.sigma_scale=0.1", "schedule.max_epochs=30")
    for key in ("epoch_seconds", "later_epoch_seconds", "estep_seconds", "kmeans_iter_seconds"):
        assert math.isfinite(out[key]) and out[key] > 0, key
    assert out["ratio"] == out["epoch_seconds"] / out["kmeans_iter_seconds"]
    assert out["estep_seconds"] < out["epoch_seconds"] + out["later_epoch_seconds"]
    assert out["top_m"] == 8 and out["k_epoch"] == 40 and out["device"] == "cpu"
    assert 1.0 <= out["estep_support_per_point"] <= 8.0
    assert out["peak_rss_mb"] >= out["data_rss_mb"] > 0
    # the floor: every part timed, their sum below the real epoch's (a lower bound)
    assert set(out["floor_seconds"]) == {"nets_gemm", "log_softmax", "adam", "log_density", "statistics"}
    assert all(s > 0 for s in out["floor_seconds"].values()) and out["steps"] == 64
    assert math.isclose(out["floor_ratio"] * out["kmeans_iter_seconds"], sum(out["floor_seconds"].values()))
    assert out["floor_ratio"] < out["ratio"]
    # seeds 0-3 give K 39-40 within the 30 epochs (NMI >= 0.999)
    assert abs(out["fit_k"] - 40) <= 2 and out["fit_nmi"] > 0.98 and 0 < out["fit_epochs"] <= 30



def test_init_start_bench_times_the_start_on_a_sample_sized_by_k():
    # 60,000 rows at K = 1,000: the k-means sees 40 a cluster; every row gets one of the clusters
    out = _run_json("init_start.py", "--n", "60000", "--d", "4", "--k", "1000", "--set", "init.kmeans_iters=2")
    assert out["kmeans_rows"] == 40_000 and out["k"] == 1000 and out["torch_threads"] == 1
    assert out["cpu_seconds"] > 0 and out["objective"] > 0 and 0.5 < out["nmi"] <= 1.0
    assert 900 <= out["nonempty"] <= 1000

def test_estep_work_bench_counts_the_e_steps_work_on_close_and_on_separated_clusters(tmp_path):
    out_file = tmp_path / "estep.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "bench/estep_work.py", "--n", "20000", "--reps", "1", "--json",
                           str(out_file)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    close, separated = json.loads(out_file.read_text())["results"]
    for r in (close, separated):
        assert 900 <= r["k"] <= 1000 and r["d"] == 128 and r["n"] == 20000 and r["seconds"] > 0
        assert 1.0 <= r["support_per_row"] <= 8.0 and r["exact_per_row"] >= 0
    # on the sphere the per-anchor bounds keep pairs and rows are scored against several
    # clusters; separated Gaussians need neither
    assert close["anchor_pairs"] > separated["anchor_pairs"] and close["exact_per_row"] > separated["exact_per_row"]


def test_vs_bgm_bench_reports_both_methods_on_the_same_data():
    out = _run_json("vs_bgm.py", "--n", "4000")
    assert set(out) == {"DeepDPM", "BayesianGaussianMixture(30, DP, full)"}
    for name, row in out.items():
        assert row["seconds"] > 0, name
        assert 0.0 <= row["nmi"] <= 1.0 and 0.0 <= row["acc"] <= 1.0, name
    assert out["DeepDPM"]["k"] == 10 and out["DeepDPM"]["nmi"] > 0.99


def test_distributed_bench_counts_the_traffic_of_two_gloo_ranks():
    n, dim, k, hidden = 2000, 16, 20, 50
    out = _run_json("distributed.py", "--n", str(n), "--dim", str(dim), "--k", str(k), "--epochs", "1")
    one, two = out["workers"]["1"], out["workers"]["2"]
    assert one["k"] == two["k"] == k and one["steps"] == two["steps"] > 0
    # once an epoch, whatever W: the float64 statistics of K clusters and 2K subclusters with
    # the 3 loss sums in one buffer, and the step count's max
    assert two["stats_bytes"] == one["stats_bytes"] == 8 * (3 * k * (1 + dim + dim * dim) + 3 + 1)
    # DDP sends every float32 gradient of both nets once per step; one process sends none
    params = (dim * hidden + hidden + hidden * k + k) + k * (dim * hidden + hidden + 2 * hidden + 2)
    assert one["grad_bytes"] == 0 and two["grad_bytes"] == 4 * params * two["steps"]


def test_busy_machine_bench_times_fits_alone_and_beside_spinning_neighbours():
    out = _run_json("busy_machine.py", "--quick")
    assert out["threads"] == 1 and out["neighbours"] == os.cpu_count() and out["max_epochs"] == 3
    assert [(r["case"], r["mode"]) for r in out["rows"]] == [("iris", "before"), ("iris", "after")]
    for row in out["rows"]:
        for run in (*row["alone"], *row["busy"]):
            assert not run["timed_out"] and run["seconds"] > 0 and run["epochs"] == 3
        assert row["busy_over_alone"] == row["busy"][0]["seconds"] / row["alone"][0]["seconds"]
        assert row["fair_slowdown"] == max(1.0, (out["neighbours"] + 1) / os.cpu_count())
        assert math.isclose(row["over_fair"], row["busy_over_alone"] / row["fair_slowdown"])


def test_busy_machine_bench_sets_the_old_and_the_new_thread_settings_and_kills_neighbours(
        monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import busy_machine
    finally:
        sys.path.remove(str(ROOT / "bench"))
    monkeypatch.setenv("KMP_BLOCKTIME", "0")  # inherited settings never reach a fit
    before = busy_machine.fit_environment("before", "demo", 2)
    assert before["OMP_NUM_THREADS"] == "2"
    assert not set(busy_machine.IDLE_VARIABLES) & set(before)  # the runtimes' own defaults
    after = busy_machine.fit_environment("after", "demo", 2)
    assert "OMP_WAIT_POLICY" not in after and "KMP_BLOCKTIME" not in after  # the library's
    assert after["NUMBA_THREADING_LAYER"] == "workqueue"  # as the deepdpm command sets it
    assert "NUMBA_THREADING_LAYER" not in busy_machine.fit_environment("after", "iris", 2)
    with pytest.raises(KeyboardInterrupt), busy_machine.busy_neighbours(2) as procs:
        raise KeyboardInterrupt  # Ctrl-C mid-run
    assert len(procs) == 2 and all(proc.poll() is not None for proc in procs)


def test_k_vs_n_bench_scores_each_family_against_its_own_k(tmp_path):
    """The 1,000-cluster sphere family (the 1.28M row's) is judged against K = 1,000, its
    k-means peer is FAISS's; the DeepDPM record carries its epochs and K path."""
    out = tmp_path / "k_vs_n.json"
    done = subprocess.run([sys.executable, "bench/k_vs_n.py", "--families", "sphere", "sphere-1000",
                           "--n", "4000", "--seeds", "0", "--set", "schedule.max_epochs=6",
                           "--json", str(out)], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = {(r["family"], r["method"]): r for r in json.loads(out.read_text())["records"]}
    assert set(records) == {(f, m) for f in ("sphere", "sphere-1000")
                            for m in ("DeepDPM", "k-means (true K)", "BGM-DP")}
    assert records["sphere", "k-means (true K)"]["k"] == 10
    assert 900 <= records["sphere-1000", "k-means (true K)"]["k"] <= 1000
    deepdpm = records["sphere-1000", "DeepDPM"]
    assert deepdpm["epochs"] == 6 and deepdpm["k_path"][-1] == deepdpm["k"]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| sphere-1000 | 4000 | DeepDPM |"))
    assert (deepdpm["k"] < 900) == ("K ±10 % FAIL" in row), row


def test_k_battery_fits_from_each_start_and_scores_each_partition(tmp_path):
    """Two families in two worker processes: DeepDPM once per start, each partition and the
    true classes scored by ln p(X, z), and the start table says whether the starts agree."""
    out = tmp_path / "k_battery.json"
    done = subprocess.run([sys.executable, "bench/k_battery.py", "--families", "overlap10-2d", "wine-raw",
                           "--starts", "default", "3k", "--seeds", "0", "--jobs", "2", "--json", str(out)],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["complete"] and report["starts"] == ["default", "3k"]
    for family in ("overlap10-2d", "wine-raw"):
        rows = [r for r in report["records"] if r["family"] == family]
        truth = next(r for r in rows if r["method"] == "true classes")
        fits = {r["start"]: r for r in rows if r["method"] == "DeepDPM"}
        assert set(fits) == {"default", "3k"}
        assert all(math.isfinite(r["log_joint"]) for r in (truth, *fits.values()))
    # the true partition of two Gaussians 3.29 apart is what both starts find
    two = next(r for r in report["records"] if r["family"] == "overlap10-2d" and r.get("start") == "3k")
    assert two["k"] == 2
    table = done.stdout[done.stdout.index("DeepDPM from each start"):]
    assert "| overlap10-2d | 2048 | 2 |" in table and "starts agree" in table


def test_k_battery_sets_a_constant_in_its_workers_for_an_ablation(tmp_path):
    """--constant rebinds a calibrated constant in every worker: with every pair merged that
    shows any valley at all, the two Gaussians 3.29 apart (K 2 by default) become one."""
    out = tmp_path / "ablation.json"
    constant = "deepdpm_core.moves.density_valleys.MERGE_VALLEY=0.0"
    done = subprocess.run([sys.executable, "bench/k_battery.py", "--families", "overlap10-2d", "--seeds", "0", "1",
                           "--jobs", "2", "--constant", constant, "--json", str(out)],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["constants"] == {"deepdpm_core.moves.density_valleys.MERGE_VALLEY": 0.0}
    assert [r["k"] for r in report["records"] if r["method"] == "DeepDPM"] == [1, 1]
    bad = subprocess.run([sys.executable, "bench/k_battery.py", "--constant", "deepdpm_core.moves.NOPE=1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "deepdpm_core.moves has no NOPE" in bad.stderr


def test_a_constant_is_rebound_wherever_it_was_imported():
    constants = _bench_module("constants")
    from deepdpm_core.moves import births, density_valleys, proposals

    before = density_valleys.SPLIT_VALLEY
    try:
        changed = constants.set_constants(constants.parse_constants(
            ["deepdpm_core.moves.density_valleys.SPLIT_VALLEY=0.5"]))
        assert {"deepdpm_core.moves.density_valleys.SPLIT_VALLEY", "deepdpm_core.moves.proposals.SPLIT_VALLEY",
                "deepdpm_core.moves.births.SPLIT_VALLEY"} <= set(changed)
        assert density_valleys.SPLIT_VALLEY == proposals.SPLIT_VALLEY == births.SPLIT_VALLEY == 0.5
        assert proposals.MERGE_VALLEY == 0.85  # another constant keeps its value
    finally:
        constants.set_constants({"deepdpm_core.moves.density_valleys.SPLIT_VALLEY": before})
    assert proposals.SPLIT_VALLEY is before
    for item, message in (("SPLIT_VALLEY=0.5", "expected"), ("deepdpm_core.moves.density_valleys.SPLIT_VALLEY=x",
                                                                "not a Python literal"),
                          ("numpy.pi=3", "only deepdpm_core")):
        with pytest.raises(ValueError, match=message):
            constants.parse_constants([item])


def test_k_battery_draws_fifteen_overlapping_blobs_as_it_says():
    """blobs15: 15 Gaussians in 2-D whose centres keep the gap, each of the stated geometric
    mean spread, their sizes adding up to N; more spread, more overlap (k-means scores less)."""
    from sklearn.cluster import KMeans
    from sklearn.metrics import normalized_mutual_info_score

    battery = _bench_module("k_battery")
    scores = []
    for name, spread in (("blobs15-2d-s2", 0.4), ("blobs15-2d-s4", 0.7)):
        X, y = battery.FAMILIES[name].make(5000, 0)
        assert X.shape == (5000, 2) and X.dtype == np.float32 and sorted(set(y)) == list(range(15))
        centres = np.array([X[y == c].mean(0) for c in range(15)])
        assert battery._min_gap(centres) > 1.1 - 0.2  # the drawn centres, up to sampling noise
        spreads = [np.linalg.det(np.cov(X[y == c].T)) ** 0.25 for c in range(15)]
        assert abs(np.exp(np.mean(np.log(spreads))) - spread) < 0.05 * spread
        labels = KMeans(15, n_init=3, random_state=0).fit_predict(X)
        scores.append(normalized_mutual_info_score(y, labels))
    assert scores[0] > scores[1] + 0.05


def _run_on_two_gaussians(script: str, out: Path) -> tuple[dict, str]:
    """``script`` on the two Gaussians at 10 % overlap in 2-D, its JSON written to ``out``:
    its one record and its stdout."""
    done = subprocess.run([sys.executable, f"bench/{script}", "--families", "overlap10-2d", "--json", str(out)],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = json.loads(out.read_text())["records"]
    return record, done.stdout


def test_k_levels_finds_the_truth_in_the_hierarchy_of_two_gaussians(tmp_path):
    record, stdout = _run_on_two_gaussians("k_levels.py", tmp_path / "k_levels.json")
    assert record["components"] == 40 and record["exact_k"] == 2 and record["nmi_at_true_k"] > 0.6
    assert record["elbow_k"] == 2
    assert "| overlap10-2d | 2048 | 2 | 2 | 40 |" in stdout


def test_peer_partitions_scores_the_fit_beside_gaussian_mixtures_partitions(tmp_path):
    # two Gaussians at 10 % overlap in 2-D: the fit finds both, and GaussianMixture's 2
    # components are the same partition, scored alike
    record, stdout = _run_on_two_gaussians("peer_partitions.py", tmp_path / "peers.json")
    assert [p["k"] for p in record["peers"]] == [2, 3, 4] and record["deepdpm"]["k"] == 2
    two = record["peers"][0]
    assert two["nmi"] > 0.6 and abs(two["delta_log_p"] - record["deepdpm"]["delta_log_p"]) < 50
    # the same partition scores alike: no search failure is claimed; the soft score picks 2 too
    assert "| overlap10-2d | 2 | 2, " in stdout and stdout.rstrip().endswith("| 2 | model's choice |")
    assert all(p["soft_delta_log_p"] > p["delta_log_p"] for p in record["peers"])  # H(r) > 0


def test_the_soft_score_of_a_hard_partition_is_its_ln_p_and_adds_the_entropy():
    peers = _bench_module("peer_partitions")
    rng = np.random.default_rng(0)
    X = np.concatenate([rng.normal(0, 1, (150, 3)), rng.normal(6, 1, (150, 3))]).astype(np.float32)
    labels = np.repeat([0, 1], 150)
    hard = np.eye(2)[labels]
    assert math.isclose(peers.soft_score(X, hard), peers.objective(X, labels, {}), rel_tol=1e-9)
    # every row shared half and half by two groups: two groups of the whole's statistics
    # halved, with the prior fitted to them, and ln 2 of entropy a row
    import torch

    from deepdpm_core.bayes import PriorFit, SuffStats, fitted_log_joint
    from deepdpm_core.config import Config
    from deepdpm_core.data import fit_coordinates
    from deepdpm_core.runtime import LocalCommunicator

    x = torch.as_tensor(X, dtype=torch.float64)
    coords, _, _ = fit_coordinates(x, Config().data, LocalCommunicator(), torch.device("cpu"))
    xt = coords.apply(x)
    half = SuffStats(torch.full((2,), 150.0, dtype=torch.float64), (xt.sum(0) / 2).repeat(2, 1),
                     (xt.T @ xt / 2).repeat(2, 1, 1))
    reference = fitted_log_joint(half, PriorFit(Config().prior, coords, torch.device("cpu")), 10.0).log_joint
    assert math.isclose(peers.soft_score(X, np.full((300, 2), 0.5)), reference + 300 * math.log(2), rel_tol=1e-9)
    # a component with under one row's mass is left out (ln Γ(n) would reward it without bound)
    tiny = np.concatenate([hard * (1 - 1e-6), np.full((300, 1), 1e-6)], 1)
    assert math.isfinite(peers.soft_score(X, tiny))


def test_a_fits_request_hops_back_between_modules_no_more_than_it_did():
    # bench/request_hops.py's count: the request's walk from run_fit through the calls that
    # take it, counting each move back into a module it had left (12 for a local fit)
    out = _run_json("request_hops.py")
    assert out["request_frames"] >= 10  # the walk followed the request through the driver
    assert out["hops_back"] <= 12
