"""ln p(X, z) of a partition against a brute-force chain rule, and what it is for."""

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from sklearn.datasets import make_blobs

from deepdpm_core import DeepDPM
from deepdpm_core.bayes import PriorFit, log_crp, partition_evidence
from deepdpm_core.config import Config, DataConfig
from deepdpm_core.data import fit_coordinates
from deepdpm_core.errors import DataError
from deepdpm_core.runtime import LocalCommunicator


def test_crp_term_is_the_product_of_seating_probabilities():
    z = np.array([0, 0, 1, 0, 2, 1, 1, 0, 3])
    alpha, total, seen = 1.7, 0.0, {}
    for i, g in enumerate(z):  # customer i joins table g: n_g / (α + i), or α / (α + i) if new
        total += math.log(seen.get(g, alpha) / (alpha + i))
        seen[g] = seen.get(g, 0) + 1
    assert log_crp(np.bincount(z), alpha) == pytest.approx(total, rel=1e-12)


def _fixed_prior_config():
    # fixed numbers: nothing is refitted, so the chain rule below needs only λ and the floor δ
    return Config().with_overrides({"prior.sigma_scale": 0.3, "prior.psi": "identity", "prior.nu": 6.0, "prior.kappa": 0.2,
                                    "prior.alpha": 2.5})


def test_joint_equals_the_chain_rule_of_seating_and_student_t_predictives():
    """p(X, z) = Π_i p(z_i | z_<i) p(x_i | the earlier rows of its group), each x-term
    the NIW posterior predictive (updates written out here). With the covariance floor δ,
    Λn gains diag(δ) per row: the predictive is the multivariate Student-t of A = Λn + diag(δ)
    times (|Λn| / |A|)^(νn/2), which is 1 for the paper's δ = 0."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(14, 3)) * 2.0 + 5.0
    z = rng.integers(0, 3, size=14)
    config = _fixed_prior_config()
    coords, _, _ = fit_coordinates(torch.as_tensor(x), DataConfig(transform="none"), LocalCommunicator(), torch.device("cpu"))
    xt = coords.apply(torch.as_tensor(x)).numpy()
    prior = PriorFit(config.prior, coords, torch.device("cpu")).prior
    m0, k0, nu0, lam0 = prior.m0.numpy(), prior.kappa, prior.nu, prior.scale.numpy()
    floor = np.diag(prior.floor.numpy())
    assert float(prior.floor.min()) > 0
    d, alpha, total = x.shape[1], config.prior.alpha, 0.0
    groups: dict[int, list[np.ndarray]] = {}
    for i, (row, g) in enumerate(zip(xt, z, strict=True)):
        members = np.array(groups.get(g, np.zeros((0, d))))
        n = len(members)
        total += math.log((n if n else alpha) / (alpha + i))
        kn, nun = k0 + n, nu0 + n
        mn = (k0 * m0 + members.sum(0)) / kn
        lamn = lam0 + k0 * np.outer(m0, m0) + members.T @ members + n * floor - kn * np.outer(mn, mn)
        dof = nun - d + 1
        a = lamn + floor
        total += stats.multivariate_t(loc=mn, shape=a * (kn + 1) / (kn * dof), df=dof).logpdf(row)
        total += nun / 2 * (np.linalg.slogdet(lamn)[1] - np.linalg.slogdet(a)[1])
        groups.setdefault(g, []).append(row)
    got = partition_evidence(x, z, config)
    assert got.log_joint == pytest.approx(total, rel=1e-9)
    assert got.log_joint == pytest.approx(got.log_partition + got.log_marginals.sum(), rel=1e-12)


def test_the_same_in_any_units_and_for_any_label_names():
    X, y = make_blobs(300, centers=3, n_features=4, random_state=0)
    base = partition_evidence(X, y)
    moved = partition_evidence(1e3 * X + 7.0, np.array(["a", "b", "c"])[y])
    assert moved.log_joint == pytest.approx(base.log_joint, rel=1e-9)
    assert moved.sigma_scale == pytest.approx(1e6 * base.sigma_scale, rel=1e-6)


def test_fitted_prior_is_a_fixed_point_that_maximises_the_evidence():
    """With ``sigma_scale: evidence`` s maximises Σ_k ln f(X_k) given the groups."""
    X, y = make_blobs(400, centers=4, n_features=3, cluster_std=[0.5, 1.0, 1.5, 2.0], random_state=1)
    config = Config().with_overrides({"prior.sigma_scale": "evidence"})
    best = partition_evidence(X, y, config)
    for factor in (0.95, 1.05):
        s = best.sigma_scale * factor
        other = partition_evidence(X, y, config.with_overrides({"prior.sigma_scale": s, "prior.nu": best.nu}))
        assert other.log_marginals.sum() < best.log_marginals.sum()


def test_the_true_partition_of_separated_blobs_scores_above_merged_and_split_ones():
    X, y = make_blobs(600, centers=4, n_features=5, cluster_std=1.0, center_box=(-30, 30), random_state=2)
    truth = partition_evidence(X, y).log_joint
    merged = partition_evidence(X, np.minimum(y, 2)).log_joint
    halves = partition_evidence(X, np.where(y == 0, 4 + (X[:, 0] > np.median(X[y == 0, 0])), y)).log_joint
    random = partition_evidence(X, np.random.default_rng(0).integers(0, 4, len(y))).log_joint
    assert truth > max(merged, halves, random)


def test_labels_must_be_one_per_row_and_rows_finite():
    with pytest.raises(DataError, match=r"labels has shape \(3,\); expected one per row of X, \(4,\)"):
        partition_evidence(np.zeros((4, 2)), np.zeros(3))
    X = np.ones((5, 2))
    X[2, 1] = np.nan
    with pytest.raises(DataError, match="NaN") as err:
        partition_evidence(X, np.arange(5) % 2)
    assert "\n" not in str(err.value)


def test_readme_snippet_scores_a_fit_against_known_labels():
    """README's "Is K the model's answer" snippet, as written: on separated blobs the fit
    finds the classes, so the two partitions score the same."""
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    code = re.search(r"\*\*Is K the model's answer.*?```python\n(.*?)```", readme, re.S).group(1)
    X, y = make_blobs(400, centers=3, n_features=4, center_box=(-20, 20), random_state=3)
    model = DeepDPM(random_state=0, optim__min_steps_per_epoch=8).fit(X)
    namespace = {"X": X, "model": model, "my_labels": y}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the project's own README
    assert model.n_clusters_ == 3
    assert namespace["gap"] == pytest.approx(0.0, abs=1e-6)
