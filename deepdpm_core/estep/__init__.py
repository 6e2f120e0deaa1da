"""The E-step: the Gaussian mixture with cached Cholesky factors, the sparse support of
each point, the targets r^E of an epoch (paper Eq. 5) and what an epoch accumulates."""

from deepdpm_core.estep.epoch_stats import R_FLOOR, EpochStats
from deepdpm_core.estep.gmm import GaussianMixture, log_weights_from_counts
from deepdpm_core.estep.mixture_state import MixtureState, SubclusterMAP
from deepdpm_core.estep.sparse_support import SparseEStep
from deepdpm_core.estep.targets import EStep, slot_targets

__all__ = [
    "EpochStats", "EStep", "GaussianMixture", "log_weights_from_counts", "MixtureState", "R_FLOOR",
    "slot_targets", "SparseEStep", "SubclusterMAP"
]
