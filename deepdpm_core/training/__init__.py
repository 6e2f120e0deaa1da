"""The search a fit runs: its state and epoch loop (:class:`Search`), exact EM (the default)
and the nets' minibatch steps (above ``small_data.max_rows``), the moves and settling of the search, rank
consistency and the resume format."""

from deepdpm_core.training.batching import auto_batch_size
from deepdpm_core.training.exact_em import ExactEM
from deepdpm_core.training.minibatch import MinibatchSearch
from deepdpm_core.training.search import EpochCallback, Search
from deepdpm_core.training.start import start_fit

__all__ = ["auto_batch_size", "EpochCallback", "ExactEM", "MinibatchSearch", "Search", "start_fit"]
