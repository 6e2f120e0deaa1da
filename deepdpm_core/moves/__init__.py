"""How K changes: the initial clusters, split/merge proposals and births, density valleys,
the surgery that applies them, and the schedule that says when."""

from deepdpm_core.moves.births import (
    BirthProposal,
    accepted_births,
    birth_kmeans,
    birth_min_points,
    birth_proposals,
    birth_seeds,
    choose_births,
    coarser,
    log_birth_hastings,
    nearest_part_pairs,
    principal_plane,
)
from deepdpm_core.moves.density_valleys import (
    pair_axes,
    pair_histograms,
    projection_histograms,
    split_axes,
    valley_ratios,
)
from deepdpm_core.moves.initial import (
    initial_cluster_count,
    initial_clusters,
    kmeans_centers,
    kmeans_pp_seeds,
    principal_split,
    rows_needed,
)
from deepdpm_core.moves.proposals import (
    MovePlan,
    coarsened,
    coarsening_constant,
    merge_candidates,
    plan_moves,
    propose_merges,
    propose_splits,
)
from deepdpm_core.moves.schedule import MoveSchedule
from deepdpm_core.moves.surgery import Nets, apply_births, apply_plan, reset_subclusters

__all__ = [
    "accepted_births", "apply_births", "apply_plan", "birth_kmeans", "birth_min_points",
    "birth_proposals", "birth_seeds", "BirthProposal", "choose_births", "coarsened",
    "coarsening_constant", "coarser", "initial_cluster_count", "initial_clusters",
    "kmeans_centers", "kmeans_pp_seeds", "log_birth_hastings", "merge_candidates", "MovePlan",
    "MoveSchedule", "nearest_part_pairs", "Nets", "pair_axes", "pair_histograms", "plan_moves",
    "principal_plane", "principal_split", "projection_histograms", "propose_merges",
    "propose_splits", "reset_subclusters", "rows_needed", "split_axes", "valley_ratios"
]
