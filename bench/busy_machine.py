"""A default fit alone and beside CPU-bound neighbours, with idle threads that spin or sleep.

Usage: python bench/busy_machine.py [--cases iris blobs5k blobs70k demo] [--threads 2]
       [--repeat 1] [--timeout 600] [--quick] [--json [FILE]]

Each measurement runs ``DeepDPM(random_state=0).fit(X)`` in a fresh Python process, so
the thread settings apply as they do for a user: ``OMP_NUM_THREADS`` = ``--threads`` and

* **before**: what deepdpm did before it set them: ``OMP_WAIT_POLICY``, ``KMP_BLOCKTIME``
  and ``NUMBA_THREADING_LAYER`` unset, and the fit process loads torch, numpy,
  scikit-learn and faiss (and numba for ``demo``) before ``deepdpm_core``, so their
  runtimes start with their own defaults (libgomp: idle threads spin a while, then
  sleep) before the library's defaults are set. (``OMP_WAIT_POLICY=ACTIVE``, spinning
  without end, is no stand-in for that: with 2 threads on 2 cores shared with other
  jobs an iris fit ran over 4 minutes with it and no neighbour, against 13-29 s with the
  old default in docs/benchmarks.md, "A default fit on a busy machine, before and after idle threads sleep");
* **after**: the defaults (none of the three set by the caller; ``deepdpm_core`` sets
  the OpenMP ones when it loads, and the ``demo`` case gets the ``deepdpm`` command's
  ``NUMBA_THREADING_LAYER=workqueue``).

The cases: ``iris`` (150 x 4, standardised), ``blobs5k`` and ``blobs70k`` (``make_blobs``,
10-D, 10 clusters) and ``demo`` (the demo's UMAP of scikit-learn's digits to 10-D, then a
fit with ``cluster_configs/n2d.yaml``, timed together in one process). "busy" runs the
same beside ``--neighbours`` processes (default: one per core) that each spin a plain
Python loop; the bench starts them for each busy run and kills them after it, also on
Ctrl-C or an error (and each exits by itself when the bench's process is gone).

The table gives the fit's seconds alone and busy, busy/alone, and that ratio over the
slowdown a fair share of the cores gives: with n neighbours, t fit threads and c cores
each runnable thread gets c / (n + t) of a core, a slowdown of max(1, (n + t) / c). The
target: busy/alone within 2x of that fair slowdown. A run past ``--timeout``
seconds is stopped and shown as "> timeout" (no ratio when the fit alone was stopped).
The machine may be shared with other work: compare the ratios, not the seconds across
runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES = ("iris", "blobs5k", "blobs70k", "demo")
MODES = ("before", "after")
#: a spinning neighbour that also ends once the bench's process (its parent) is gone
NEIGHBOUR = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"
#: what the library and the ``deepdpm`` command set where unset (deepdpm_core.idle_threads)
IDLE_VARIABLES = ("OMP_WAIT_POLICY", "KMP_BLOCKTIME", "NUMBA_THREADING_LAYER")


# ------------------------------------------------------------------------- the fit process
def _child(case: str, mode: str, max_epochs: int | None) -> None:
    """Load ``case``, fit it and print one JSON line: seconds, K and epochs."""
    if mode == "before":  # the runtimes load before deepdpm_core can set their defaults
        import faiss  # noqa: F401
        import numpy  # noqa: F401
        import sklearn.cluster  # noqa: F401
        import torch  # noqa: F401

        if case == "demo":
            import umap  # noqa: F401
    # "after": deepdpm first, as a user's program imports it: its thread defaults apply
    # before torch, numpy and scikit-learn load their runtimes
    from deepdpm_core import DeepDPM

    params = {} if max_epochs is None else {"schedule__max_epochs": max_epochs}
    if case == "demo":
        from sklearn.datasets import load_digits

        from deepdpm_core.config import load_config
        from deepdpm_core.features import embed

        config = load_config(ROOT / "cluster_configs" / "n2d.yaml").with_overrides({"seed": 0})
        pixels = load_digits().data.astype("float32") / 16.0
        start = time.perf_counter()
        X = embed(pixels, "umap", config, dim=10).embedding
        model = DeepDPM(ROOT / "cluster_configs" / "n2d.yaml", random_state=0, **params).fit(X)
    else:
        X = _data(case)
        start = time.perf_counter()
        model = DeepDPM(random_state=0, **params).fit(X)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "k": int(model.n_clusters_),
                      "epochs": len(model.history_)}))


def _data(case: str):
    """The rows of a tabular case."""
    if case == "iris":
        from sklearn.datasets import load_iris
        from sklearn.preprocessing import StandardScaler

        return StandardScaler().fit_transform(load_iris().data)
    from sklearn.datasets import make_blobs

    n = {"blobs5k": 5_000, "blobs70k": 70_000}[case]
    return make_blobs(n_samples=n, centers=10, n_features=10, random_state=0)[0]


# ------------------------------------------------------------------------------ the bench
def fit_environment(mode: str, case: str, threads: int) -> dict[str, str]:
    """The environment of a fit process in ``mode`` ("before" or "after").

    Parameters
    ----------
    mode : str
        "before" leaves the three variables unset, "after" too, as a user does.
    case : str
        ``demo`` runs as the ``deepdpm`` command does, which also sets the numba layer.
    threads : int
        ``OMP_NUM_THREADS``.

    Returns
    -------
    dict[str, str]
    """
    env = {k: v for k, v in os.environ.items() if k not in IDLE_VARIABLES}
    env.update(OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    if mode == "after" and case == "demo":
        env["NUMBA_THREADING_LAYER"] = "workqueue"
    return env


@contextlib.contextmanager
def busy_neighbours(count: int) -> Iterator[list[subprocess.Popen]]:
    """``count`` processes that each spin a core, killed when the block ends however it ends."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen([sys.executable, "-c", NEIGHBOUR]))
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def time_fit(case: str, mode: str, threads: int, timeout: float,
             max_epochs: int | None) -> dict:
    """One fit in a new process: its JSON line, or ``{"timed_out": True}`` past ``timeout``."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", case, "--modes", mode]
    if max_epochs is not None:
        argv += ["--max-epochs", str(max_epochs)]
    try:
        done = subprocess.run(argv, env=fit_environment(mode, case, threads), cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:  # run() has killed the fit
        return {"seconds": None, "timed_out": True}
    if done.returncode != 0:
        raise RuntimeError(f"{case} ({mode}) failed:\n{done.stderr[-3000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "timed_out": False}


def summarise(runs: list[dict], timeout: float) -> float:
    """Median seconds of ``runs``, a timed-out run counted as ``timeout`` (a lower bound)."""
    return statistics.median(timeout if r["timed_out"] else r["seconds"] for r in runs)


def fair_slowdown(neighbours: int, threads: int, cores: int) -> float:
    """The slowdown of a fit with a fair share of the cores: max(1, (n + t) / c)."""
    return max(1.0, (neighbours + threads) / cores)


def _seconds(runs: list[dict], timeout: float) -> str:
    return ", ".join(f"> {timeout:.0f}" if r["timed_out"] else f"{r['seconds']:.1f}" for r in runs)


def table(rows: list[dict]) -> str:
    """The Markdown table of ``rows`` (one per case and mode)."""
    lines = ["| case | mode | threads | alone s | busy s | busy/alone | fair slowdown | "
             "busy/alone ÷ fair | K alone / busy |",
             "|---|---|---:|---|---|---:|---:|---:|---|"]
    for r in rows:
        bound = ">" if any(x["timed_out"] for x in r["busy"]) else ""
        ratio, over_fair = (("–", "–") if r["busy_over_alone"] is None else
                            (f"{bound}{r['busy_over_alone']:.2f}", f"{bound}{r['over_fair']:.2f}"))
        ks = "/".join(str(x.get("k", "–")) for x in (*r["alone"], *r["busy"]))
        lines.append(
            f"| {r['case']} | {r['mode']} | {r['threads']} | {_seconds(r['alone'], r['timeout'])} | "
            f"{_seconds(r['busy'], r['timeout'])} | {ratio} | {r['fair_slowdown']:.2f} | "
            f"{over_fair} | {ks} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="OMP_NUM_THREADS of each fit (default: one per core)")
    ap.add_argument("--neighbours", type=int, default=os.cpu_count(),
                    help="busy processes beside a busy run (default: one per core)")
    ap.add_argument("--repeat", type=int, default=1, help="fits per case, mode and setting")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before a fit is stopped")
    ap.add_argument("--max-epochs", type=int, default=None, help="cap each fit (default: the config's)")
    ap.add_argument("--quick", action="store_true",
                    help="iris only, 1 thread, 3 epochs: a check that the bench runs")
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                    help="write the results as JSON to FILE (no FILE: as the last line of stdout)")
    ap.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.modes[0], args.max_epochs)
        return
    if args.quick:
        args.cases, args.threads, args.max_epochs = ["iris"], 1, 3
    cores = os.cpu_count()
    fair = fair_slowdown(args.neighbours, args.threads, cores)
    rows: list[dict] = []
    report = {"cores": cores, "neighbours": args.neighbours, "threads": args.threads,
              "repeat": args.repeat, "max_epochs": args.max_epochs, "rows": rows}
    for case in args.cases:
        for mode in args.modes:
            runs: dict[str, list[dict]] = {"alone": [], "busy": []}
            for _ in range(args.repeat):
                runs["alone"].append(time_fit(case, mode, args.threads, args.timeout, args.max_epochs))
                with busy_neighbours(args.neighbours):
                    runs["busy"].append(time_fit(case, mode, args.threads, args.timeout,
                                                 args.max_epochs))
            ratio = None  # unknown when the fit alone ran past the timeout
            if not any(run["timed_out"] for run in runs["alone"]):
                ratio = summarise(runs["busy"], args.timeout) / summarise(runs["alone"], args.timeout)
            rows.append({"case": case, "mode": mode, "threads": args.threads, **runs,
                         "timeout": args.timeout, "busy_over_alone": ratio,
                         "fair_slowdown": fair, "over_fair": None if ratio is None else ratio / fair})
            print(f"{case} {mode}: busy/alone {ratio}", file=sys.stderr, flush=True)
            if args.json not in (None, "-"):  # the rows so far survive a run stopped later
                # imported here: it loads numpy, which a --child run must load after its settings
                from deepdpm_core.atomic_files import write_json_atomic

                write_json_atomic(report, args.json)
    print(f"{cores} cores, {args.neighbours} busy neighbours, OMP_NUM_THREADS={args.threads}; "
          "seconds of each fit; target: busy/alone ÷ fair <= 2\n")
    print(table(rows))
    if args.json == "-":
        print(json.dumps(report))


if __name__ == "__main__":
    main()
