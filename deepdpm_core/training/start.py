"""How every fit starts: the estimator's and each fit mode of the pipeline."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from deepdpm_core.config import Config, searches_by_exact_em
from deepdpm_core.data import check_features, readonly_tensor
from deepdpm_core.errors import CheckpointError
from deepdpm_core.runtime import Communicator, LocalCommunicator
from deepdpm_core.training.exact_em import ExactEM
from deepdpm_core.training.fit_context import fit_context
from deepdpm_core.training.minibatch import MinibatchSearch
from deepdpm_core.training.search import Search


def start_fit(config: Config, rows: np.ndarray, *, comm: Communicator | None = None,
              wrap: Callable[[nn.Module], nn.Module] | None = None,
              state: dict[str, Any] | None = None) -> Search:
    """The search of a fit of ``rows``, fresh or resuming ``state``: exact EM
    (:class:`~deepdpm_core.training.exact_em.ExactEM`) up to ``small_data.max_rows`` rows
    over all ranks (at every N by default), the nets' minibatch steps
    (:class:`~deepdpm_core.training.minibatch.MinibatchSearch`) above.

    Parameters
    ----------
    config : Config
    rows : array-like or Tensor of shape (N_local, D)
        This rank's rows; the search reads them through a read-only view. A single
        process's rows are checked here (:func:`~deepdpm_core.data.check_features`, at
        least ``config.init.rows_needed``); a rank's are checked as they are read (they
        may be fewer, or none), their count over all ranks before the ranks start.
    comm : Communicator, optional
        Defaults to single-process.
    wrap : callable, optional
        Applied to each net after it is built or reshaped (e.g. DDP); identity by default.
    state : dict, optional
        A checkpoint's :meth:`Search.state_dict`, of these rows, to resume from.

    Raises
    ------
    DataError
        A single process's rows are not a finite (N, D) array of numbers, or fewer than
        ``config.init.rows_needed``.
    CheckpointError
        The rows are not the state's (:meth:`Search.resume`).
    """
    if comm is None:
        rows = check_features(rows, min_rows=config.init.rows_needed)
    x = rows if isinstance(rows, torch.Tensor) else readonly_tensor(rows)
    if state is not None and x.shape[1] != state.get("dim", x.shape[1]):
        raise CheckpointError(f"the checkpoint was trained on {state['dim']}-D rows, these have {x.shape[1]}")
    ctx = fit_context(config, x, comm or LocalCommunicator(), wrap or (lambda m: m))
    search = (ExactEM if searches_by_exact_em(ctx.n_total, config.small_data.max_rows) else MinibatchSearch)(config, ctx)
    if state is not None:
        search.resume(state)
    return search
