"""What a model file says about its input, read without torch: D and the feature names.

``deepdpm predict`` checks its input's columns against the model before torch loads, so a
table with a column too many or too few is answered at once. A model file is a torch zip
archive whose ``data.pkl`` holds the model's dict (:meth:`FittedModel.state_dict
<deepdpm_core.model.fitted_model.FittedModel.state_dict>`) with its tensors stored apart;
that pickle is read here with every global but plain containers replaced by a stand-in
that builds nothing, so no code in the file runs and no tensor is read. Whatever this
cannot read (another format, a damaged file) is left to torch's loader, which names it.
"""

from __future__ import annotations

import collections
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelHeader:
    """A model file's input: ``dim`` features, named ``feature_names`` (None: unnamed)."""

    dim: int
    feature_names: list[str] | None


class _StandIn:
    """What a tensor or any other non-container global of the pickle becomes: nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


class _PlainUnpickler(pickle.Unpickler):
    """Plain containers as themselves; every other global a :class:`_StandIn`."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        return _StandIn

    def persistent_load(self, pid: Any) -> None:  # a tensor's storage, never read
        return None


def data_pickle(archive: zipfile.ZipFile) -> str | None:
    """The name of a torch zip archive's one ``data.pkl`` member; None: not one."""
    pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
    return pickles[0] if len(pickles) == 1 else None


def read_model_header(path: str | Path) -> ModelHeader | None:
    """The input a model file takes, or None where it cannot be read so (torch then says why).

    Parameters
    ----------
    path : path
        A ``model.pt`` written by ``deepdpm fit`` or :meth:`DeepDPM.save`.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            member = data_pickle(archive)
            if member is None:
                return None
            with archive.open(member) as f:
                state = _PlainUnpickler(f).load()
    except (OSError, zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError,
            TypeError, AttributeError, IndexError, KeyError):
        return None
    if not isinstance(state, dict) or not isinstance(state.get("dim"), int):
        return None
    names = state.get("feature_names")
    if not (isinstance(names, list) and len(names) == state["dim"]
            and all(isinstance(n, str) for n in names)):
        names = None
    return ModelHeader(state["dim"], names)


__all__ = ["ModelHeader", "data_pickle", "read_model_header"]
