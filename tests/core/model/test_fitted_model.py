"""A fitted model is the nets, the input transform and the mixture: no training data, no
optimiser, no search, whether it comes from ``fit`` or from a file."""

from __future__ import annotations

import gc
import types

import numpy as np
import torch

from deepdpm_core.data import make_mixture
from deepdpm_core.model import DeepDPM
from deepdpm_core.training import Search

N, D = 1537, 6  # N unlike any model dimension (K, D, hidden sizes)


def _reachable(root: object) -> list[object]:
    """Every object reachable from ``root`` through references, short of modules and classes."""
    seen, stack, out = {id(root)}, [root], []
    while stack:
        obj = stack.pop()
        out.append(obj)
        for ref in gc.get_referents(obj):
            if isinstance(ref, (types.ModuleType, type, types.FunctionType)) or id(ref) in seen:
                continue
            seen.add(id(ref))
            stack.append(ref)
    return out


def _assert_holds_no_training_data(est: DeepDPM) -> None:
    objects = _reachable(est)
    assert not any(isinstance(o, (Search, torch.optim.Optimizer)) for o in objects)
    arrays = [o for o in objects if isinstance(o, (torch.Tensor, np.ndarray))]
    rows = {tuple(a.shape) for a in arrays if a.ndim and a.shape[0] == N}
    assert not rows, f"tensors with one row per training point: {rows}"
    # the model is its parameters: O(K·D² + net), far below the N × D data
    k = est.n_clusters_
    assert sum(a.nbytes if isinstance(a, np.ndarray) else a.element_size() * a.numel()
               for a in arrays if not isinstance(a, torch.nn.Parameter)) < 4 * k * (D * D + 2 * D + 4) + 4096


def test_a_fitted_and_a_loaded_model_hold_no_training_data(tmp_path):
    x, _ = make_mixture(N, D, 3, random_state=0)
    est = DeepDPM({"seed": 0, "schedule": {"max_epochs": 12}, "init": {"n_clusters": 3}}).fit(x)
    est.labels_ = None  # the fit's own labels are the one per-row output it keeps, by contract
    _assert_holds_no_training_data(est)
    est.save(tmp_path / "model.pt")
    loaded = DeepDPM.load(tmp_path / "model.pt")
    _assert_holds_no_training_data(loaded)
    assert len(loaded.history_) == len(est.history_) and loaded.n_clusters_ == est.n_clusters_
    np.testing.assert_array_equal(loaded.predict(x), est.predict(x))


def test_a_model_file_whose_config_names_keys_now_fixed_loads(tmp_path):
    x, _ = make_mixture(300, 3, 2, random_state=0)
    est = DeepDPM({"seed": 0, "schedule": {"max_epochs": 6}, "init": {"n_clusters": 2}}).fit(x)
    est.save(tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    config = state["config"]
    config["moves"]["merge_neighbours"] = 3  # as an earlier version wrote every key
    config["ae"]["input_scaling"] = "global"
    config["moves"]["prune_empty"] = True  # the name of prune_small before
    # the rules of the search that were settings, with the values earlier versions wrote
    config["prior"].update(covariance_floor=1.0e-4, coarsening_per_parameter=7.5)
    config["moves"].update(min_subcluster_size=5, prune_small=True, split_valley=0.75, merge_valley=0.9,
                           birth_parts=4, exact_valley=0.2)
    config["schedule"].update(freeze_epochs=2, patience=3, settled_spread=0.01, settled_band=0.07)
    torch.save(state, tmp_path / "earlier.pt")
    earlier = DeepDPM.load(tmp_path / "earlier.pt")
    assert earlier.get_config() == DeepDPM.load(tmp_path / "model.pt").get_config()
    np.testing.assert_array_equal(earlier.predict(x), est.predict(x))


def test_checkpoints_are_written_atomically_with_the_umask_mode(tmp_path):
    import os
    import stat

    import pytest

    from deepdpm_core.model import safe_load, save_checkpoint

    path = tmp_path / "deep" / "model.pt"
    old = os.umask(0o027)
    try:
        save_checkpoint({"w": torch.ones(3)}, path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    # the same state gives the same bytes (the model hash predictions carry depends on it)
    again = tmp_path / "again.pt"
    save_checkpoint({"w": torch.ones(3)}, again)
    assert again.read_bytes() == path.read_bytes()
    again.unlink()
    # a write that fails keeps the old file and leaves no temporary file
    with pytest.raises(TypeError, match="pickle"):  # a generator cannot be pickled
        save_checkpoint({"w": (i for i in range(3))}, path)
    assert torch.equal(safe_load(path)["w"], torch.ones(3))
    assert [p.name for p in path.parent.iterdir()] == ["model.pt"]
    with pytest.raises(IsADirectoryError):
        save_checkpoint({}, tmp_path)
