#!/usr/bin/env bash
# The bare install works: in a fresh virtual environment, `pip install .` (no extras) gives
# the estimator and `deepdpm fit` on a .npy file, leaves Ray and MLflow out, and a path
# that needs Ray says in one line (exit code 2) which extra to install.
# torch and its CUDA libraries take 5 GB, a minute to delete from a slow disk: without a
# TMPDIR, the venv goes to /dev/shm where 12 GB of memory are available.
# BARE_INSTALL_TORCH picks another torch (e.g. a CPU build).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
if [[ -z "${TMPDIR:-}" && -d /dev/shm ]] \
    && awk '/^MemAvailable:/ { exit !($2 > 12 * 1024 * 1024) }' /proc/meminfo 2>/dev/null; then
    export TMPDIR=/dev/shm
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
unset PYTHONPATH MLFLOW_TRACKING_URI
python -m venv "$tmp/venv"
py="$tmp/venv/bin/python"
# torch as .ci/run installs it (the local wheel mirror), then the project without extras;
# no byte-compiling of what is never imported (most of torch): half the install time
"$py" -m pip install -q --no-compile "${BARE_INSTALL_TORCH:-torch==2.14.1}"
# built from a copy of the tree (tracked and untracked files, not ignored ones): an in-tree
# build would leave build/ behind, whose stale modules a later build would ship
mkdir "$tmp/src"
git ls-files -z --cached --others --exclude-standard \
    | tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$tmp/src"
"$py" -m pip install -q --no-compile "$tmp/src"
echo "bare install: installed in $((SECONDS - start)) s"

mkdir "$tmp/work" && cd "$tmp/work"
"$py" - <<'EOF'
import importlib.util

import numpy as np

for name in ("ray", "mlflow", "webdataset", "torchvision", "umap"):
    assert importlib.util.find_spec(name) is None, f"the bare install has {name}"

from deepdpm_core import DeepDPM

rng = np.random.default_rng(0)
X = np.concatenate([rng.normal(c, 0.3, (100, 3)) for c in (0.0, 4.0, 8.0)]).astype(np.float32)
model = DeepDPM(random_state=0, schedule__max_epochs=5).fit(X)
assert model.predict(X).shape == (300,)
print(f"bare install: DeepDPM(random_state=0).fit(X): K={model.n_clusters_}")
np.save("x.npy", X)
EOF

deepdpm="$tmp/venv/bin/deepdpm"
"$deepdpm" fit --input x.npy --output run --quiet --set schedule.max_epochs=5
test -f run/model.pt && test -f run/assignments.parquet
test ! -e mlflow.db  # without MLflow a fit is not tracked

set +e
"$deepdpm" fit --input x.npy --output run2 --num-workers 2 > out.txt 2> err.txt
rc=$?
set -e
cat err.txt
hint='deepdpm fit: error: a fit on Ray (--num-workers 2) needs ray, which is not installed: pip install "deepdpm[ray]"'
if [[ $rc -ne 2 || -s out.txt || "$(cat err.txt)" != "$hint" ]]; then
    echo "bare install: deepdpm fit --num-workers 2 gave exit code $rc, not the one-line hint" >&2
    exit 1
fi
echo "bare install: checked in $((SECONDS - start)) s"
