"""A model file read without torch, and its assigner in NumPy: ``deepdpm predict`` on the CPU.

Assigning rows is the input transform and the clustering net's forward pass: a few small
float32 GEMMs, while importing torch alone takes about 2 s. :func:`read_model_state` reads
a model file's torch zip archive: its ``data.pkl`` references each tensor's storage, the
member ``data/<key>``, by a persistent id and rebuilds the tensor with
``torch._utils._rebuild_tensor_v2``; the unpickler maps exactly those globals (and
``collections.OrderedDict``) to NumPy builders and refuses every other, so no code in the
file runs. Only the tensors asked for are read from disk.

:class:`NumpyAssigner` computes what :class:`~deepdpm_core.model.fitted_model.ClusterAssigner`
computes on the CPU, in the same dtypes; the labels agree and the confidences agree to
float32 round-off (BLAS's summation order, not torch's).
"""

from __future__ import annotations

import collections
import pickle
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deepdpm_core.errors import DataError

#: the model file format read here (``deepdpm_core.model.fitted_model.FORMAT``)
FORMAT = "deepdpm-model/1"
#: the keys of a model file that assigning rows reads
ASSIGNER_KEYS = ("format", "config", "coordinates", "cluster_net")
#: ``model.precision`` values under which the CPU forward is plain float32 (``tf32`` acts on
#: CUDA only; ``bf16`` runs under autocast, which is left to torch)
FLOAT32_PRECISIONS = ("auto", "float32", "tf32")
#: the transforms :class:`FeatureCoordinates <deepdpm_core.data.FeatureCoordinates>` applies
TRANSFORMS = ("none", "normalize", "standard", "min_max")


@dataclass(frozen=True)
class _StorageType:
    """A torch storage class of the pickle (``torch.FloatStorage``...): its dtype."""

    dtype: np.dtype


#: the storage classes a model file's tensors use, by name
_STORAGES = {"FloatStorage": np.float32, "DoubleStorage": np.float64, "LongStorage": np.int64}


@dataclass(frozen=True)
class _Storage:
    """One storage of the archive, not read yet: member ``data/<key>``, ``numel`` items."""

    key: str
    dtype: np.dtype
    numel: int


@dataclass(frozen=True)
class _TensorRef:
    """A tensor of the pickle, not read yet (a view of a :class:`_Storage`)."""

    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor(storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...],
                    *_: Any) -> _TensorRef:
    """``torch._utils._rebuild_tensor_v2``'s arguments (requires_grad, hooks and metadata
    aside), kept to be read on demand."""
    if not (isinstance(storage, _Storage) and isinstance(offset, int)
            and all(isinstance(v, int) and v >= 0 for v in (*size, *stride))
            and len(size) == len(stride)):
        raise pickle.UnpicklingError("a tensor the NumPy reader cannot rebuild")
    return _TensorRef(storage, offset, tuple(size), tuple(stride))


class _TensorUnpickler(pickle.Unpickler):
    """The pickle of a torch zip archive, with tensors as :class:`_TensorRef` and every
    global but a tensor rebuild, a storage class and ``OrderedDict`` refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if module == "torch" and name in _STORAGES:
            return _StorageType(np.dtype(_STORAGES[name]))
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"global {module}.{name} refused")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str)
                and isinstance(pid[4], int)):
            raise pickle.UnpicklingError(f"a storage the NumPy reader cannot read: {pid!r:.80}")
        return _Storage(pid[2], pid[1].dtype, pid[4])


def _read_tensor(archive: zipfile.ZipFile, prefix: str, order: str, ref: _TensorRef) -> np.ndarray:
    """The array of ``ref``, copied out of its storage's bytes in the archive.

    Raises
    ------
    ValueError
        The storage is shorter than the tensor reaches, or not ``numel`` items long.
    """
    dtype = ref.storage.dtype.newbyteorder(order)
    data = np.frombuffer(archive.read(f"{prefix}data/{ref.storage.key}"), dtype=dtype)
    if data.size != ref.storage.numel:
        raise ValueError(f"storage {ref.storage.key} holds {data.size} items, not {ref.storage.numel}")
    if 0 in ref.size:
        return np.zeros(ref.size, dtype=dtype.newbyteorder("="))
    last = ref.offset + sum((n - 1) * s for n, s in zip(ref.size, ref.stride, strict=True))
    if ref.offset < 0 or last >= data.size:
        raise ValueError(f"a tensor beyond its storage {ref.storage.key}")
    view = np.lib.stride_tricks.as_strided(data[ref.offset:], shape=ref.size,
                                           strides=[s * data.itemsize for s in ref.stride],
                                           writeable=False)
    return np.array(view, dtype=dtype.newbyteorder("="))


def _materialised(archive: zipfile.ZipFile, prefix: str, order: str, value: Any) -> Any:
    """``value`` with every :class:`_TensorRef` in it (in dicts, lists, tuples) read."""
    if isinstance(value, _TensorRef):
        return _read_tensor(archive, prefix, order, value)
    if isinstance(value, dict):
        return {k: _materialised(archive, prefix, order, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_materialised(archive, prefix, order, v) for v in value)
    return value


def data_pickle(archive: zipfile.ZipFile) -> str | None:
    """The name of a torch zip archive's one ``data.pkl`` member; None: not one."""
    pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
    return pickles[0] if len(pickles) == 1 else None


def read_model_state(path: str | Path, keys: tuple[str, ...] = ASSIGNER_KEYS) -> dict[str, Any] | None:
    """The ``keys`` of a model file's dict (by default the assigner's, :data:`ASSIGNER_KEYS`;
    tensors as NumPy arrays), read without torch; None where the file is not a torch zip
    archive this reader knows, or its pickle references a global other than a tensor's, a
    storage's (float32, float64, int64) or ``OrderedDict`` (nothing in it has run).

    Parameters
    ----------
    path : path
        A ``model.pt`` written by ``deepdpm fit`` or :meth:`DeepDPM.save`.
    keys : tuple of str
        Only their tensors are read from disk.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            member = data_pickle(archive)
            if member is None:
                return None
            prefix = member[: -len("data.pkl")]
            names = set(archive.namelist())
            order = (archive.read(f"{prefix}byteorder").decode().strip()
                     if f"{prefix}byteorder" in names else sys.byteorder)
            if order not in ("little", "big"):
                return None
            with archive.open(member) as f:
                state = _TensorUnpickler(f).load()
            if not isinstance(state, dict):
                return None
            return _materialised(archive, prefix, "<" if order == "little" else ">",
                                 {k: state[k] for k in keys if k in state})
    except (OSError, zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError,
            TypeError, AttributeError, IndexError, KeyError, UnicodeDecodeError):
        return None


@dataclass(frozen=True)
class NumpyAssigner:
    """:class:`~deepdpm_core.model.fitted_model.ClusterAssigner` on the CPU in NumPy: the
    input transform x̃ = (r(x) − center) ⊙ mult (the ``kept`` coordinates) and the net
    log_softmax(W₂ relu(W₁ x̃ + b₁) + b₂).

    Attributes
    ----------
    normalize : bool
        r(x) divides each row by its L2 norm (``data.transform: normalize``).
    center, mult : ndarray of shape (D,), float64
    kept : ndarray of shape (r,), int64, or None
        The coordinates of x̃ the net reads; None: all D.
    w1 : ndarray of shape (H, r), float32
    b1 : ndarray of shape (H,), float32
    w2 : ndarray of shape (K, H), float32
    b2 : ndarray of shape (K,), float32
    """

    normalize: bool
    center: np.ndarray
    mult: np.ndarray
    kept: np.ndarray | None
    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: np.ndarray

    @property
    def dim(self) -> int:
        """D, the number of features."""
        return int(self.center.shape[0])

    @property
    def n_clusters(self) -> int:
        """K."""
        return int(self.w2.shape[0])

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> NumpyAssigner | None:
        """The assigner of :func:`read_model_state`'s dict; None where it is not a
        ``deepdpm-model/1`` model this class computes as torch does (a ``bf16`` forward,
        a malformed state: torch's loader then names what is wrong)."""
        try:
            if state.get("format") != FORMAT:
                return None
            if state["config"]["model"]["precision"] not in FLOAT32_PRECISIONS:
                return None
            coords, net = state["coordinates"], state["cluster_net"]
            if coords["kind"] not in TRANSFORMS:
                return None
            center = np.asarray(coords["center"], dtype=np.float64)
            mult = np.asarray(coords["mult"], dtype=np.float64)
            kept = np.asarray(coords["kept"], dtype=np.int64) if "kept" in coords else None
            w1, b1, w2, b2 = (np.asarray(net[k], dtype=np.float32) for k in
                              ("hidden.weight", "hidden.bias", "out.weight", "out.bias"))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        d = center.shape[0] if center.ndim == 1 else -1
        width = d if kept is None else (kept.shape[0] if kept.ndim == 1 else -1)
        shapes_fit = (
            d > 0 and mult.shape == (d,) and w1.ndim == 2 and w1.shape[1] == width
            and b1.shape == (w1.shape[0],) and w2.ndim == 2 and w2.shape[1] == w1.shape[0]
            and b2.shape == (w2.shape[0],) and w2.shape[0] > 0
            and (kept is None or bool(((kept >= 0) & (kept < d)).all()))
        )  # fmt: skip
        if not shapes_fit:
            return None
        return cls(coords["kind"] == "normalize", center, mult, kept, w1, b1, w2, b2)

    def coordinates(self, x: np.ndarray) -> np.ndarray:
        """x̃ of float32 rows (B, D) as the net reads it: float64 arithmetic, then float32."""
        x = x.astype(np.float64)
        if self.normalize:
            norms = np.sqrt(np.einsum("ij,ij->i", x, x))[:, None]
            x = x / np.maximum(norms, np.finfo(np.float64).tiny)
        x = (x - self.center) * self.mult
        if self.kept is not None:
            x = x[:, self.kept]
        return x.astype(np.float32)

    def log_proba(self, x: np.ndarray) -> np.ndarray:
        """ln r = log_softmax(f_cl(x̃)) of float32 rows (B, D); (B, K), float32."""
        h = self.coordinates(x) @ self.w1.T
        h += self.b1
        np.maximum(h, 0, out=h)
        logits = h @ self.w2.T
        logits += self.b2
        logits -= logits.max(axis=1, keepdims=True)
        logits -= np.log(np.exp(logits).sum(axis=1, keepdims=True))
        return logits

    def predict_confidence(self, X: np.ndarray, batch_size: int = 65536
                           ) -> tuple[np.ndarray, np.ndarray]:
        """Hard cluster of each row and its responsibility, ``batch_size`` rows at a time
        (:meth:`ClusterAssigner.predict_confidence
        <deepdpm_core.model.fitted_model.ClusterAssigner.predict_confidence>`).

        Parameters
        ----------
        X : ndarray of shape (N, D)
            Rows of numbers, taken as float32.

        Returns
        -------
        labels : ndarray of shape (N,), int64
        confidence : ndarray of shape (N,), float32

        Raises
        ------
        DataError
            X is not 2-D, not D features wide, or holds NaN or inf values (as float32).
        """
        X = np.asarray(X)
        if X.ndim != 2 or X.shape[1] != self.dim:
            raise DataError(f"X has shape {X.shape}, but the model takes rows of {self.dim} features")
        X = X.astype(np.float32, copy=False)
        if not np.isfinite(X).all():
            raise DataError(f"X has {int((~np.isfinite(X).all(1)).sum())} row(s) with NaN or inf values")
        labels = np.empty(X.shape[0], dtype=np.int64)
        confidence = np.empty(X.shape[0], dtype=np.float32)
        for s in range(0, X.shape[0], batch_size):
            lp = self.log_proba(X[s : s + batch_size])
            best = lp.argmax(axis=1)
            labels[s : s + len(lp)] = best
            confidence[s : s + len(lp)] = np.exp(lp[np.arange(len(lp)), best])
        return labels, confidence


def read_numpy_assigner(path: str | Path) -> NumpyAssigner | None:
    """The :class:`NumpyAssigner` of a model file, or None where it cannot be read so
    (another format, a ``bf16`` forward, a damaged or unsafe file: the torch loader then
    reads it or names what is wrong)."""
    state = read_model_state(path)
    return None if state is None else NumpyAssigner.from_state(state)


__all__ = ["NumpyAssigner", "read_model_state", "read_numpy_assigner"]
