#!/usr/bin/env bash
# The prepared GPU check: ImageNet-sized clustering on one GPU, in at most 7 minutes.
#
# From the repository root of a bare GPU machine (torch, numpy, scikit-learn, pyarrow; see
# ../shared/GPU.md): installs the wheels carried in .whl/ (faiss-cpu, pydantic, ...) if there are
# any, then
#   1. bench/scale.py --n N --d 128 --k 1000 --device cuda --epochs 3 --kmeans-iters 1:
#      one epoch and its parts, the initialisation, peak GPU memory;
#   2. bench/k_vs_n.py --families sphere-1000 --n N --seeds 0 --epoch-log --bgm-max-n 0 (no BGM at
#      a small N either): the whole fit (K, NMI, seconds, epochs; FAISS k-means given K after it,
#      while time is left),
# each under its share of the time, and writes one JSON after each step (bench/results/gpu_check.json,
# and a copy in $OUT when the device runner sets it) and a short summary with the targets:
# fit < 60 s, K 950-1,050, NMI >= 0.90, epoch <= 0.4 s.
#
#   bash bench/gpu_check.sh                                   # on the GPU machine
#   GPU_CHECK_N=20000 GPU_CHECK_K=50 GPU_CHECK_D=16 GPU_CHECK_FAMILY=sphere GPU_CHECK_DEVICE=cpu \
#     GPU_CHECK_BUDGET_S=240 bash bench/gpu_check.sh          # a small run on the CPU: the script works
#
# Settings (environment): GPU_CHECK_N rows (1280000), GPU_CHECK_K and GPU_CHECK_D of the scale
# step (1000, 128), GPU_CHECK_FAMILY of the fit (sphere-1000), GPU_CHECK_DEVICE (cuda),
# GPU_CHECK_BUDGET_S for both steps (420), GPU_CHECK_SCALE_S the scale step's share (130),
# GPU_CHECK_JSON (bench/results/gpu_check.json). The fit runs on the default device (auto: the GPU
# when there is one), as a user's would.
set -u
cd "$(dirname "$0")/.."
N=${GPU_CHECK_N:-1280000}
K=${GPU_CHECK_K:-1000}
D=${GPU_CHECK_D:-128}
FAMILY=${GPU_CHECK_FAMILY:-sphere-1000}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
BUDGET=${GPU_CHECK_BUDGET_S:-420}
SCALE_S=${GPU_CHECK_SCALE_S:-130}
JSON=${GPU_CHECK_JSON:-bench/results/gpu_check.json}
START=$(date +%s)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "gpu_check: the carried wheels did not install" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
fi

# JSON of what is done so far: the machine, each step's command, exit status and results
write_json() {
  GPU_CHECK_WORK=$WORK python3 - "$JSON" "$N" "$K" "$D" "$FAMILY" "$DEVICE" <<'EOF'
import json, os, sys
from pathlib import Path

path, n, k, d, family, device = sys.argv[1:]
work = Path(os.environ["GPU_CHECK_WORK"])
out = {"n": int(n), "k": int(k), "d": int(d), "family": family, "device_asked": device}
try:
    import torch
    out["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    out["torch"] = torch.__version__
except ImportError:
    out["device"] = "torch not importable"
for step in ("scale", "fit"):
    if not (work / f"{step}.cmd").exists():
        continue
    rec = {"command": (work / f"{step}.cmd").read_text().strip()}
    if (work / f"{step}.rc").exists():
        rec["exit_status"] = int((work / f"{step}.rc").read_text())
        rec["seconds"] = float((work / f"{step}.seconds").read_text())
    log = (work / f"{step}.out").read_text() if (work / f"{step}.out").exists() else ""
    if step == "scale":  # the last stdout line is the result's JSON (--json)
        lines = [ln for ln in log.splitlines() if ln.startswith("{")]
        if lines:
            rec["result"] = json.loads(lines[-1])
    elif (work / "fit.json").exists():
        rec["result"] = json.loads((work / "fit.json").read_text())
    rec["log_tail"] = (work / f"{step}.err").read_text()[-3000:] if (work / f"{step}.err").exists() else ""
    out[step] = rec
scale = out.get("scale", {}).get("result", {})
fit = next((r for r in out.get("fit", {}).get("result", {}).get("records", []) if r["method"] == "DeepDPM"), None)
kmeans = next((r for r in out.get("fit", {}).get("result", {}).get("records", [])
               if r["method"].startswith("k-means")), None)
summary = {}
if scale:
    summary.update(epoch_s=scale["epoch_seconds"], later_epoch_s=scale["later_epoch_seconds"],
                   epoch_phases_s=scale["epoch_phase_seconds"], init_s=scale["init_seconds"],
                   steps=scale["steps"], batch_size=scale["batch_size"], peak_gpu_mb=scale.get("peak_gpu_mb"))
if fit:
    summary.update(fit_k=fit["k"], fit_nmi=fit["nmi"], fit_s=fit["seconds"], fit_epochs=fit["epochs"])
if kmeans:
    summary.update(kmeans_nmi=kmeans["nmi"], kmeans_s=kmeans["seconds"])
targets = {}
if fit:
    targets.update({"fit < 60 s": fit["seconds"] < 60, "K 950-1,050": 950 <= fit["k"] <= 1050,
                    "NMI >= 0.90": fit["nmi"] >= 0.90})
if scale:
    targets["epoch <= 0.4 s"] = (scale["later_epoch_seconds"] or scale["epoch_seconds"]) <= 0.4
out["summary"], out["targets_met"] = summary, targets
Path(path).parent.mkdir(parents=True, exist_ok=True)
Path(path).write_text(json.dumps(out, indent=1) + "\n")
if os.environ.get("OUT"):
    (Path(os.environ["OUT"]) / Path(path).name).write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps({"summary": summary, "targets_met": targets}))
EOF
}

# run_step NAME SECONDS COMMAND...: the command under a time limit, its output and status kept
run_step() {
  local name=$1 limit=$2 t0
  shift 2
  echo "$*" > "$WORK/$name.cmd"
  t0=$(date +%s.%N)
  timeout --signal=INT --kill-after=15 "$limit" "$@" > "$WORK/$name.out" 2> "$WORK/$name.err"
  echo $? > "$WORK/$name.rc"
  python3 -c "import sys; print(round($(date +%s.%N) - $t0, 1))" > "$WORK/$name.seconds"
  echo "gpu_check: $name exited $(cat "$WORK/$name.rc") after $(cat "$WORK/$name.seconds") s" >&2
}

run_step scale "$SCALE_S" python3 bench/scale.py --n "$N" --d "$D" --k "$K" --device "$DEVICE" \
  --epochs 3 --kmeans-iters 1 --json
write_json > /dev/null
LEFT=$(( BUDGET - ($(date +%s) - START) - 10 ))
run_step fit "$LEFT" python3 bench/k_vs_n.py --families "$FAMILY" --n "$N" --seeds 0 --epoch-log --bgm-max-n 0 \
  --json "$WORK/fit.json"
echo "gpu_check: $(( $(date +%s) - START )) s in all; $JSON" >&2
write_json
