"""The deployment files the deployment tests read: where they are, their parsed manifests,
and the pins of the images."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
DOCKER = REPO / "docker"
CONFIGS = REPO / "cluster_configs"
CRD_DIR = REPO.parent / "shared" / "schemas" / "kuberay"
KUBERNETES_VERSION = "1.31.0"  # oldest minor still in upstream support when written
EXAMPLE_FILES = {"secret-ray-auth.example.yaml"}  # validated, never applied by kustomize
APP_ROOT_IN_IMAGE = "/app"  # WORKDIR of both images; configs live in /app/cluster_configs


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@functools.cache
def all_documents() -> tuple[tuple[Path, dict], ...]:
    """Every document of every manifest, parsed once (tests copy before changing one)."""
    return tuple((path, doc) for path in manifest_files() for doc in documents(path))


def of_kind(kind: str) -> list[dict]:
    return [doc for _, doc in all_documents() if doc["kind"] == kind]


def doc_id(item: tuple[Path, dict]) -> str:
    path, doc = item
    return f"{path.name}:{doc['kind']}/{doc['metadata']['name']}"


def ray_cluster_specs() -> list[tuple[str, dict]]:
    """(name, RayClusterSpec) of the RayCluster and of every RayJob's own cluster."""
    specs = [(f"RayCluster/{d['metadata']['name']}", d["spec"]) for d in of_kind("RayCluster")]
    specs += [
        (f"RayJob/{d['metadata']['name']}", d["spec"]["rayClusterSpec"]) for d in of_kind("RayJob")
    ]
    return specs


def pod_specs() -> list[tuple[str, dict]]:
    """(where, PodSpec) of every pod these manifests create."""
    pods = []
    for name, spec in ray_cluster_specs():
        pods.append((f"{name} head", spec["headGroupSpec"]["template"]["spec"]))
        for group in spec["workerGroupSpecs"]:
            pods.append((f"{name} worker {group['groupName']}", group["template"]["spec"]))
    for job in of_kind("RayJob"):
        pods.append(
            (
                f"RayJob/{job['metadata']['name']} submitter",
                job["spec"]["submitterPodTemplate"]["spec"],
            )
        )
    for deployment in of_kind("Deployment"):
        pods.append(
            (f"Deployment/{deployment['metadata']['name']}", deployment["spec"]["template"]["spec"])
        )
    return pods


def quantity(value: str | int) -> float:
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


def dockerfile_arg(dockerfile: Path, name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", dockerfile.read_text(), re.MULTILINE)
    assert match, f"{dockerfile.name} has no default for ARG {name}"
    return match.group(1)


def constraints() -> dict[str, str]:
    pins = {}
    for line in (DOCKER / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower()] = version
    return pins
