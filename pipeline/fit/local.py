"""A fit in the calling process, stoppable and resumable with ``--checkpoint-every``.

The rows are read whole, one :class:`~deepdpm_core.training.search.Search` fits them
through :func:`pipeline.fit.runner.run_epochs`, and the outputs are published together
(:mod:`pipeline.fit.outputs`). A resumable request also keeps ``OUT/fit_request.json`` and
a checkpoint every ``checkpoint_every`` epochs; a resumed fit runs its remaining epochs
exactly as the uninterrupted fit would have. Ctrl-C lets the current epoch end, writes a
checkpoint and the request, and raises :class:`~pipeline.fit.interrupts.FitInterrupted`
naming ``--resume DIR``. Details: docs/reliability.md, "A long single-process fit can be
stopped and resumed".
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from deepdpm_core import DeepDPM
from deepdpm_core.errors import ConfigError
from deepdpm_core.progress_bars import epoch_bar
from deepdpm_core.training import Search
from pipeline.fit import checkpoints, outputs, runner
from pipeline.fit.interrupts import FitInterrupted, stop_between_epochs
from pipeline.fit.request import FitRequest
from pipeline.fit.runner import FaultHook

#: seconds into a fit after which it is tracked live; a shorter fit is tracked once its
#: outputs are published, without MLflow's start-up (seconds of CPU) slowing its epochs.
#: $DEEPDPM_TRACK_LIVE_AFTER_S sets another (0: live from the first epoch)
TRACK_LIVE_AFTER_S = 30.0


def track_live_after_s() -> float:
    """:data:`TRACK_LIVE_AFTER_S`, or ``$DEEPDPM_TRACK_LIVE_AFTER_S``.

    Raises
    ------
    ConfigError
        The variable is not a number of seconds >= 0.
    """
    value = os.environ.get("DEEPDPM_TRACK_LIVE_AFTER_S")
    if value is None:
        return TRACK_LIVE_AFTER_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ConfigError(f"DEEPDPM_TRACK_LIVE_AFTER_S must be seconds >= 0, got {value!r}")
    return seconds


def run_local_fit(request: FitRequest, *, fault: FaultHook | None = None) -> outputs.FitResult:
    """Fit ``request.input`` in this process and write every output.

    Parameters
    ----------
    request : FitRequest
        ``mode`` "local"; with ``resumable``, checkpoints every ``checkpoint_every``
        epochs, and ``resume`` continues from the latest one.
    fault : callable, optional
        Test-only crash injection (:func:`pipeline.fit.runner.fault_before_next`).

    Returns
    -------
    FitResult
    """
    from pipeline.fit.epoch_scores import EpochLabelScores
    from pipeline.io.tables import read_features
    from pipeline.tracking.fit_runs import log_fit_outputs

    config = request.fit_config()
    # a resumable fit stores the fingerprint of the bytes it parsed, not of a second read
    table = read_features(request.input, request.table_columns,
                          fingerprint=request.resumable and not request.resume)
    if table.fingerprint is not None:
        request = request.with_(input_fingerprint=table.fingerprint)
    out = Path(request.output)
    # None: a fresh fit, or one stopped before its first checkpoint
    state = checkpoints.latest_state(out, request.fit_id) if request.resumable and request.resume else None
    # MLflow starts once the outputs are published, or live after TRACK_LIVE_AFTER_S
    tracker = request.tracker(hold_s=track_live_after_s())
    with tracker:
        # checks the rows first: rows that cannot be fitted leave the output folder as it was
        search = runner.start_job(config, table.X, tracker, request.input, state=state)
        # checked, the rows are float32 numbers as they are: a float64 table is not kept
        # beside the search through the fit
        table.X = table.X.astype(np.float32, copy=False)
        if request.resumable and not request.resume:
            if request.overwrite:  # a later --resume must not restore the earlier fit's
                checkpoints.remove_checkpoints(out)
            out.mkdir(parents=True, exist_ok=True)
            request.save()
        # nmi/ari/acc on <= 10k labelled rows every epoch
        scores = EpochLabelScores.for_labels(table.X, table.labels, seed=config.seed)
        try:
            with stop_between_epochs(lambda: search.epoch + 1) as stop:
                checkpoint = runner.every(search, request.checkpoint_every if request.resumable else 0,
                                          lambda t: checkpoints.write_checkpoint(t, out, request.fit_id))
                callbacks = [runner.stop_on(stop), *checkpoint, *runner.fault_before_next(search, fault)]
                fit_seconds = runner.run_epochs(search, callbacks, tracker, scores,
                                                progress=None if request.quiet else epoch_bar)
            extra = outputs.request_extra(request.fit_id, request.columns, runner.data_variance_summary(search),
                                          resumed_from=search.resumed_from)
            # looked up in the module at call time: tests/support/fault_harness.py replaces it
            summary = outputs.write_fit_outputs(out, DeepDPM.from_search(search), table,
                                                fit_seconds, request.input, extra=extra,
                                                replaced=outputs.replaced_entries(request.resumable))
        except KeyboardInterrupt as exc:
            # at an epoch's end (or with every epoch done, while the outputs were written)
            # the search is whole; a second Ctrl-C mid-epoch left it half-updated
            whole = isinstance(exc, FitInterrupted) or search.finished
            raise _interrupted(request, search, out, whole) from None
        tracker.release()  # the outputs are published
        log_fit_outputs(tracker, out)  # + final_nmi/ari/acc over all labelled rows
    return outputs.FitResult(summary, str(out), tracker.run_id,
                             tracking_uri=tracker.shown_uri if tracker.run_id else None)


def _interrupted(request: FitRequest, search: Search, out: Path, whole: bool) -> FitInterrupted:
    """Keep what a Ctrl-C'd fit can be resumed from; the error saying how.

    Parameters
    ----------
    request : FitRequest
    search : Search
    out : Path
        The output folder.
    whole : bool
        The search stands at the end of an epoch: it is checkpointed (a fit without
        checkpoints becomes resumable: its request is stored, and checkpoints an earlier
        fit left in ``out`` under ``--overwrite`` are dropped first).

    Returns
    -------
    FitInterrupted
    """
    if whole:
        if not request.resumable:
            checkpoints.remove_checkpoints(out)
            out.mkdir(parents=True, exist_ok=True)
            request.with_(resumable=True).save()
        checkpoints.write_checkpoint(search, out, request.fit_id)
        return FitInterrupted(f"after epoch {search.epoch}: deepdpm fit --resume {out} "
                              "continues it")
    kept = checkpoints.checkpoint_paths(out) if request.resumable else []
    if kept:
        stored = int(kept[-1].stem.split("_")[1])
        return FitInterrupted(f"in epoch {search.epoch + 1}: deepdpm fit --resume {out} "
                              f"continues from epoch {stored}")
    return FitInterrupted(f"in epoch {search.epoch + 1}, before any checkpoint: nothing "
                          "to resume")


__all__ = ["run_local_fit"]
