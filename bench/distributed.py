"""Data-parallel DeepDPM: epoch time and all-reduce traffic, W = 1 vs W = 2 (gloo, CPU).

Runs the search the way a Ray Train worker does (its slice of the rows, a
``torch.distributed`` communicator, DDP-wrapped nets) in 2 spawned gloo processes,
and in this process for W = 1, on the same data with K held fixed (moves off). Measures
per epoch: wall time, the statistics all-reduce (bytes, seconds) and the DDP gradient
all-reduces (bytes, counted by a communication hook). Ray's own start-up (~20 s a run
on this machine) is not included: it is paid once per fit, not per epoch.

Then prints a traffic model for W = 8 … 64 GPUs at ImageNet scale (N = 1.28M,
D = 128, K = 1000): modelled, not measured here (no GPU).

    OMP_NUM_THREADS=1 python bench/distributed.py            # ~1 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepdpm_core.config import Config, from_dict  # noqa: E402
from deepdpm_core.runtime import LocalCommunicator  # noqa: E402
from deepdpm_core.training import auto_batch_size, start_fit  # noqa: E402
from deepdpm_core.training.batching import MAX_BATCH_SIZE, STEPS_PER_EPOCH  # noqa: E402
from pipeline.fit.distributed import TorchDistCommunicator, ddp_wrapper  # noqa: E402
from pipeline.io.feature_rows import rank_rows  # noqa: E402


class _Counting:
    """Adds byte and time counters to a communicator's all_reduce."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.bytes = 0
        self.seconds = 0.0

    rank = property(lambda self: self.inner.rank)
    world_size = property(lambda self: self.inner.world_size)

    def all_reduce(self, tensor, op="sum"):
        t0 = time.perf_counter()
        out = self.inner.all_reduce(tensor, op)
        self.seconds += time.perf_counter() - t0
        self.bytes += tensor.numel() * tensor.element_size()
        return out

    def broadcast_object(self, obj, src=0):
        return self.inner.broadcast_object(obj, src)


def _counting_ddp(counter: dict) -> callable:
    """The pipeline's DDP wrapper plus a hook counting the gradient bytes it all-reduces."""
    wrap = ddp_wrapper("cpu")

    def hook(state, bucket):
        counter["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        group = state
        fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].div_(dist.get_world_size(group)))

    def wrapped(net):
        ddp = wrap(net)
        ddp.register_comm_hook(ddp.process_group, hook)
        return ddp

    return wrapped


def _measure(x: np.ndarray, config: Config, epochs: int, distributed: bool) -> dict:
    grads = {"bytes": 0}
    if distributed:
        comm = _Counting(TorchDistCommunicator("cpu"))
        wrap = _counting_ddp(grads)
        part = x[slice(*rank_rows(len(x), comm.rank, comm.world_size))]
    else:
        comm, wrap, part = _Counting(LocalCommunicator()), None, x
    search = start_fit(config, torch.from_numpy(part), comm=comm, wrap=wrap)
    search.initialize()
    search.step_epoch()  # warm-up: first-call allocations
    times, stats_bytes, stats_sec, grad_bytes = [], 0, 0.0, 0
    for _ in range(epochs):
        b0, s0, g0 = comm.bytes, comm.seconds, grads["bytes"]
        t0 = time.perf_counter()
        search.step_epoch()
        times.append(time.perf_counter() - t0)
        stats_bytes += comm.bytes - b0
        stats_sec += comm.seconds - s0
        grad_bytes += grads["bytes"] - g0
    steps = search.ctx.n_steps(search.config)[1]  # optimizer steps of an epoch (collective: every rank)
    return {
        "epoch_s": float(np.min(times)),  # least disturbed by other jobs on shared cores
        "epoch_median_s": float(np.median(times)),
        "stats_bytes": stats_bytes / epochs,
        "stats_s": stats_sec / epochs,
        "grad_bytes": grad_bytes / epochs,
        "steps": steps,
        "k": search.n_clusters,
    }


def _rank(rank: int, world: int, store: str, x, config, epochs, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = _measure(x, config, epochs, distributed=True)
    finally:
        dist.destroy_process_group()
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))


def _mixture(n: int, dim: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=8.0, size=(k, dim))
    return (centres[rng.integers(0, k, n)] + rng.normal(size=(n, dim))).astype(np.float32)


def _mb(b: float) -> str:
    return f"{b / 1e6:.3f}"


def scaling_model(n: int = 1_281_167, dim: int = 128, k: int = 1000, hidden: int = 50,
                  h100_epoch_s: float = 2.24) -> None:
    """Per-epoch all-reduce traffic at ImageNet scale and what it costs (a model).

    Per-GPU batches follow the default ``optim.batch_size: auto`` rule (one pass over a
    GPU's N/W rows in ``STEPS_PER_EPOCH`` steps, at most ``MAX_BATCH_SIZE`` rows;
    :mod:`deepdpm_core.training.batching`), against the paper's fixed 128. ``h100_epoch_s`` is one measured epoch on one
    H100 at this size (docs/benchmarks.md, "Scale"), the compute a GPU would have to share.
    """
    row = dim * dim + dim + 1  # n, s1, s2 of one group, float64
    stats = 3 * k * row * 8  # K clusters + 2K subclusters (+ 24 B of losses)
    cluster_net = dim * hidden + hidden + hidden * k + k
    sub_nets = k * (dim * hidden + hidden + 2 * hidden + 2)
    grads = 4 * (cluster_net + sub_nets)  # fp32, every step
    # ring all-reduce: each GPU sends and receives 2(W-1)/W of the payload over its link
    nvlink, ib = 150e9, 40e9  # B/s per GPU: inside an 8-GPU NVLink node; 400 Gb/s IB NIC per GPU
    print(f"\nScaling model (not measured): N={n:,} D={dim} K={k}, fp64 stats, fp32 grads")
    print(f"  statistics per epoch: 3K(D^2+D+1) doubles = {stats / 1e6:.0f} MB (K clusters alone: "
          f"{k * row * 8 / 1e6:.0f} MB), ONE all-reduce")
    print(f"  gradients per step: {grads / 1e6:.1f} MB (subcluster nets {4 * sub_nets / 1e6:.1f} MB)")
    print("  links: 150 GB/s per GPU inside one 8-GPU NVLink node, 40 GB/s (400 Gb/s IB) across nodes;")
    print(f"  one epoch on one H100 measured {h100_epoch_s} s (W GPUs: at best that / W); per-step latency"
          " not included")
    print(f"{'W':>4} {'link':>6} {'stats s/ep':>11} | {'auto B/GPU':>10} {'steps/ep':>9} {'grad GB/ep':>11} "
          f"{'grad s/ep':>10} | {'B=128: steps/ep':>15} {'grad s/ep':>10} | {'H100 epoch / W':>14}")
    for w in (8, 16, 32, 64):
        ring = 2 * (w - 1) / w
        link, bw = ("NVLink", nvlink) if w <= 8 else ("IB", ib)
        share = -(-n // w)
        batch = auto_batch_size(share)
        steps, steps128 = -(-share // batch), -(-share // 128)
        print(f"{w:4d} {link:>6} {ring * stats / bw:11.3f} | {batch:10d} {steps:9d} {steps * grads / 1e9:11.2f} "
              f"{ring * steps * grads / bw:10.3f} | {steps128:15d} {ring * steps128 * grads / bw:10.2f} | "
              f"{h100_epoch_s / w:14.3f}")
    print("  Reading: the statistics all-reduce (~0.4 GB, once an epoch) costs tens of ms at any W.")
    print("  The DDP gradient all-reduce is dense (26 MB a step, although a batch touches only its")
    print("  clusters' subnets): at the paper's 128 rows per GPU it would cost more than the compute.")
    print(f"  The auto batch makes an epoch {STEPS_PER_EPOCH} steps once a GPU holds <= "
          f"{STEPS_PER_EPOCH} x {MAX_BATCH_SIZE} rows,")
    print("  so the gradients cost a few hundredths of a second an epoch. The last column is an ideal:")
    print("  a GPU epoch at this size is mostly per-step host work (~5 ms a step on one H100), and")
    print(f"  {STEPS_PER_EPOCH} steps keep an epoch near 0.3 s at any W, so past W = 8 more GPUs buy little here.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000, help="rows")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--k", type=int, default=20, help="clusters (fixed: moves off)")
    parser.add_argument("--batch", type=int, default=128, help="per-worker batch")
    parser.add_argument("--epochs", type=int, default=5, help="timed epochs (after one warm-up)")
    parser.add_argument("--json", action="store_true", help="last line: JSON of the measured rows")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    x = _mixture(args.n, args.dim, args.k)
    config = from_dict({
        "device": "cpu",
        "init": {"n_clusters": args.k},
        "optim": {"batch_size": args.batch},
        "schedule": {"warmup_epochs": 1, "max_epochs": args.epochs + 2},
        "moves": {"split": False, "merge": False},
        "small_data": {"max_rows": 0},  # the nets' minibatch epochs at any --n (their DDP traffic)
    })
    rows = {1: _measure(x, config, args.epochs, distributed=False)}
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(2, f"{tmp}/store", x, config, args.epochs, tmp), nprocs=2, join=True)
        rows[2] = pickle.loads(Path(tmp, "0.pkl").read_bytes())
    base = rows[1]["epoch_s"]
    print(f"N={args.n} D={args.dim} K={args.k} batch={args.batch}/worker, {args.epochs} timed epochs, "
          f"CPU, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print(f"{'W':>3} {'epoch s':>8} {'median':>7} {'vs W=1':>7} {'steps':>6} {'stats MB/ep':>12} "
          f"{'stats s/ep':>11} {'grad MB/ep':>11} {'grad MB/step':>13}")
    for w, r in rows.items():
        print(f"{w:3d} {r['epoch_s']:8.3f} {r['epoch_median_s']:7.3f} {r['epoch_s'] / base:7.2f} {r['steps']:6d} "
              f"{_mb(r['stats_bytes']):>12} {r['stats_s']:11.4f} {_mb(r['grad_bytes']):>11} "
              f"{_mb(r['grad_bytes'] / max(r['steps'], 1)):>13}")
    print("(epoch s: fastest timed epoch, vs W=1 compares those. W=1 all-reduces nothing; its stats"
          " column is what one rank would send. The two ranks share this machine's cores with each"
          " other and with other jobs.)")
    scaling_model()
    if args.json:
        print(json.dumps({"n": args.n, "dim": args.dim, "k": args.k, "batch": args.batch,
                          "workers": {str(w): r for w, r in rows.items()}}))


if __name__ == "__main__":
    main()
