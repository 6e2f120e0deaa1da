"""How K changes: the initial clusters, split/merge proposals and births, density valleys,
the surgery that applies them, and the schedule that says when."""

from deepdpm_core.moves.births import (
    birth_min_points,
    birth_proposals,
    choose_births,
    groups_mixture,
)
from deepdpm_core.moves.density_valleys import (
    MERGE_VALLEY,
    PAIR_SIDE_SHARE,
    VALLEY_BANDWIDTH,
    VALLEY_MIN_POINTS,
    pair_histograms,
    projection_histograms,
    valley_ratios,
)
from deepdpm_core.moves.initial import initial_cluster_count, initial_clusters
from deepdpm_core.moves.proposals import (
    MERGE_NEIGHBOURS,
    MIN_SUBCLUSTER_SIZE,
    MovePlan,
    coarsening_constant,
    merge_candidates,
    plan_moves,
)
from deepdpm_core.moves.schedule import FREEZE_EPOCHS, MoveSchedule
from deepdpm_core.moves.surgery import Nets, apply_births, apply_plan, reset_subclusters

__all__ = [
    "apply_births", "apply_plan", "birth_min_points", "birth_proposals", "choose_births",
    "coarsening_constant", "groups_mixture", "initial_cluster_count", "MERGE_NEIGHBOURS", "initial_clusters", "merge_candidates", "MovePlan", "MoveSchedule",
    "FREEZE_EPOCHS", "MERGE_VALLEY", "MIN_SUBCLUSTER_SIZE",
    "Nets", "PAIR_SIDE_SHARE", "pair_histograms", "plan_moves", "projection_histograms", "reset_subclusters",
    "VALLEY_BANDWIDTH", "VALLEY_MIN_POINTS", "valley_ratios"
]
