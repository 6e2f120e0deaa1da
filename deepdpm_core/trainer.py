"""The DeepDPM epoch loop over a :class:`~deepdpm_core.communicator.Communicator`.

One epoch (docs/design.md, section The epoch; paper §3):

1. minibatches: r = softmax(f_cl(x)); target r^E from the mixture frozen at the last
   M-step (Eq. 5); cluster loss KL(r^E ‖ r); subcluster loss Σ_j r̃_ij ‖x_i − μ̃_{z_i j}‖²
   (Eq. 7); accumulate soft cluster statistics (weights r) and hard subcluster statistics
   (z_i = argmax r_i, j_i = argmax r̃_i) — never an N × K array;
2. one all-reduce of all statistics as a flat float64 tensor;
3. M-step on every rank (NIW MAP, :mod:`deepdpm_core.niw`), unless parameters are frozen;
4. every ``move_every`` epochs, alternately, splits or merges decided on rank 0 from the
   reduced statistics and broadcast as a :class:`~deepdpm_core.moves.MovePlan` that every
   rank applies identically.

Data live on the device as one (N_local, D) float32 tensor in the fit's own coordinates
(:mod:`deepdpm_core.coordinates`: centred, so the prior mean is 0 and uncentred float64
sums stay accurate, and scaled to unit mean variance, so nothing depends on the units).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from deepdpm_core.communicator import Communicator, LocalCommunicator
from deepdpm_core.config import Config, from_dict
from deepdpm_core.coordinates import fit_coordinates
from deepdpm_core.errors import CheckpointError, ConfigError, DataError
from deepdpm_core.fitted_model import FittedModel, stored_coordinates
from deepdpm_core.gmm import GaussianMixture, log_weights_from_counts
from deepdpm_core.init import initial_cluster_count, kmeans_centers, nearest_center, principal_split
from deepdpm_core.losses import slot_kl
from deepdpm_core.moves import MovePlan, propose_merges, propose_splits
from deepdpm_core.nets import (
    ClusterNet,
    SubclusterNets,
    axis_aligned_subnet,
    cluster_row_map,
    new_row_of,
    reindex_rows,
)
from deepdpm_core.niw import (
    NIWPrior,
    empirical_bayes_nu,
    empirical_bayes_scale,
    log_marginal_likelihood,
    map_estimate,
)
from deepdpm_core.precision import flush_denormals, net_precision, resolve_precision
from deepdpm_core.stats import SuffStats, TripleBuffer, grouped_stats

Tensor = torch.Tensor
EpochCallback = Callable[[dict[str, Any]], None]
#: responsibilities below float32's resolution of 1 (a point's total mass) are left out
#: of the sparse soft statistics: they are below the rounding of the kept ones
_R_FLOOR = float(torch.finfo(torch.float32).eps)


#: the parts of an epoch's ``seconds`` in its history record (key ``seconds_<phase>``), in order
EPOCH_PHASES: tuple[tuple[str, str], ...] = (
    ("estep", "E-step targets"),
    ("train", "minibatch steps"),
    ("stats", "statistics + all-reduce"),
    ("mstep", "M-step"),
    ("moves", "split / merge round"),
)


def device_clock(device: torch.device) -> float:
    """perf_counter once the device's queued work is done (CUDA kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config device='cuda' but no CUDA device is available (use auto or cpu)")
    return torch.device(name)


def auto_batch_size(n_total: int, steps_per_epoch: int, base: int, largest: int) -> int:
    """Batch size making one pass over ``n_total`` rows in ``steps_per_epoch`` steps,
    clamped to [base, largest].

    Small data keep the paper's batch of 128; large data get large batches, so an epoch
    costs a fixed number of optimizer steps instead of N/128 (per-step work, not
    arithmetic, dominates an epoch of these small nets).
    """
    return int(min(largest, max(base, -(-n_total // max(1, steps_per_epoch)))))


def scaled_lr(base_lr: float, batch_size: int, base_batch_size: int, rule: str) -> float:
    """Learning rate for ``batch_size`` from one tuned at ``base_batch_size``."""
    ratio = batch_size / base_batch_size
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    return base_lr


def _adam(params, lr: float) -> torch.optim.Adam:
    """Adam as one fused kernel per step (CPU and CUDA): with small nets the per-tensor
    update loop, not the arithmetic, is what a step costs."""
    return torch.optim.Adam(params, lr=lr, fused=True)


#: how ``prior.sigma_scale`` fits s to the clusters (see :class:`~deepdpm_core.config.PriorConfig`)
_PER_FEATURE = {"auto": True, "evidence": False}
#: coordinate-ascent rounds of (s, ν0) when s maximises the prior's own evidence
_EB_ROUNDS = 4


class Trainer:
    """Fits DeepDPM to this rank's rows; collective steps go through ``comm``.

    Parameters
    ----------
    config : Config
    x : Tensor of shape (N_local, D)
        This rank's rows (any float dtype; may be empty on some ranks).
    comm : Communicator, optional
        Defaults to single-process.
    wrap : callable, optional
        Applied to each net after it is built or reshaped (e.g. DDP); identity by default.
    callbacks : list of callables, optional
        Called on every rank with each epoch's history record.
    """

    def __init__(
        self,
        config: Config,
        x: Tensor,
        comm: Communicator | None = None,
        wrap: Callable[[nn.Module], nn.Module] | None = None,
        callbacks: list[EpochCallback] | None = None,
    ) -> None:
        self.config = config
        self.comm = comm or LocalCommunicator()
        self.wrap = wrap or (lambda m: m)
        self.callbacks = list(callbacks or [])
        self.device = resolve_device(config.device)
        self.precision = resolve_precision(config.model.precision, self.device)
        self.dim = int(x.shape[1])
        self.rng = np.random.default_rng(config.seed)  # move decisions (rank 0) and init
        self.torch_gen = torch.Generator().manual_seed(config.seed)  # net initialisation
        self.epoch = 0
        self.move_round = 0
        self.rounds_without_move = 0
        self.frozen_until = config.schedule.warmup_epochs
        self.history: list[dict[str, Any]] = []
        #: each local row's best cluster (its initial cluster, then the last E-step's best),
        #: the sparse E-step's anchors; kept through surgery; None: not known (a resumed fit)
        self.anchors: Tensor | None = None
        self._init_data(x)

    # ------------------------------------------------------------------ set-up
    def _init_data(self, x: Tensor) -> None:
        """The fit's coordinates (:mod:`deepdpm_core.coordinates`), the data in them, and
        the NIW prior.

        Works through the rows in chunks: a float64 copy of the whole data would be twice
        its float32 size, and at ImageNet scale the data are most of the memory.
        """
        n_local, d, chunk = x.shape[0], self.dim, 1 << 16
        f64 = {"dtype": torch.float64}
        self.coords, self.n_total, self.rank_rows = fit_coordinates(
            x, self.config.data.transform, self.comm, self.device)
        #: per-feature variance (D,) of the (transformed) features, float64, for diagnostics
        self.feature_variance = self.coords.feature_std.square()
        # the nets see x̃ itself: unit mean variance, whatever the units of the features
        self.input_scale = 1.0
        p = self.config.prior
        unit2 = self.coords.unit**2
        # Ψ0 = s·I or s·diag(std) in the features' units is s·shape on x̃
        shape = torch.full((d,), 1.0 / unit2, **f64) if p.psi == "identity" else \
            torch.where(self.coords.feature_std > 0, self.coords.feature_std, torch.ones(d, **f64)) / unit2
        self.prior_shape = shape
        #: s of Ψ0 = s·P, in the features' units; a fitted one starts at the data's mean
        #: per-feature variance (the first fit, at initialisation, replaces it)
        self.sigma_scale = float(p.sigma_scale) if isinstance(p.sigma_scale, float) else unit2
        #: the candidate priors (full and/or diagonal covariances); ``self.prior`` is one of them
        self.priors = [
            NIWPrior.from_shape(torch.zeros(d, **f64), shape, self._kappa(self.sigma_scale),
                                None if p.nu == "auto" else p.nu,
                                self.sigma_scale, diagonal=kind == "diag").to(self.device)
            for kind in (("full", "diag") if p.covariance_type == "auto" else (p.covariance_type,))
        ]
        self.prior = self.priors[0]
        self.x = torch.empty(n_local, d, dtype=torch.float32, device=self.device)
        for s in range(0, n_local, chunk):  # x̃ in float64, then stored as float32
            self.x[s : s + chunk] = self.coords.apply(x[s : s + chunk]).to(self.device)
        # per rank; "auto" aims at steps_per_epoch steps over this rank's share of the rows,
        # so W ranks step as often as one process would, on a W times larger global batch
        o = self.config.optim
        share = -(-self.n_total // self.comm.world_size)
        self.batch_size = (auto_batch_size(share, o.steps_per_epoch, o.base_batch_size, o.max_batch_size)
                           if o.batch_size == "auto" else int(o.batch_size))

    def _kappa(self, sigma_scale: float) -> float:
        """κ0: the configured number, or (``auto``) s·mean(P) on x̃, whose mean per-feature
        variance is 1: the prior spread of the cluster means, Σ/κ0, is the data's."""
        k = self.config.prior.kappa
        return float(k) if k != "auto" else sigma_scale * float(self.prior_shape.mean())

    def _fit_prior(self, stats: SuffStats) -> None:
        """Fit the prior to the clusters' statistics (type-II maximum likelihood).

        With ``prior.sigma_scale: auto`` each candidate prior's s is refitted
        (:func:`~deepdpm_core.niw.empirical_bayes_scale`), then with ``prior.nu: auto`` its
        ν0 given s (:func:`~deepdpm_core.niw.empirical_bayes_nu`; ``evidence``, whose s
        depends on ν0, alternates the two); with ``covariance_type: auto`` the candidate
        (full or diagonal covariances) with the larger evidence Σ_k ln f(X_k) is kept. Sees
        only all-reduced statistics: the same on every rank.
        """
        p = self.config.prior
        fitted = []
        for prior in self.priors:
            s = self.sigma_scale
            for _ in range(_EB_ROUNDS if p.sigma_scale == "evidence" and p.nu == "auto" else 1):
                if p.sigma_scale in _PER_FEATURE:
                    s = empirical_bayes_scale(prior, stats, self.prior_shape, _PER_FEATURE[p.sigma_scale])
                nu = empirical_bayes_nu(prior, stats, self.prior_shape, s) if p.nu == "auto" else None
                prior = prior.with_scale(self.prior_shape, s, self._kappa(s), nu)
            fitted.append((prior, s))
        if len(fitted) > 1:
            evidence = [float(log_marginal_likelihood(prior, stats).sum()) for prior, _ in fitted]
            best = max(range(len(fitted)), key=evidence.__getitem__)
        else:
            best = 0
        self.priors = [prior for prior, _ in fitted]
        self.prior, self.sigma_scale = fitted[best]

    def initialize(self, init_labels: Tensor | None = None) -> None:
        """k-means clusters (rank 0, on a sample gathered from all ranks), MAP parameters,
        principal-axis subclusters.

        ``init_labels`` (this rank's rows, int64 [n]) warm-starts from given hard clusters
        instead of k-means (the AE alternation re-clusters from the previous clusters).
        """
        cfg = self.config
        if init_labels is not None:
            z = init_labels.to(device=self.device, dtype=torch.long)
            local_max = torch.zeros(self.comm.world_size, dtype=torch.float64, device=self.device)
            local_max[self.comm.rank] = float(z.max()) if len(z) else 0.0
            n_init = int(self.comm.all_reduce(local_max).max()) + 1
        else:
            n_clusters = initial_cluster_count(cfg.init.n_clusters, self.n_total)
            if n_clusters == 1:  # one centre: every point is assigned to it anyway
                centers = torch.zeros(1, self.dim, device=self.device)
            else:
                sample = self._kmeans_sample()
                centers = None
                if self.comm.rank == 0:
                    centers = kmeans_centers(sample.cpu().numpy(), n_clusters,
                                             cfg.init.kmeans_iters, cfg.init.max_points, self.rng,
                                             cfg.init.seeding)
                centers = torch.as_tensor(self.comm.broadcast_object(centers, src=0),
                                          device=self.device)
            z = nearest_center(self.x, centers)
            n_init = centers.shape[0]
        # float64 GEMMs: the initial mixture is the same to round-off on any number of ranks
        stats = self._reduce_stats(grouped_stats(
            self.x, torch.arange(z.shape[0], device=self.device), z,
            torch.ones_like(z, dtype=torch.float64), n_init, dtype=torch.float64))
        keep = torch.nonzero(stats.n > 0).squeeze(1)
        stats = stats.rows(keep)
        self.anchors = new_row_of(keep, n_init)[z]
        self._fit_prior(stats)
        self.means, self.covs = map_estimate(self.prior, stats)
        self.log_weights = log_weights_from_counts(stats.n, cfg.prior.weight_pseudocount)
        k = self.means.shape[0]
        self.cluster_net = ClusterNet(self.dim, cfg.model.hidden, k, self.torch_gen).to(self.device)
        self.sub_nets = SubclusterNets(self.dim, cfg.model.sub_hidden, k, self.torch_gen).to(self.device)
        self.opt_cluster = _adam(self.cluster_net.parameters(), self._lr(cfg.optim.lr_cluster))
        self.opt_sub = _adam(self.sub_nets.parameters(), self._lr(cfg.optim.lr_subcluster))
        self._reset_subclusters(torch.arange(k, device=self.device))
        self._rewrap()
        self._refresh_mixture()

    def _kmeans_sample(self) -> Tensor:
        """The rows k-means sees, shape (min(N, init.max_points), D): the same for any W.

        Global row indices are drawn with the seeded generator (identically on every rank,
        as the single-process sampling in :func:`kmeans_centers` would); each rank fills in
        the rows it holds and one all-reduce assembles the sample (exact: each row has one
        non-zero contributor). Rows are taken to be split over ranks in rank order, which is
        how ``pipeline`` slices inputs; any other split still gives a valid random sample.
        """
        n, m = self.n_total, self.config.init.max_points
        idx = np.arange(n) if n <= m else np.sort(self.rng.choice(n, size=m, replace=False))
        offset = sum(self.rank_rows[: self.comm.rank])
        lo, hi = np.searchsorted(idx, [offset, offset + self.x.shape[0]])
        sample = torch.zeros(len(idx), self.dim, device=self.device)
        sample[lo:hi] = self.x[torch.as_tensor(idx[lo:hi] - offset, device=self.device)]
        return self.comm.all_reduce(sample)

    def _lr(self, base: float) -> float:
        """Learning rate at the global batch W·B (``optim.batch_size`` is per rank)."""
        o = self.config.optim
        return scaled_lr(base, self.batch_size * self.comm.world_size, o.base_batch_size, o.lr_scaling)

    def _rewrap(self) -> None:
        self.cluster_model = self.wrap(self.cluster_net)
        self.sub_model = self.wrap(self.sub_nets)

    def _refresh_mixture(self) -> None:
        self.mixture = GaussianMixture(self.means, self.covs, self.log_weights)
        self._sub_means32 = self.sub_means.to(torch.float32)

    @property
    def n_clusters(self) -> int:
        return self.means.shape[0]

    # ------------------------------------------------------------- subclusters
    def _reset_subclusters(self, ks: Tensor) -> None:
        """Principal-axis subclusters and matching subnet weights for clusters ``ks``."""
        if not hasattr(self, "sub_means"):
            k = self.n_clusters
            self.sub_means = torch.zeros(k, 2, self.dim, dtype=torch.float64, device=self.device)
            self.sub_covs = torch.zeros(k, 2, self.dim, self.dim, dtype=torch.float64, device=self.device)
            self.sub_log_weights = torch.full((k, 2), -math.log(2), dtype=torch.float64, device=self.device)
        if ks.numel() == 0:
            return
        sm, sc, direction, spread = principal_split(self.means[ks], self.covs[ks])
        self.sub_means[ks], self.sub_covs[ks] = sm, sc
        self.sub_log_weights[ks] = -math.log(2)
        self._init_subnet_rows(ks, self.means[ks], direction, spread)

    def _init_subnet_rows(self, ks: Tensor, centers: Tensor, directions: Tensor, spreads: Tensor) -> None:
        s = self.input_scale
        # the draws on the CPU (one generator stream, in row order), then one write per tensor
        centers, directions, spreads = centers.cpu() * s, directions.cpu(), (spreads.cpu() * s).tolist()
        fresh = [axis_aligned_subnet(self.dim, self.config.model.sub_hidden, centers[i], directions[i],
                                     spreads[i], self.torch_gen) for i in range(len(spreads))]
        if not fresh:
            return
        rows = ks.to(self.device)
        with torch.no_grad():
            for p, values in zip((self.sub_nets.w1, self.sub_nets.b1, self.sub_nets.w2, self.sub_nets.b2),
                                 zip(*fresh, strict=True), strict=True):
                p[rows] = torch.stack(values).to(p)
                st = self.opt_sub.state.get(p)
                for key in ("exp_avg", "exp_avg_sq"):
                    if st and key in st:
                        st[key][rows] = 0

    # ------------------------------------------------------------------ epochs
    def _reduce_stats(self, stats: SuffStats) -> SuffStats:
        flat = self.comm.all_reduce(stats.flat())
        return SuffStats.from_flat(flat, stats.n_rows, stats.dim)

    def _n_steps(self) -> tuple[int, int]:
        """(steps of one pass over the largest slice, optimizer steps this epoch).

        Small data get extra training steps on re-drawn batches up to
        ``optim.min_steps_per_epoch``, so the nets can follow the parameters after a move;
        statistics always come from exactly one pass.
        """
        local = math.ceil(self.x.shape[0] / self.batch_size)
        t = torch.tensor([float(local)], dtype=torch.float64, device=self.device)
        one_pass = int(self.comm.all_reduce(t, op="max").item())
        return one_pass, max(one_pass, self.config.optim.min_steps_per_epoch)

    def _global_batch(self, step: int, one_pass: int) -> int:
        """Points in minibatch ``step`` summed over all ranks (no communication needed)."""
        bsz = self.batch_size
        if step >= one_pass:  # extra training batches: bsz re-drawn rows on every rank with rows
            return sum(bsz for n in self.rank_rows if n)
        return sum(min(bsz, max(0, n - step * bsz)) for n in self.rank_rows)

    def run_epoch(self, train: bool = True, seconds: dict[str, float] | None = None
                  ) -> tuple[SuffStats, SuffStats, dict[str, float]]:
        """One pass over the local rows; returns reduced soft cluster and hard subcluster
        stats and the mean losses.

        With ``train=False`` the nets are not updated (a pure statistics pass). When
        ``seconds`` is given, the durations of the E-step targets (``estep``), the
        minibatch steps (``train``) and the statistics with their all-reduce (``stats``)
        are written into it.
        """
        t_start = device_clock(self.device)
        k, d, bsz = self.n_clusters, self.dim, self.batch_size
        n_local = self.x.shape[0]
        gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + self.epoch * 7919 + self.comm.rank)
        one_pass, n_steps = self._n_steps()
        perm = torch.randperm(n_local, generator=gen).to(self.device)
        if n_steps > one_pass and n_local:  # extra training-only batches, re-drawn at random
            extra = torch.randint(n_local, ((n_steps - one_pass) * bsz,), generator=gen).to(self.device)
            perm = torch.cat([perm, extra])
        f64 = {"dtype": torch.float64, "device": self.device}
        m = self._top_m()
        targets = self._estep_targets(m)
        t_estep = device_clock(self.device)
        # soft cluster and hard subcluster statistics and the loss sums: views of the one
        # buffer that is all-reduced
        sizes = [SuffStats.numel(k, d), SuffStats.numel(2 * k, d), 3]
        flat = torch.zeros(sum(sizes), **f64)
        soft, sub = SuffStats.from_flat(flat[: sizes[0]], k, d), SuffStats.from_flat(
            flat[sizes[0] : -3], 2 * k, d)
        loss_sums = flat[-3:]
        self.cluster_model.train(train)
        self.sub_model.train(train)
        pass_rows = min(n_local, one_pass * bsz)
        soft_buf = TripleBuffer(pass_rows * m, self.device) if m else None
        sub_buf = TripleBuffer(pass_rows, self.device)
        for step in range(n_steps if train else one_pass):
            if step < one_pass:
                idx = perm[step * bsz : min((step + 1) * bsz, pass_rows)]
            else:
                start = n_local + (step - one_pass) * bsz
                idx = perm[start : start + bsz] if n_local else perm[:0]
            x = self.x.index_select(0, idx)
            xin = x * self.input_scale
            slots, target = self._slot_targets(targets, idx)
            with torch.set_grad_enabled(train), net_precision(self.precision, self.device):
                # KL(r^E || r) also yields the hard clusters z and ln r on the slots
                sum_cl, z, log_r_slots = slot_kl(self.cluster_model(xin), slots, target)
                sub_logits = self.sub_model(xin, z)
                sub_r = torch.softmax(sub_logits, dim=1)
                dist2 = (x[:, None, :] - self._sub_means32.index_select(0, z)).square().sum(-1)
                # KL(r^E || r) and the subcluster loss summed over the local batch, divided
                # by G/W with G the step's points over all ranks: DDP averages gradients
                # over the W ranks, so the update is that of the per-point mean over the
                # global batch (W = 1: the batch mean). A rank with no rows left runs an
                # empty batch (zero gradients) so every rank takes the same steps.
                sum_sub = (sub_r * dist2).sum()
                per_rank = max(self._global_batch(step, one_pass), 1) / self.comm.world_size
                loss_cl, loss_sub = sum_cl / per_rank, sum_sub / per_rank
            if train:
                self.opt_cluster.zero_grad(set_to_none=True)
                self.opt_sub.zero_grad(set_to_none=True)
                with net_precision(self.precision, self.device, backward=True):
                    (loss_cl + loss_sub).backward()
                self.opt_cluster.step()
                self.opt_sub.step()
            if step >= one_pass:
                continue
            with torch.no_grad():
                if m:  # the net's responsibilities on the support of the point's target r^E
                    # (where the KL puts the net's mass; not renormalised), less those below
                    # float32 resolution of its unit mass
                    r = log_r_slots.exp()
                    point, j = ((r >= _R_FLOOR) & (target > 0)).nonzero(as_tuple=True)
                    soft_buf.add(idx.index_select(0, point), slots[point, j], r[point, j])
                else:  # the slots are all K clusters, in order
                    r, x64 = log_r_slots.exp().to(torch.float64), x.to(torch.float64)
                    soft.n.add_(r.sum(0))
                    soft.s1.addmm_(r.T, x64)
                    soft.s2.view(k, d * d).addmm_(r.T, (x64[:, :, None] * x64[:, None, :]).reshape(-1, d * d))
                rows = 2 * z + sub_logits.detach().argmax(1)
                sub_buf.add(idx, rows, torch.ones_like(rows, dtype=torch.float32))
                loss_sums += torch.stack([sum_cl.detach().double(), sum_sub.detach().double(),
                                          torch.tensor(float(x.shape[0]), **f64)])
        t_train = device_clock(self.device)
        if m:
            soft_buf.stats(self.x, k, out=soft)
        sub_buf.stats(self.x, 2 * k, out=sub)
        flat = self.comm.all_reduce(flat)
        if seconds is not None:
            seconds.update(estep=t_estep - t_start, train=t_train - t_estep, stats=device_clock(self.device) - t_train)
        soft = SuffStats.from_flat(flat[: sizes[0]], k, d)
        sub = SuffStats.from_flat(flat[sizes[0] : -3], 2 * k, d)
        tot = flat[-3:]
        losses = {
            "loss_cluster": float(tot[0] / tot[2].clamp_min(1)),
            "loss_subcluster": float(tot[1] / tot[2].clamp_min(1)),
        }
        return soft, sub, losses

    def _top_m(self) -> int | None:
        """Most clusters per point of the sparse E-step's support, or None for the dense E-step."""
        e = self.config.estep
        return e.top_m if self.n_clusters > e.dense_max_k and e.top_m < self.n_clusters else None

    def _estep_targets(self, m: int | None, chunk_rows: int = 4096) -> tuple[Tensor | None, Tensor]:
        """E-step targets r^E (paper Eq. 5) of every local row, once per epoch (the
        mixture is frozen all epoch, and extra training batches re-use rows).

        Returns
        -------
        candidates : Tensor of shape (N_local, m), int64, or None when dense
        resp : Tensor of shape (N_local, m) or (N_local, K), float32 — computed in log
            space; exactly 0 off the sparse E-step's support. K ≤ ``estep.dense_max_k``
            when dense, so memory is O(N) either way.
        """
        if m:
            cand, log_resp = self.mixture.sparse_log_responsibilities(self.x, m, anchors=self.anchors)
            self.anchors = cand.gather(1, log_resp.argmax(1, keepdim=True)).squeeze(1)
            return cand, log_resp.exp().to(torch.float32)
        out = torch.empty(self.x.shape[0], self.n_clusters, device=self.device)
        # cache-sized chunks: the (rows, K·D) whitening is memory-bound
        for s in range(0, self.x.shape[0], chunk_rows):
            out[s : s + chunk_rows] = self.mixture.log_responsibilities(self.x[s : s + chunk_rows]).exp()
        self.anchors = out.argmax(1)
        return None, out

    def _slot_targets(self, targets: tuple[Tensor | None, Tensor], idx: Tensor) -> tuple[Tensor, Tensor]:
        """The batch's slots (B, m) and E-step targets on them (B, m); dense: all K clusters."""
        cand, resp = targets
        resp = resp.index_select(0, idx)
        if cand is None:
            return torch.arange(self.n_clusters, device=self.device).expand(len(idx), -1), resp
        return cand.index_select(0, idx), resp

    def m_step(self, soft: SuffStats, sub: SuffStats) -> None:
        """Bayesian M-step from the net's responsibilities (paper §3.1) and subclusters."""
        pc = self.config.prior.weight_pseudocount
        self._fit_prior(soft)
        self.means, self.covs = map_estimate(self.prior, soft)
        self.log_weights = log_weights_from_counts(soft.n, pc)
        k = self.n_clusters
        sm, sc = map_estimate(self.prior, sub)
        self.sub_means, self.sub_covs = sm.view(k, 2, self.dim), sc.view(k, 2, self.dim, self.dim)
        sub_n = sub.n.view(k, 2)
        self.sub_log_weights = log_weights_from_counts(sub_n, pc)
        # a subcluster that lost all its points cannot propose a split: restart it
        dead = torch.nonzero(sub_n.min(1).values < 1).squeeze(1)
        self._reset_subclusters(dead)

    # ------------------------------------------------------------------- moves
    def _decide(self, kind: str, soft: SuffStats, sub: SuffStats) -> MovePlan:
        """Rank 0 decides the moves and broadcasts the plan, or the DataError it ran into,
        so that every rank raises it rather than wait for a plan."""
        plan: MovePlan | DataError | None = None
        if self.comm.rank == 0:
            try:
                plan = self._propose_moves(kind, sub)
            except torch.linalg.LinAlgError:
                plan = self._numerical_failure()
        plan = self.comm.broadcast_object(plan, src=0)
        if isinstance(plan, DataError):
            raise plan
        return plan

    def _propose_moves(self, kind: str, sub: SuffStats) -> MovePlan:
        """Rank 0: prunes of empty clusters, then the accepted splits or merges."""
        cfg = self.config
        hard = sub.pair_sums()
        prunes = [int(i) for i in torch.nonzero(hard.n <= 0).squeeze(1).tolist()] \
            if cfg.moves.prune_empty and self.n_clusters > 1 else []
        if len(prunes) == self.n_clusters:
            prunes = prunes[1:]
        splits, merges = [], []
        if kind == "split":
            accepted, _ = propose_splits(self.prior, cfg.prior.alpha, sub, self.rng,
                                         cfg.moves.min_subcluster_size)
            splits = [k for k in accepted if k not in prunes]
        else:
            merges = [(a, b) for a, b in propose_merges(
                self.prior, cfg.prior.alpha, hard, self.means, self.rng, cfg.moves.merge_neighbours)
                if a not in prunes and b not in prunes]
        return MovePlan(splits=splits, merges=merges, prunes=prunes)

    def apply_plan(self, plan: MovePlan, soft: SuffStats) -> None:
        """Surgery on parameters, nets and optimiser state (identical on every rank)."""
        if plan.empty:
            return
        src = cluster_row_map(self.n_clusters, plan.splits, plan.removed).to(self.device)
        k_new, n_split = src.shape[0], len(plan.splits)
        # split cluster k -> rows (first, second); merge (a, b) -> row of a
        halves = {k: (int(torch.nonzero(src == k)[0]), k_new - n_split + i)
                  for i, k in enumerate(plan.splits)}
        merged = [(int(torch.nonzero(src == a)[0]), a, b) for a, b in plan.merges]
        # anchors follow their cluster: a split one to its first half, a merged one to the
        # merged row, a pruned one nowhere (−1: the E-step searches those rows afresh)
        if self.anchors is not None:
            new_row = new_row_of(src[: k_new - n_split], self.n_clusters)
            for row, _, b in merged:
                new_row[b] = row
            self.anchors = new_row[self.anchors]
        old_bias = self.cluster_net.out.bias.detach().clone()

        means, covs, logw = self.means[src].clone(), self.covs[src].clone(), self.log_weights[src].clone()
        sub_means, sub_covs = self.sub_means[src].clone(), self.sub_covs[src].clone()
        sub_logw = self.sub_log_weights[src].clone()
        for k, rows in halves.items():  # paper Eq. 8: new clusters take their subclusters' params
            for j, row in enumerate(rows):
                means[row], covs[row] = self.sub_means[k, j], self.sub_covs[k, j]
                logw[row] = self.log_weights[k] + self.sub_log_weights[k, j]
        for row, a, b in merged:
            m, c = map_estimate(self.prior, soft.rows([a]) + soft.rows([b]))
            means[row], covs[row] = m[0], c[0]
            logw[row] = torch.logaddexp(self.log_weights[a], self.log_weights[b])
            # the two old clusters become the subclusters of the merged one
            sub_means[row] = torch.stack([self.means[a], self.means[b]])
            sub_covs[row] = torch.stack([self.covs[a], self.covs[b]])
            pair = torch.stack([self.log_weights[a], self.log_weights[b]])
            sub_logw[row] = pair - torch.logsumexp(pair, 0)
        old_sub_logw = self.sub_log_weights
        self.means, self.covs = means, covs
        self.log_weights = logw - torch.logsumexp(logw, 0)
        self.sub_means, self.sub_covs, self.sub_log_weights = sub_means, sub_covs, sub_logw

        # clustering net: duplicate the split unit, drop removed ones (paper §3.2); biases
        # shifted so the halves share the old unit's mass in proportion to the subclusters.
        # A merged cluster keeps the output unit (weights and Adam state) of its larger part,
        # its bias raised by ln(1 + n_small / n_large) <= ln 2 for the added mass. (Adding the
        # two biases in log space would be wrong: a unit's bias is only meaningful with its
        # own weights, and a large bias offset by its weights made the merged unit win
        # every point of every cluster.)
        out = self.cluster_net.out
        out_src = src.clone()
        mass_gain = {}
        for row, a, b in merged:
            n_a, n_b = float(soft.n[a]), float(soft.n[b])
            if n_b > n_a:
                out_src[row], mass_gain[row] = b, math.log1p(n_a / n_b)
            else:
                out_src[row], mass_gain[row] = a, math.log1p(n_b / n_a) if n_a > 0 else 0.0
        reindex_rows(out, "weight", out_src, None, self.opt_cluster)
        reindex_rows(out, "bias", out_src, None, self.opt_cluster)
        with torch.no_grad():
            for k, rows in halves.items():
                for j, row in enumerate(rows):
                    out.bias[row] = old_bias[k] + old_sub_logw[k, j].float()
                self._separate_halves(rows, float(old_bias[k]))
            for row, gain in mass_gain.items():
                out.bias[row] += gain

        # subclustering nets: fresh nets for the new and the merged clusters
        split_rows = [row for rows in halves.values() for row in rows]
        fresh_rows = sorted(split_rows + [row for row, _, _ in merged])
        sub_src = src.clone()
        sub_src[fresh_rows] = -1
        fresh = self.sub_nets.fresh(len(fresh_rows), self.torch_gen)
        for name, values in zip(("w1", "b1", "w2", "b2"), fresh, strict=True):
            reindex_rows(self.sub_nets, name, sub_src, values.to(self.device), self.opt_sub)
        self._reset_subclusters(torch.tensor(split_rows, dtype=torch.long, device=self.device))
        for row, _, _ in merged:  # split the merged cluster along the line between its parts
            axis = self.sub_means[row, 0] - self.sub_means[row, 1]
            half = float(axis.norm()) / 2 or 1.0
            self._init_subnet_rows(torch.tensor([row]), self.means[row : row + 1],
                                   (axis / axis.norm().clamp_min(1e-300))[None], torch.tensor([half]))
        self._rewrap()
        self._refresh_mixture()

    def _separate_halves(self, rows: tuple[int, int], unit_bias: float, max_gap: float = 2.0,
                         margin: float = 1.0) -> None:
        """Tilt the two duplicated output units of a split apart along the hidden-feature
        difference of the subcluster means, so each half wins its own subcluster.

        Duplicated units have the same weights, so the net starts out unable to tell the
        halves apart and must break the symmetry by training alone; a small half often
        never wins a point before the next move round and is pruned, and the split is
        proposed again. Here the halves' logit gap g(x) = a·δ·h(x) + c (δ = h(μ₁) − h(μ₂),
        h the hidden layer) is set to the subclusters' own log-odds at their two means
        (clipped to ±``max_gap``: odds e² ≈ 7 at each mean are enough for each half to win
        its subcluster), and the mean of the two units is unchanged.

        The tilt is linear in h(x), so far from the split cluster it lifts the better half
        by |g(x)|/2 and can outbid other clusters' units (a split of one cluster of a
        barely trained 4-cluster net took up to 1200 of 1500 points). So the tilt is scaled
        back, g_t = (1 − t)·Δb + t·g with Δb the untilted bias gap, by the largest
        t ∈ [0, 1] for which, at every other cluster's mean, the better half is no higher
        than the split unit was (bias ``unit_bias``) or stays ``margin`` below the best
        other unit. A function of the parameters only, so every rank does the same.
        """
        net, s = self.cluster_net, self.input_scale
        out = net.out
        with torch.no_grad():
            h_all = torch.relu(net.hidden((self.means * s).float())).double()  # (K, H)
            logits = out(h_all.float()).double()  # (K means, K units)
        h = h_all[list(rows)]  # the halves took their subclusters' parameters (Eq. 8)
        delta = h[0] - h[1]
        norm2 = float(delta.square().sum())
        if norm2 < 1e-12:
            return
        mu = self.means[list(rows)]
        pair = GaussianMixture(mu, self.covs[list(rows)], self.log_weights[list(rows)])
        lp = pair.weighted_log_prob(mu)  # (2 points, 2 halves)
        odds = (lp[:, 0] - lp[:, 1]).clamp(-max_gap, max_gap)  # wanted g at μ₁ and at μ₂
        a = float(odds[0] - odds[1]) / norm2
        if a <= 0:
            return
        c = float(odds[0]) - a * float(delta @ h[0])
        w = out.weight[rows[0]].double()  # both rows hold the duplicated weights
        b1, b2 = float(out.bias[rows[0]]), float(out.bias[rows[1]])
        mean_bias, gap0 = 0.5 * (b1 + b2), b1 - b2
        t = self._tilt_scale(rows, h_all, logits, w, mean_bias, unit_bias - mean_bias, gap0,
                             a * (h_all @ delta) + c, margin)
        step = 0.5 * t * a * delta
        out.weight[rows[0]] = (w + step).float()
        out.weight[rows[1]] = (w - step).float()
        gap = (1.0 - t) * gap0 + t * c
        out.bias[rows[0]] = mean_bias + 0.5 * gap
        out.bias[rows[1]] = mean_bias - 0.5 * gap

    @staticmethod
    def _tilt_scale(rows: tuple[int, int], h_all: Tensor, logits: Tensor, w: Tensor, mean_bias: float,
                    lift: float, gap0: float, g: Tensor, margin: float) -> float:
        """Largest t in [0, 1] such that |(1 − t)·gap0 + t·g_j| ≤ R_j at every other mean j.

        Parameters
        ----------
        h_all : Tensor of shape (K, H)
            Hidden features at every cluster mean.
        logits : Tensor of shape (K, K)
            Untilted logits at every cluster mean (both halves still duplicated).
        w : Tensor of shape (H,)
            The duplicated output weights.
        lift : float
            Split unit's bias minus ``mean_bias`` (≥ |gap0|/2: the halves' biases are the
            unit's plus their subclusters' log weights).
        g : Tensor of shape (K,)
            Full tilt gap a·δ·h(μ_j) + c at every mean.

        Notes
        -----
        The pair's larger logit at x is base(x) + |gap(x)|/2 with base = w·h(x) + mean_bias.
        R_j = max(2·(L_j − margin − base_j), 2·lift), L_j the best other unit at μ_j: the
        pair may reach the split unit's own logit there, or ``margin`` below the best other
        unit. The gap is linear in t, so each j bounds t from above.
        """
        other = torch.ones(logits.shape[0], dtype=torch.bool)  # means and units not of the pair
        other[list(rows)] = False
        if not other.any():
            return 1.0
        best_other = logits[other][:, other].max(1).values  # (K - 2,)
        base = h_all[other] @ w + mean_bias
        bound = (2.0 * (best_other - margin - base)).clamp_min(max(2.0 * lift, abs(gap0)))
        slope = g[other] - gap0  # d gap / dt
        # gap0 + t·slope ≤ R (slope > 0) and gap0 + t·slope ≥ −R (slope < 0)
        limit = torch.where(slope > 0, (bound - gap0) / slope.clamp_min(1e-300),
                            (bound + gap0) / (-slope).clamp_min(1e-300))
        return float(limit.min().clamp(0.0, 1.0))

    # --------------------------------------------------------------------- fit
    def _move_kind(self) -> str | None:
        """``split``/``merge`` when this epoch ends a move round, else None."""
        mv, sch = self.config.moves, self.config.schedule
        e = self.epoch + 1
        if e < sch.warmup_epochs or (e - sch.warmup_epochs) % sch.move_every or e <= self.frozen_until:
            return None
        kinds = [k for k, on in (("split", mv.split), ("merge", mv.merge)) if on]
        return kinds[self.move_round % len(kinds)] if kinds else None

    def step_epoch(self) -> dict:
        """Train one epoch, M-step, maybe a move; returns the history record.

        Raises
        ------
        DataError
            A cluster covariance is not positive-definite: the data's clusters are
            degenerate at the prior's scale (raised on every rank alike).
        """
        with flush_denormals():
            try:
                return self._step_epoch()
            except torch.linalg.LinAlgError as exc:
                raise self._numerical_failure() from exc

    def _numerical_failure(self) -> DataError:
        """The one-line error for a factorisation that failed on the data's statistics,
        e.g. clusters of duplicate rows in features far larger than a fixed
        ``prior.sigma_scale`` assumes, and what to change."""
        sigma_scale = self.config.prior.sigma_scale
        fixes = "standardise the features (data.transform=standard)"
        if isinstance(sigma_scale, float):
            fixes += f" or let the prior follow the data (prior.sigma_scale=auto, not {sigma_scale:g})"
        return DataError(
            f"the fit failed numerically at epoch {self.epoch}: a cluster covariance is not "
            "positive-definite, the clusters are degenerate at the prior's scale (duplicate "
            f"rows, or features on another scale than the prior assumes); {fixes}")

    def _step_epoch(self) -> dict:
        t0 = device_clock(self.device)
        phases: dict[str, float] = {}
        soft, sub, losses = self.run_epoch(train=True, seconds=phases)
        t_mstep = device_clock(self.device)
        if self.epoch + 1 > self.frozen_until:
            self.m_step(soft, sub)
            self._refresh_mixture()
        t_moves = device_clock(self.device)
        splits = merges = 0
        kind = self._move_kind()
        if kind is not None:
            plan = self._decide(kind, soft, sub)
            self.apply_plan(plan, soft)
            splits, merges = len(plan.splits), len(plan.merges)
            self.move_round += 1
            if splits or merges:
                self.rounds_without_move = 0
                self.frozen_until = self.epoch + 1 + self.config.schedule.freeze_epochs
            else:
                self.rounds_without_move += 1
        sch = self.config.schedule
        if self.epoch + 1 >= sch.max_epochs or (
                self.rounds_without_move >= sch.patience and self.epoch + 1 >= sch.min_epochs):
            self.prune_unused(self.hard_counts())  # last epoch: K = clusters that own points
        t_end = device_clock(self.device)
        record = {
            "epoch": self.epoch,
            "n_clusters": self.n_clusters,
            "loss_cluster": losses["loss_cluster"],
            "loss_subcluster": losses["loss_subcluster"],
            "splits_accepted": splits,
            "merges_accepted": merges,
            "prior_scale": self.sigma_scale,
            "prior_nu": self.prior.nu,
            "diagonal_covariances": int(self.prior.diagonal),
            "seconds": t_end - t0,
            # where it went (EPOCH_PHASES); the M-step includes subcluster restarts, the
            # split/merge round the last epoch's pruning
            **{f"seconds_{name}": seconds for name, seconds in phases.items()},
            "seconds_mstep": t_moves - t_mstep,
            "seconds_moves": t_end - t_moves,
        }
        self.history.append(record)
        self.epoch += 1
        for cb in self.callbacks:
            cb(record)
        return record

    @property
    def converged(self) -> bool:
        """No move accepted for ``patience`` rounds (and at least ``min_epochs`` done)."""
        sch = self.config.schedule
        return self.rounds_without_move >= sch.patience and self.epoch >= sch.min_epochs

    def fit(self, init_labels: Tensor | None = None) -> None:
        """Initialise if needed (from ``init_labels`` when given), then run epochs until
        convergence or ``max_epochs``."""
        if not hasattr(self, "cluster_net"):
            self.initialize(init_labels)
        while self.epoch < self.config.schedule.max_epochs and not self.converged:
            self.step_epoch()

    def check_consistency(self, rtol: float = 1e-9) -> None:
        """Raise RuntimeError if the ranks' models differ (they must never diverge).

        One all-reduce (op max) of (c, −c), c a position-weighted float64 checksum of the
        nets, the mixture and subcluster parameters and the schedule counters. Every rank
        runs the same M-steps and surgeries on all-reduced statistics and gradients, so
        the checksums agree to round-off; a relative gap above ``rtol`` names the epoch.
        """
        c = self._checksum()
        both = self.comm.all_reduce(torch.tensor([c, -c], dtype=torch.float64, device=self.device),
                                    op="max").cpu()
        hi, lo = float(both[0]), -float(both[1])
        if hi - lo > rtol * max(abs(hi), abs(lo), 1.0):
            raise RuntimeError(
                f"ranks diverged at epoch {self.epoch}: model checksums range from {lo!r} to "
                f"{hi!r} over {self.comm.world_size} ranks (K = {self.n_clusters} on rank "
                f"{self.comm.rank})"
            )

    def _checksum(self) -> float:
        parts = [*self.cluster_net.parameters(), *self.sub_nets.parameters(), self.means, self.covs,
                 self.log_weights, self.sub_means, self.sub_covs, self.sub_log_weights,
                 torch.tensor([self.epoch, self.n_clusters, self.move_round, self.frozen_until])]
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for t in parts:
            flat = torch.nan_to_num(t.detach().to(self.device, torch.float64).reshape(-1))
            total += (flat * torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64,
                                            device=self.device)).sum()
        return float(total)

    # --------------------------------------------------------------- inference
    def predict_log_proba(self, x: Tensor, batch_size: int = 65536) -> Tensor:
        """ln r from the clustering net for raw rows; shape (N, K)."""
        return FittedModel.from_trainer(self).predict_log_proba(x, batch_size)

    def predict_labels(self, x: Tensor, batch_size: int = 65536) -> Tensor:
        """Argmax of :meth:`predict_log_proba` per batch, for raw rows; shape (N,), int64.

        Never holds the (N, K) responsibilities: at 1.28M rows and K = 1000 they are 5 GB.
        """
        return self.predict_assignments(x, batch_size)[0]

    def predict_assignments(self, x: Tensor, batch_size: int = 65536) -> tuple[Tensor, Tensor]:
        """Hard cluster and its responsibility max_k r_ik, batch by batch, for raw rows
        (:meth:`~deepdpm_core.fitted_model.FittedModel.predict_assignments`)."""
        return FittedModel.from_trainer(self).predict_assignments(x, batch_size)

    @torch.no_grad()
    def hard_counts(self, batch_size: int = 65536) -> Tensor:
        """Points per cluster under the clustering net's argmax, summed over ranks; (K,)."""
        counts = torch.zeros(self.n_clusters, dtype=torch.float64, device=self.device)
        for s in range(0, self.x.shape[0], batch_size):
            with net_precision(self.precision, self.device):
                z = self.cluster_net(self.x[s : s + batch_size] * self.input_scale).argmax(1)
            counts += torch.bincount(z, minlength=self.n_clusters).to(counts)
        return self.comm.all_reduce(counts)

    def prune_unused(self, labels_counts: Tensor) -> None:
        """Drop clusters that own no point (hard counts over all ranks are given)."""
        empty = [int(k) for k in torch.nonzero(labels_counts <= 0).squeeze(1).tolist()]
        if empty and len(empty) < self.n_clusters:
            soft = SuffStats.zeros(self.n_clusters, self.dim, device=self.device)
            self.apply_plan(MovePlan(prunes=empty), soft)

    # ---------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume or predict (tensors and plain containers only)."""
        return {
            "config": self.config.to_dict(),
            "dim": self.dim,
            "n_total": self.n_total,
            "coordinates": self.coords.state_dict(),
            "input_scale": self.input_scale,
            "sigma_scale": self.sigma_scale,
            "prior_scales": [float(p.scale[0, 0] / (p.nu * self.prior_shape[0])) for p in self.priors],
            "prior_nus": [p.nu for p in self.priors],
            "prior_diagonal": self.prior.diagonal,
            "epoch": self.epoch,
            "move_round": self.move_round,
            "rounds_without_move": self.rounds_without_move,
            "frozen_until": self.frozen_until,
            "history": list(self.history),
            "means": self.means.cpu(),
            "covariances": self.covs.cpu(),
            "log_weights": self.log_weights.cpu(),
            "sub_means": self.sub_means.cpu(),
            "sub_covariances": self.sub_covs.cpu(),
            "sub_log_weights": self.sub_log_weights.cpu(),
            "cluster_net": {k: v.cpu() for k, v in self.cluster_net.state_dict().items()},
            "sub_nets": {k: v.cpu() for k, v in self.sub_nets.state_dict().items()},
            "opt_cluster": self.opt_cluster.state_dict(),
            "opt_sub": self.opt_sub.state_dict(),
            "rng": self.rng.bit_generator.state,
            "torch_gen": self.torch_gen.get_state(),
        }

    @classmethod
    def from_state(
        cls,
        state: dict[str, Any],
        x: Tensor | None = None,
        comm: Communicator | None = None,
        wrap: Callable[[nn.Module], nn.Module] | None = None,
        callbacks: list[EpochCallback] | None = None,
        config: Config | None = None,
    ) -> Trainer:
        """A trainer restored from :meth:`state_dict` output.

        Parameters
        ----------
        state : dict
        x : Tensor of shape (N_local, D), optional
            This rank's rows, to resume training; they must be the rows the state was
            trained on (same N over all ranks and, to round-off, the same mean). Without
            them the trainer can only predict.
        comm, wrap, callbacks
            As for the constructor (``comm`` only with ``x``).
        config : Config, optional
            Replaces the stored config (e.g. another ``device``).

        Raises
        ------
        CheckpointError
            ``x`` has another dimension, row count or mean than the training data.
        """
        cfg = config or from_dict(state["config"])
        dim = int(state["dim"])
        if x is None:
            trainer = cls(cfg, torch.zeros(1, dim), wrap=wrap, callbacks=callbacks)
            trainer.coords = stored_coordinates(state)
            trainer.input_scale = float(state["input_scale"])
            trainer.n_total = int(state["n_total"])
        else:
            if x.shape[1] != dim:
                raise CheckpointError(f"the checkpoint was trained on {dim}-D rows, these have {x.shape[1]}")
            trainer = cls(cfg, x, comm, wrap, callbacks)
            stored = stored_coordinates(state)
            tol = 1e-5 * trainer.coords.unit
            if trainer.n_total != int(state["n_total"]) or not torch.allclose(
                    trainer.coords.center, stored.center, rtol=0, atol=tol):
                raise CheckpointError(
                    f"the data differ from the checkpoint's: {trainer.n_total} rows here, "
                    f"{int(state['n_total'])} when it was written (or another mean)")
        trainer.load_state_dict(state)
        return trainer

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the data and config come from the constructor)."""
        dev = self.device
        self.epoch, self.move_round = int(state["epoch"]), int(state["move_round"])
        self.rounds_without_move = int(state["rounds_without_move"])
        self.frozen_until = int(state["frozen_until"])
        self.history = list(state["history"])
        self.means = state["means"].to(dev)
        self.covs = state["covariances"].to(dev)
        self.log_weights = state["log_weights"].to(dev)
        self.sub_means = state["sub_means"].to(dev)
        self.sub_covs = state["sub_covariances"].to(dev)
        self.sub_log_weights = state["sub_log_weights"].to(dev)
        if "sigma_scale" in state:  # the priors as the last M-step left them
            self.sigma_scale = float(state["sigma_scale"])
            nus = state.get("prior_nus", [None] * len(self.priors))
            self.priors = [p.with_scale(self.prior_shape, s, self._kappa(s), nu)
                           for p, s, nu in zip(self.priors, state["prior_scales"], nus, strict=True)]
            self.prior = next(p for p in self.priors if p.diagonal == bool(state["prior_diagonal"]))
        k = self.means.shape[0]
        cfg = self.config
        self.cluster_net = ClusterNet(self.dim, cfg.model.hidden, k, self.torch_gen).to(dev)
        self.cluster_net.load_state_dict(state["cluster_net"])
        self.sub_nets = SubclusterNets(self.dim, cfg.model.sub_hidden, k, self.torch_gen).to(dev)
        self.sub_nets.load_state_dict(state["sub_nets"])
        self.opt_cluster = _adam(self.cluster_net.parameters(), self._lr(cfg.optim.lr_cluster))
        self.opt_sub = _adam(self.sub_nets.parameters(), self._lr(cfg.optim.lr_subcluster))
        if "opt_cluster" in state:
            # copies: Adam keeps the given moment/step tensors and updates them in place
            self.opt_cluster.load_state_dict(copy.deepcopy(state["opt_cluster"]))
            self.opt_sub.load_state_dict(copy.deepcopy(state["opt_sub"]))
            # the learning rate follows this run's (global) batch, not the stored one
            for opt, base in ((self.opt_cluster, cfg.optim.lr_cluster), (self.opt_sub, cfg.optim.lr_subcluster)):
                for group in opt.param_groups:
                    group["lr"] = self._lr(base)
        if "rng" in state:
            self.rng.bit_generator.state = state["rng"]
            self.torch_gen.set_state(state["torch_gen"])
        self._rewrap()
        self._refresh_mixture()
