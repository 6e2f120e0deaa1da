"""How often a fit's request, followed from :func:`pipeline.fit.run_fit` through the calls,
comes back to a module it had already left: a measure of how scattered the driver is.

The count, precisely. A *request frame* is a call of a function of this checkout
(``deepdpm_core`` or ``pipeline``) that receives a :class:`~pipeline.fit.request.FitRequest`
among its arguments (``self`` included, so the request's own methods count). Nested request
frames form a tree (a frame's parent is the nearest request frame below it on the stack; calls
that do not receive the request are looked through). Walk that tree depth-first as it ran:
each call into a child and each return to its parent moves the walk to the module of the
frame it lands in. Every move that lands in another module than the one the walk is in, a
module the walk has been in before, counts one: a *hop back*. A call into a new module and a
call within one module cost nothing; a call into another module costs one when it returns
(the walk hops back to the caller), and one more if that module had been visited before.

The fit: ``deepdpm fit`` in local mode, tracked to a sqlite MLflow store, of 300 labelled
4-D blobs (``bench/same_answers.py``'s data) for 6 epochs, resumable (checkpoints every 5).
Prints the walk with ``--walk``, then the count (``--json``: as one JSON line,
``{"hops_back": ..., "request_frames": ...}``).

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/request_hops.py [--walk] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's packages, as the other benchmarks
PACKAGES = (str(ROOT / "deepdpm_core") + os.sep, str(ROOT / "pipeline") + os.sep)


def _module(filename: str) -> str | None:
    """The dotted module of a file of this checkout's packages, else None."""
    if not filename.startswith(PACKAGES):
        return None
    rel = Path(filename).relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def request_walk(run) -> list[tuple[str, str, str]]:
    """Run ``run()`` under a profiler; the walk of its request frames: (``"call"`` or
    ``"return"``, the module landed in, the function landed in), in order."""
    from pipeline.fit.request import FitRequest

    walk: list[tuple[str, str, str]] = []
    stack: list[tuple[object, str, str]] = []  # open request frames: (frame, module, function)

    def carries_request(frame) -> bool:
        code = frame.f_code
        n_args = code.co_argcount + code.co_kwonlyargcount
        return any(isinstance(frame.f_locals.get(name), FitRequest) for name in code.co_varnames[:n_args])

    def profile(frame, event, arg):
        if event == "call":
            module = _module(frame.f_code.co_filename)
            if module is not None and carries_request(frame):
                stack.append((frame, module, frame.f_code.co_name))
                walk.append(("call", module, frame.f_code.co_name))
        elif event == "return" and stack and stack[-1][0] is frame:
            stack.pop()
            if stack:
                walk.append(("return", stack[-1][1], stack[-1][2]))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return walk


def hops_back(walk: list[tuple[str, str, str]]) -> int:
    """The moves of ``walk`` that land in another module than the walk's, one visited before."""
    seen: set[str] = set()
    current, count = None, 0
    for _, module, _ in walk:
        if module != current and module in seen:
            count += 1
        seen.add(module)
        current = module
    return count


def local_fit(tmp: Path):
    """The request of the fit of the module docstring, its files in ``tmp``."""
    from pipeline.fit.request import FitRequest

    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 4)) * 8
    y = np.repeat(np.arange(3), 100)
    x = centres[y] + rng.normal(size=(300, 4))
    data = tmp / "blobs.csv"
    header = ",".join([*(f"f{i}" for i in range(4)), "label"])
    np.savetxt(data, np.column_stack([x, y]), delimiter=",", header=header, comments="",
               fmt=["%.6f"] * 4 + ["%d"])
    return FitRequest(input=str(data), output=str(tmp / "out"), config={"schedule": {"max_epochs": 6}},
                      mode="local", quiet=True, tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}", experiment="hops")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--walk", action="store_true", help="print the walk, one move a line")
    parser.add_argument("--json", action="store_true", help="print the count as one JSON line")
    args = parser.parse_args()
    from pipeline.fit import run_fit

    with tempfile.TemporaryDirectory() as tmp:
        request = local_fit(Path(tmp))  # built before the walk starts: it follows run_fit alone
        walk = request_walk(lambda: run_fit(request))
    if args.walk:
        seen: set[str] = set()
        current = None
        for kind, module, function in walk:
            back = module != current and module in seen
            print(f"{'*' if back else ' '} {kind:6} {module}.{function}")
            seen.add(module)
            current = module
    count = {"hops_back": hops_back(walk), "request_frames": sum(kind == "call" for kind, _, _ in walk)}
    print(json.dumps(count) if args.json else f"hops back: {count['hops_back']} (request frames: "
          f"{count['request_frames']})")


if __name__ == "__main__":
    main()
