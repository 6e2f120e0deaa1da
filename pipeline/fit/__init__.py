"""``deepdpm fit`` in every mode: one request, one epoch runner, one set of outputs
(docs/design.md, "Package map" and "Fit modes"). Submodules are imported on use: the Ray
mode pulls in Ray, the others do not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.fit.outputs import FitResult
    from pipeline.fit.request import FitRequest
    from pipeline.fit.runner import FaultHook


def run_fit(request: FitRequest, *, fault: FaultHook | None = None) -> FitResult:
    """Run ``request`` in its mode and return its result.

    Parameters
    ----------
    request : FitRequest
    fault : callable, optional
        Test-only crash injection, ``fault(epoch, rank)`` before each epoch.

    Returns
    -------
    FitResult

    Raises
    ------
    CheckpointError
        ``request.resume`` and the folder's request, input and finished fit do not
        belong together (:meth:`~pipeline.fit.request.FitRequest.check_resumable`).
    """
    if request.resume:
        request.check_resumable()
    else:
        request = request.stamped()
    if request.mode == "ray":
        from pipeline.fit.ray import run_ray_fit

        return run_ray_fit(request, fault=fault)
    if request.mode == "alternating":
        from pipeline.fit.alternating import run_alternating_fit

        return run_alternating_fit(request, fault=fault)
    from pipeline.fit.local import run_local_fit

    return run_local_fit(request, fault=fault)


__all__ = ["run_fit"]
