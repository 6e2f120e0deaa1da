"""Reduced-precision nets: bf16/TF32 matmuls for the nets, same clustering."""

import pytest
import torch
from torch.nn.modules.module import register_module_forward_hook

from deepdpm_core.config import Config
from deepdpm_core.data import make_mixture, nmi
from deepdpm_core.model import FittedModel
from deepdpm_core.nets import ClusterNet
from deepdpm_core.runtime import net_precision, resolve_precision
from deepdpm_core.training import start_fit


def _fit(x, precision):
    cfg = Config().with_overrides({
        "device": "cpu", "init.n_clusters": 1, "model.precision": precision,
        "schedule.max_epochs": 80, "schedule.warmup_epochs": 3, "schedule.move_every": 3,
        "small_data.max_rows": 0,  # the net search, whose minibatch steps the precision scopes
    })
    search = start_fit(cfg, torch.as_tensor(x))
    dtypes = set()

    def record(module, inputs, out):  # global hook: splits rebuild the net
        if isinstance(module, ClusterNet):  # the logits, alone or last after the loss
            dtypes.add((out[-1] if isinstance(out, tuple) else out).dtype)

    hook = register_module_forward_hook(record)
    try:
        search.fit()
    finally:
        hook.remove()
    labels = FittedModel.from_search(search).predict_assignments(torch.as_tensor(x))[0].numpy()
    return search, labels, dtypes


@pytest.mark.slow
def test_bf16_nets_find_the_same_clusters_as_float32():
    # bf16 rounds the nets' GEMM inputs to 8 significant bits, coarser than TF32's 11: if
    # the clustering survives bf16 it survives TF32 (both accumulate in float32)
    torch.set_num_threads(1)
    x, y = make_mixture(20_000, 16, 40, imbalance=1.0, min_weight=0.005, random_state=3)
    ref, lab_ref, dtypes_ref = _fit(x, "float32")
    low, lab_low, dtypes_low = _fit(x, "bf16")
    assert dtypes_ref == {torch.float32} and dtypes_low == {torch.bfloat16}
    assert low.n_clusters == ref.n_clusters == 40
    assert abs(nmi(y, lab_low) - nmi(y, lab_ref)) <= 0.01 and nmi(y, lab_low) > 0.99
    # the statistics and the mixture stay float64: precision is scoped to the nets
    assert low.state.means.dtype == low.state.covariances.dtype == torch.float64
    assert [h["loss_cluster"] for h in low.history] != [h["loss_cluster"] for h in ref.history]


def test_auto_is_tf32_on_cuda_and_float32_elsewhere():
    assert resolve_precision("auto", torch.device("cuda")) == "tf32"
    assert resolve_precision("auto", torch.device("cpu")) == "float32"
    assert resolve_precision("bf16", torch.device("cpu")) == "bf16"


def test_tf32_is_scoped_to_the_block_and_cuda_only():
    mm = torch.backends.cuda.matmul
    before = mm.fp32_precision
    with net_precision("tf32", torch.device("cuda")):
        assert mm.fp32_precision == "tf32"
    assert mm.fp32_precision == before
    with net_precision("tf32", torch.device("cpu")):  # no TF32 unit: plain float32
        assert mm.fp32_precision == before
        assert not torch.is_autocast_enabled("cpu")
    with net_precision("bf16", torch.device("cpu"), backward=True):  # autocast: forward only
        assert not torch.is_autocast_enabled("cpu")


def test_epochs_flush_subnormals_and_restore_the_mode():
    # Adam moments of weights with zero gradient decay into the subnormal range, where the
    # CPU is many times slower; inside an epoch they are flushed to zero, outside left alone
    tiny = torch.finfo(torch.float32).tiny
    seen = []
    X, _ = make_mixture(600, 3, 3, random_state=0)
    search = start_fit(Config().with_overrides({"init.n_clusters": 3, "device": "cpu"}), torch.from_numpy(X))
    search.initialize()
    assert float(torch.tensor([tiny / 4]) * 1.0) > 0  # the default: subnormals kept
    search.step_epoch([lambda rec: seen.append(float(torch.tensor([tiny / 4]) * 1.0))])
    assert seen == [0.0]  # inside the epoch (callbacks run in it): flushed
    assert float(torch.tensor([tiny / 4]) * 1.0) > 0  # and the mode is restored after it
    torch.set_flush_denormal(True)
    try:
        search.step_epoch()
        assert float(torch.tensor([tiny / 4]) * 1.0) == 0  # a caller's own setting is kept
    finally:
        torch.set_flush_denormal(False)
