"""Epoch histories written by hand, with the move rounds a fit's schedule would name."""

from deepdpm_core.config import Config, from_dict
from deepdpm_core.moves import MoveSchedule


def named_rounds(history: list[dict], config=None) -> list[dict]:
    """``history`` with the round each record ends (``move``) and whether the fit stops
    there (``stop_reason``, ``converged``), as the fit's schedule (``config``: a Config,
    its dict, or None for the defaults) names them."""
    cfg = config if isinstance(config, Config) else from_dict(config)
    sched = MoveSchedule(cfg.schedule, cfg.moves)
    named = []
    for epoch, record in enumerate(history, start=1):
        move = sched.move_at(epoch)
        if move:
            sched.moved(epoch, record["splits_accepted"] + record["merges_accepted"], record["n_clusters"])
        named.append({**record, "move": move, "stop_reason": sched.stop_reason(epoch),
                      "converged": sched.converged()})
    return named
