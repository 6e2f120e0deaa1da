"""The Bayesian model: sufficient statistics that add, the Normal-Inverse-Wishart prior
(posterior, marginal likelihood, Hastings ratios), its refit to the clusters, and the model's
own score of a partition, and the greedy merge hierarchy it scores."""

from deepdpm_core.bayes import blocks
from deepdpm_core.bayes.empirical_bayes import (
    empirical_bayes_nu,
    empirical_bayes_scale,
    empirical_bayes_shape,
)
from deepdpm_core.bayes.linalg import (
    cache_blocks,
    cholesky_jittered,
    precision_cholesky,
    row_blocks,
    symmetric_eigh,
)
from deepdpm_core.bayes.merge_levels import MergeLevels, elbow_level, merge_levels
from deepdpm_core.bayes.niw import (
    NIWPrior,
    log_marginal_likelihood,
    log_merge_hastings,
    log_split_hastings,
    map_covariance_writer,
    map_estimate,
    posterior,
    posterior_mean,
)
from deepdpm_core.bayes.partition_evidence import fitted_log_joint, log_crp, partition_evidence
from deepdpm_core.bayes.prior_fit import PriorFit
from deepdpm_core.bayes.stats import (
    SuffStats,
    TripleBuffer,
    gather_chunk_rows,
    grouped_stats,
    sparse_stats,
)

__all__ = [
    "blocks", "cache_blocks", "cholesky_jittered", "empirical_bayes_nu", "empirical_bayes_scale",
    "elbow_level", "empirical_bayes_shape", "fitted_log_joint",
    "gather_chunk_rows", "grouped_stats", "log_crp", "log_marginal_likelihood",
    "log_merge_hastings", "log_split_hastings", "map_covariance_writer", "map_estimate", "merge_levels", "MergeLevels", "NIWPrior",
    "partition_evidence",
    "posterior", "posterior_mean", "precision_cholesky", "PriorFit", "row_blocks", "sparse_stats", "SuffStats",
    "symmetric_eigh", "TripleBuffer"
]
