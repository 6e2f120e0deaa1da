"""A real local Ray cluster for tests: one per test module that asks for it.

Use it in a module-scoped fixture::

    from tests.support.ray_cluster import local_ray

    @pytest.fixture(scope="module")
    def ray_session():
        with local_ray():
            yield
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def local_ray(**kwargs: Any) -> Iterator[None]:
    """``ray.init(address="local", num_cpus=2, **kwargs)`` whose workers import this
    checkout; ``$RAY_ADDRESS`` is hidden meanwhile (a fit or predict would attach to it)."""
    import ray

    address = os.environ.pop("RAY_ADDRESS", None)
    ray.init(address="local", num_cpus=2, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}}, **kwargs)
    try:
        yield
    finally:
        ray.shutdown()
        if address is not None:
            os.environ["RAY_ADDRESS"] = address
