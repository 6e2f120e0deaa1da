"""Feature columns that look like class codes: the answer taken as a question.

A table's label column that is not named as one becomes a feature, and the fit then
clusters by it (iris with its ``target`` among the features finds the classes it was
given). A column is suspect when its name is one that tables give their classes
(:data:`CLASS_NAMES`, in any case), or when it holds a few distinct whole numbers while
some other feature holds fractions. This module needs NumPy only, so the command line can
ask before torch loads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: names tables give their class column (scikit-learn's ``as_frame`` tables: ``target``)
CLASS_NAMES = frozenset({"target", "class", "label", "y"})
#: at most this many distinct whole numbers make a column a class code
MAX_CODES = 20
#: rows looked at (the first ones): enough to tell codes from measurements
SAMPLE_ROWS = 10_000


def class_code_columns(X: np.ndarray, names: Sequence[str]) -> list[str]:
    """The columns of ``X`` (N, D), named ``names``, that look like class codes.

    Parameters
    ----------
    X : ndarray of shape (N, D)
        The feature columns as numbers.
    names : sequence of str
        The name of each column.

    Returns
    -------
    list of str
        In column order: those named as classes are, and those of 2 to :data:`MAX_CODES`
        distinct whole numbers in a table where another column holds fractions.
    """
    sample = np.asarray(X[:SAMPLE_ROWS], dtype=np.float64)
    with np.errstate(invalid="ignore"):
        whole = (sample == np.round(sample)).all(axis=0)
    found = []
    for j, name in enumerate(names):
        if str(name).strip().lower() in CLASS_NAMES:
            found.append(str(name))
        elif whole[j] and not whole.all() and 2 <= len(np.unique(sample[:, j])) <= MAX_CODES:
            found.append(str(name))
    return found


__all__ = ["CLASS_NAMES", "MAX_CODES", "class_code_columns"]
