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

The images themselves are checked in ``test_images.py``.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deepdpm_core.config import load_config
from tests.support.deploy_files import (
    APP_ROOT_IN_IMAGE,
    CONFIGS,
    CRD_DIR,
    DOCKER,
    EXAMPLE_FILES,
    K8S,
    KUBERNETES_VERSION,
    REPO,
    all_documents,
    constraints,
    doc_id,
    dockerfile_arg,
    documents,
    manifest_files,
    of_kind,
    pod_specs,
    quantity,
    ray_cluster_specs,
)


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


RAY_DOCS = [item for item in all_documents() if item[1]["apiVersion"].startswith("ray.io/")]
CORE_DOCS = [item for item in all_documents() if not item[1]["apiVersion"].startswith("ray.io/")]


@pytest.mark.parametrize("item", RAY_DOCS, ids=doc_id)
def test_kuberay_documents_match_the_crd_schema(item, crd_validators):
    _, doc = item
    key = (doc["apiVersion"], doc["kind"])
    assert key in crd_validators, f"no CRD for {key}; have {sorted(crd_validators)}"
    errors = sorted(crd_validators[key].iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:10]
    )


def test_the_strict_crd_schema_rejects_an_unknown_field(crd_validators):
    job = copy.deepcopy(of_kind("RayJob")[0])
    job["spec"]["shutdownAfterJobFinish"] = True  # a typo the API server would reject
    worker = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    worker["template"]["spec"]["containers"][0]["resource"] = {}
    messages = [e.message for e in crd_validators[("ray.io/v1", "RayJob")].iter_errors(job)]
    assert any("shutdownAfterJobFinish" in m for m in messages), messages
    assert any("'resource'" in m for m in messages), messages


@pytest.mark.parametrize("item", CORE_DOCS, ids=doc_id)
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
    uids = {dockerfile_arg(DOCKER / f"Dockerfile.{v}", "APP_UID") for v in ("gpu", "cpu")}
    assert len(uids) == 1
    uid = int(uids.pop())
    for where, pod in pod_specs():
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] == uid, where
        assert sc["seccompProfile"]["type"] == "RuntimeDefault", where
        for container in pod["containers"]:
            csc = container["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False, where
            assert csc["capabilities"]["drop"] == ["ALL"], where
            requests, limits = container["resources"]["requests"], container["resources"]["limits"]
            for resource in ("cpu", "memory"):
                assert quantity(requests[resource]) <= quantity(limits[resource]), (
                    where,
                    resource,
                )
            if "nvidia.com/gpu" in limits:  # extended resources: request must equal limit
                assert requests["nvidia.com/gpu"] == limits["nvidia.com/gpu"], where


def test_ray_pods_mount_a_memory_backed_dev_shm_and_the_data_volume():
    data_claims = {d["metadata"]["name"] for d in of_kind("PersistentVolumeClaim")}
    for where, pod in pod_specs():
        if " submitter" in where or where.startswith("Deployment/"):
            continue
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        shm = volumes[mounts["/dev/shm"]]["emptyDir"]
        assert shm["medium"] == "Memory", where
        # the object store may not take the whole memory limit of the container
        limit = quantity(pod["containers"][0]["resources"]["limits"]["memory"])
        assert 2**30 <= quantity(shm["sizeLimit"]) <= 0.5 * limit, where
        claim = volumes[mounts["/mnt/data"]]["persistentVolumeClaim"]["claimName"]
        assert claim in data_claims, where


def test_gpu_pods_tolerate_gpu_taints_and_heads_hold_no_gpu():
    for name, spec in ray_cluster_specs():
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
        for d in of_kind("RayCluster")
        for g in d["spec"]["workerGroupSpecs"]
    ), "the RayCluster needs a GPU worker group"


def test_ray_clusters_use_token_auth_from_the_secret_and_the_pinned_ray():
    secret = documents(K8S / "secret-ray-auth.example.yaml")[0]
    assert set(secret["stringData"]) == {"auth_token"}  # the key KubeRay reads
    ray_pin = constraints()["ray"]
    for name, spec in ray_cluster_specs():
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
    jobs = {d["metadata"]["name"]: d["spec"] for d in of_kind("RayJob")}
    assert set(jobs) == {"deepdpm-extract", "deepdpm-fit", "deepdpm-predict"}
    for name, spec in jobs.items():
        assert spec["shutdownAfterJobFinishes"] is True, name
        assert 0 < spec["ttlSecondsAfterFinished"] <= 600, name
        assert spec["activeDeadlineSeconds"] > 0, name
    # extract starts at once; later steps wait (suspended) until the previous one succeeded
    assert not jobs["deepdpm-extract"].get("suspend", False)
    assert jobs["deepdpm-fit"]["suspend"] is True and jobs["deepdpm-predict"]["suspend"] is True


def test_references_between_objects_resolve():
    config_maps = {d["metadata"]["name"]: d["data"] for d in of_kind("ConfigMap")}
    for where, pod in pod_specs():
        for container in pod["containers"]:
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in config_maps, where
    service = of_kind("Service")[0]
    deployment = of_kind("Deployment")[0]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    port = service["spec"]["ports"][0]["port"]
    uri = config_maps["deepdpm-env"]["MLFLOW_TRACKING_URI"]
    assert uri == f"http://{service['metadata']['name']}:{port}"
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    claims = {d["metadata"]["name"] for d in of_kind("PersistentVolumeClaim")}
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
    config_maps = {d["metadata"]["name"]: d["data"] for d in of_kind("ConfigMap")}
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
        for job in of_kind("RayJob")
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
    data_root = {d["metadata"]["name"]: d["data"] for d in of_kind("ConfigMap")}["deepdpm-env"][
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
    fit_job = next(j for j in of_kind("RayJob") if j["metadata"]["name"] == "deepdpm-fit")
    gpu_workers = fit_job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"]
    assert fit.num_workers == gpu_workers and fit.use_gpu


# ----------------------------------------------------------------------------- kustomize
def test_kustomization_applies_every_manifest_but_the_examples():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    expected = {p.name for p in manifest_files()} - EXAMPLE_FILES
    assert set(kustomization["resources"]) == expected
    tags = {image["newTag"] for image in kustomization["images"]}
    assert len(tags) == 1, f"one image tag for the whole deployment, got {tags}"
    used = {c["image"] for _, pod in pod_specs() for c in pod["containers"]}
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
