"""The clustering net, the batched subclustering nets and their loss (paper Eqs. 5-6)."""

from deepdpm_core.nets.adam import Adam
from deepdpm_core.nets.linear_discriminant import discriminant_start, widen_hidden
from deepdpm_core.nets.losses import first_slots, slot_kl, slot_misfit
from deepdpm_core.nets.networks import (
    ClusterNet,
    SubclusterNets,
    axis_aligned_subnets,
    cluster_row_map,
    new_row_of,
    reindex_rows,
)

__all__ = [
    "Adam", "axis_aligned_subnets", "cluster_row_map", "ClusterNet", "discriminant_start", "first_slots", "new_row_of", "reindex_rows",
    "slot_kl", "slot_misfit", "SubclusterNets", "widen_hidden"
]
