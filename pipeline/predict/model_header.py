"""What a model file says about its input, read without torch: D and the feature names.

``deepdpm predict`` checks its input's columns against the model before torch loads, so a
table with a column too many or too few is answered at once. The model's dict is read by
:func:`pipeline.predict.numpy_assigner.read_model_state`, no tensor of it from disk.
Whatever that cannot read (another format, a damaged file) is left to torch's loader,
which names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.predict.numpy_assigner import read_model_state


@dataclass(frozen=True)
class ModelHeader:
    """A model file's input: ``dim`` features, named ``feature_names`` (None: unnamed)."""

    dim: int
    feature_names: list[str] | None


def read_model_header(path: str | Path) -> ModelHeader | None:
    """The input a model file takes, or None where it cannot be read so (torch then says why).

    Parameters
    ----------
    path : path
        A ``model.pt`` written by ``deepdpm fit`` or :meth:`DeepDPM.save`.
    """
    state = read_model_state(path, ("dim", "feature_names"))
    if state is None or not isinstance(state.get("dim"), int):
        return None
    names = state.get("feature_names")
    if not (isinstance(names, list) and len(names) == state["dim"]
            and all(isinstance(n, str) for n in names)):
        names = None
    return ModelHeader(state["dim"], names)


__all__ = ["ModelHeader", "read_model_header"]
