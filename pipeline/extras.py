"""The optional parts of deepdpm (pip extras) and the error naming the one to install.

``pip install deepdpm`` gives the estimator and the commands on local files (``fit``,
``predict`` and ``embed`` in this process, ``report`` of a fit folder). The rest are extras
(pyproject.toml): ``ray`` (``fit`` on Ray, ``predict`` over a folder), ``mlflow``
(tracking, MLflow models and run ids), ``extract`` (``shards``, ``extract``: webdataset,
Pillow, torchvision and Ray), ``umap`` (``embed --method umap|ae-umap``, ``demo``), and
``all`` (every one of them but ``gpu``). A command checks for the extra a path needs with
:func:`require` before it imports any of it, so a missing one is answered at once with
one line, ``deepdpm fit: error: … pip install "deepdpm[ray]"``, and exit code 2. Nothing
here imports the packages it checks for.
"""

from __future__ import annotations

import importlib.util

from deepdpm_core.errors import DeepDPMError

#: extra -> the top-level modules it provides (the ``extract`` extra includes Ray)
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "ray": ("ray",),
    "mlflow": ("mlflow",),
    "extract": ("webdataset", "PIL", "torchvision", "ray"),
    "umap": ("umap",),
}

#: module -> the distribution that installs it, as an error names it
DISTRIBUTIONS: dict[str, str] = {"PIL": "pillow", "umap": "umap-learn"}


class MissingExtraError(DeepDPMError):
    """A command path needs an optional part of deepdpm that is not installed."""


def importable(module: str) -> bool:
    """Whether ``import module`` can find it (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken parent, or a module set to None
        return False


def missing_modules(extra: str, modules: tuple[str, ...] | None = None) -> list[str]:
    """The modules of ``extra`` (or just ``modules`` of it) that cannot be imported."""
    return [m for m in (EXTRA_MODULES[extra] if modules is None else modules)
            if not importable(m)]


def installed(extra: str) -> bool:
    """Whether every module of ``extra`` can be imported."""
    return not missing_modules(extra)


def require(what: str, *extras: str, modules: tuple[str, ...] | None = None,
            note: str | None = None) -> None:
    """Raise :class:`MissingExtraError` naming the extras to install unless ``extras`` are.

    Parameters
    ----------
    what : str
        What needs them, as the message starts: ``"a fit on Ray (--num-workers 2)"``.
    *extras : str
        Keys of :data:`EXTRA_MODULES`.
    modules : tuple of str, optional
        Only these modules of a single extra are needed (``deepdpm shards`` needs
        webdataset and Pillow of ``extract``, not Ray).
    note : str, optional
        Appended in parentheses: another way out (``"or pass --no-tracking"``).

    Raises
    ------
    MissingExtraError
        ``<what> needs ray, which is not installed: pip install "deepdpm[ray]"``.
    """
    missing: dict[str, list[str]] = {}
    for extra in extras:
        gone = missing_modules(extra, modules)
        if gone:
            missing[extra] = gone
    if not missing:
        return
    names = list(dict.fromkeys(DISTRIBUTIONS.get(m, m) for gone in missing.values()
                               for m in gone))
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    verb = "is" if len(names) == 1 else "are"
    raise MissingExtraError(f"{what} needs {listed}, which {verb} not installed: "
                            f'pip install "deepdpm[{",".join(missing)}]"'
                            + (f" ({note})" if note else ""))


__all__ = ["EXTRA_MODULES", "MissingExtraError", "importable", "installed", "missing_modules",
           "require"]
