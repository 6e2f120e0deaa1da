"""Operator launches and host synchronisations per minibatch step (torch.profiler).

Usage: OMP_NUM_THREADS=2 python bench/step_profile.py --n 200000 --d 64 --k 200
       [--device auto|cpu|cuda] [--json OUT.json]

Sets up the epoch of ``bench/scale.py`` (a generated mixture of K clusters, K-means
initialisation, moves off, the M-step on), runs one epoch untimed, then profiles a second
one. Each minibatch step starts where the step loop takes the batch's E-step targets
(``slot_targets``; a zero-length marker is recorded there), so the operators between the
first and the last marker are those of all steps but the last; per step they are:

* ``ops``: leaf ATen operators (those that call no other), about the kernels a step
  launches on a GPU;
* ``syncs``: operators that make the host wait for the device on CUDA:
  ``aten::_local_scalar_dense`` (``.item()``, ``float()``, ``bool()`` of a tensor, a Python
  branch on a tensor) and the operators whose output size depends on the data
  (``nonzero``, ``repeat_interleave`` of a tensor of repeats, ``unique``, ``bincount``,
  boolean indexing), counted in ``sync_ops`` by the outermost operator they run in, once
  per call of it. On the CPU, fused Adam's ``.item()`` of its step counts is reported apart
  (``cpu_only_syncs_per_step``): its CUDA kernel does not synchronise. On the CPU the
  subclustering nets size their overflow blocks by the data (``cluster_blocks``: one
  ``.item()`` a step, a wait that costs nothing there); off the CPU they take the
  fixed size, with no sync.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deepdpm_core.training.minibatch as minibatch  # noqa: E402
from deepdpm_core.config import Config  # noqa: E402
from deepdpm_core.data import make_mixture  # noqa: E402
from deepdpm_core.training import start_fit  # noqa: E402

#: where a step begins (the marker's name)
MARKER = "step_profile::step"
#: operators that wait for the device on CUDA (module docstring)
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::repeat_interleave", "aten::_unique2",
            "aten::masked_select", "aten::bincount")
#: the CPU kernel of fused Adam reads its step counts with ``.item()``; the CUDA one does not
CPU_ONLY = "aten::_fused_adam_"


def _marked(fn):
    def wrapper(*args, **kwargs):
        with record_function(MARKER):
            pass
        return fn(*args, **kwargs)
    return wrapper


def _outermost_op(event):
    """The outermost ATen operator ``event`` runs in (itself when none encloses it)."""
    outer, parent = event, event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            outer = parent
        parent = parent.cpu_parent
    return outer


def profile_steps(n: int, d: int, k: int, device: str, seed: int = 0) -> dict:
    """Operators and synchronisations per minibatch step (module docstring)."""
    x, _ = make_mixture(n, d, k, imbalance=1.0, min_weight=0.1 / k, random_state=seed)
    cfg = Config().with_overrides({
        "seed": seed, "device": device, "init.n_clusters": k, "schedule.warmup_epochs": 0,
        "moves.split": False, "moves.merge": False, "init.kmeans_iters": 5, "small_data.max_rows": 0})
    search = start_fit(cfg, torch.from_numpy(x))
    search.initialize()
    search.step_epoch()
    minibatch.slot_targets = _marked(minibatch.slot_targets)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if search.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        search.step_epoch()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    marks = [e.time_range.start for e in events if e.name == MARKER]
    first, last = marks[0], marks[-1]
    inside = [e for e in events if first <= e.time_range.start < last and e.name != MARKER]
    leaves = Counter(e.name for e in inside if e.name.startswith("aten::") and not e.cpu_children)
    # each operator that synchronises once, however many of SYNC_OPS it runs inside
    outer = {id(op): op.name for op in map(_outermost_op, (e for e in inside if e.name in SYNC_OPS))}
    steps = len(marks) - 1
    syncs = {name: c / steps for name, c in Counter(outer.values()).items()}
    cpu_only = syncs.pop(CPU_ONLY, 0.0) if search.device.type == "cpu" else 0.0
    return {"n": n, "d": d, "k": k, "device": str(search.device), "torch": torch.__version__,
            "batch_size": search.batch_size, "steps_profiled": steps,
            "ops_per_step": sum(leaves.values()) / steps, "syncs_per_step": sum(syncs.values()),
            "sync_ops": syncs, "cpu_only_syncs_per_step": cpu_only, "top_ops": {name: c / steps for name, c in leaves.most_common(15)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--k", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--json", type=Path, help="write the result here")
    args = ap.parse_args()
    out = profile_steps(args.n, args.d, args.k, args.device, args.seed)
    print(f"{out['steps_profiled']} steps of {out['batch_size']} rows on {out['device']}: "
          f"{out['ops_per_step']:.1f} leaf operators and {out['syncs_per_step']:.1f} host syncs a step "
          f"({', '.join(f'{k} {v:g}' for k, v in out['sync_ops'].items()) or 'none'}; "
          f"{out['cpu_only_syncs_per_step']:g} more in the CPU kernel of fused Adam)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
