"""deploy/ checked without Docker, a cluster or the network.

The deploy files are for users; nothing here runs them. These tests pin what would
otherwise drift silently: settings that must name real Config fields, ports and names that
must agree across the Dockerfile, compose and the Kubernetes manifests, files the image
copies, and the container health check script (run for real against a tiny gRPC server).
"""

from __future__ import annotations

import asyncio
import dataclasses
import fnmatch
import json
import os
import re
import shlex
import socket
import sys
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from service.api.server import LIVENESS_SERVICE
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from service.config import Config
from service.config import Config, load_config

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
HEALTHCHECK = DEPLOY / "docker" / "healthcheck.py"
COMPOSE = DEPLOY / "docker-compose.yml"
CONFIG_FIELDS = {f.name for f in dataclasses.fields(Config)}
REQUIRED_KEYS = {"ConfigMap": "data", "Deployment": "spec", "Service": "spec",
                 "HorizontalPodAutoscaler": "spec"}
# grpc probes are GA from 1.27; also validate against the newest bundled schema.
MIN_K8S = "1.27.0"


# --- loaders ---------------------------------------------------------------------------

def _yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def _k8s_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.y*ml") if p.name != "kustomization.yaml")


def _manifests() -> list[dict[str, Any]]:
    return [d for p in _k8s_files() for d in _yaml_docs(p)]


def _one(kind: str) -> dict[str, Any]:
    found = [d for d in _manifests() if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _container() -> dict[str, Any]:
    containers = _one("Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    c: dict[str, Any] = containers[0]
    return c


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    return data


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):  # compose allows ["K=V", ...] too
        env = dict(e.split("=", 1) for e in env)
    return {str(k): str(v) for k, v in env.items()}


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        instr, _, args = (buf + line).partition(" ")
        out.append((instr.upper(), args.strip()))
        buf = ""
    return out


def _instr(name: str) -> list[str]:
    return [args for instr, args in _dockerfile() if instr == name]


def _docker_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for args in _instr("ENV"):
        for tok in shlex.split(args):
            k, _, v = tok.partition("=")
            env[k] = v
    return env


def _port(listen: str) -> int:
    return int(listen.rsplit(":", 1)[1])


def _dockerignored(rel: str) -> bool:
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    assert not any(p.startswith("!") for p in patterns), "negations: extend this matcher"
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pat in patterns:
        for pre in prefixes:
            if fnmatch.fnmatch(pre, pat) or (
                    pat.startswith("**/") and fnmatch.fnmatch(pre.rsplit("/", 1)[-1], pat[3:])):
                return True
    return False


# --- Kubernetes --------------------------------------------------------------------------

def test_every_manifest_has_the_keys_of_its_kind() -> None:
    docs = _manifests()
    assert {d.get("kind") for d in docs} == set(REQUIRED_KEYS)
    for d in docs:
        assert d.get("apiVersion"), d
        assert d["metadata"].get("name"), d
        assert d.get(REQUIRED_KEYS[d["kind"]]), f"{d['kind']} without {REQUIRED_KEYS[d['kind']]}"


def test_kustomization_lists_every_manifest() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    assert sorted(kust["resources"]) == sorted(p.name for p in _k8s_files())


def test_service_targets_the_named_grpc_port_of_the_pods() -> None:
    dep, svc = _one("Deployment"), _one("Service")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["type"] == "ClusterIP"
    ports = {p["name"]: p["containerPort"] for p in _container()["ports"]}
    by_name = {p["name"]: p for p in svc["spec"]["ports"]}
    assert set(by_name) == {"grpc", "metrics"}
    sp = by_name["grpc"]
    assert sp["targetPort"] == "grpc" and sp["targetPort"] in ports
    assert sp["appProtocol"] == "grpc"
    assert sp["port"] == ports["grpc"] == 50051
    assert by_name["metrics"]["targetPort"] == "metrics" and by_name["metrics"]["port"] == ports["metrics"]


def test_probes_are_grpc_health_checks_on_the_serving_port() -> None:
    c = _container()
    listen = _port(_one("ConfigMap")["data"]["RETRIEVAL_LISTEN"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        grpc_probe = c[probe]["grpc"]
        assert grpc_probe["port"] == listen == 50051, probe
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["grpc"].get("service", "") == "", probe  # "" = models + engine ready
    # Liveness must not follow OpenSearch: the server's always-on health name.
    assert c["livenessProbe"]["grpc"]["service"] == LIVENESS_SERVICE


_GRACE_S = Config().shutdown_grace_s


def test_pods_outlive_the_drain() -> None:
    spec = _one("Deployment")["spec"]["template"]["spec"]
    pre_stop = _container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert spec["terminationGracePeriodSeconds"] > float(pre_stop[1]) + _GRACE_S
    compose_grace = _compose()["services"]["retrieval"]["stop_grace_period"]
    assert float(compose_grace.rstrip("s")) > _GRACE_S


def test_pods_run_as_the_image_user_and_never_root() -> None:
    pod = _one("Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert pod["runAsNonRoot"] is True
    (user,) = _instr("USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric uid lets runAsNonRoot verify the image"
    assert pod["runAsUser"] == int(uid) and pod["runAsGroup"] == int(gid)
    assert _container()["securityContext"]["allowPrivilegeEscalation"] is False


def test_hpa_scales_the_deployment_on_cpu() -> None:
    hpa, dep = _one("HorizontalPodAutoscaler"), _one("Deployment")
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", dep["metadata"]["name"])
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 10)
    assert dep["spec"]["replicas"] == hpa["spec"]["minReplicas"]
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    # Utilisation is a share of the request: without one the HPA cannot compute it.
    assert _container()["resources"]["requests"]["cpu"]


def test_configmap_holds_valid_config_that_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    cm = _one("ConfigMap")
    assert [e["configMapRef"]["name"] for e in _container()["envFrom"]] == [cm["metadata"]["name"]]
    for key, value in cm["data"].items():
        assert key.startswith("RETRIEVAL_") and key[10:].lower() in CONFIG_FIELDS, key
        monkeypatch.setenv(key, value)
    cfg = load_config()  # every value coerces to its field's type
    assert cfg.engine_kind == "opensearch"
    assert cfg.model_workers == int(cm["data"]["RETRIEVAL_MODEL_WORKERS"])


def test_manifests_match_the_kubernetes_schemas() -> None:
    """Strict (unknown fields fail) against schemas shipped offline by kubernetes-validate."""
    kv = pytest.importorskip("kubernetes_validate")
    for doc in _manifests():
        for version in (MIN_K8S, kv.latest_version()):
            kv.validate(doc, version, strict=True)


# --- compose -----------------------------------------------------------------------------

def test_compose_env_names_are_config_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    env = _env(_compose()["services"]["retrieval"])
    for key, value in env.items():
        assert key.startswith("RETRIEVAL_") and key[10:].lower() in CONFIG_FIELDS, key
        monkeypatch.setenv(key, value)
    assert load_config().opensearch_url == "http://opensearch:9200"


def test_compose_references_resolve() -> None:
    compose = _compose()
    services, volumes = compose["services"], set(compose.get("volumes") or {})
    for name, svc in services.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if cond.get("condition") == "service_healthy":
                assert services[dep].get("healthcheck"), f"{dep} has no healthcheck to wait on"
        for mount in svc.get("volumes", []):
            source = mount.split(":", 1)[0]
            assert source.startswith((".", "/")) or source in volumes, f"undeclared volume {source}"
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    build = services["retrieval"]["build"]
    context = (COMPOSE.parent / build["context"]).resolve()
    assert context == REPO and (context / build["dockerfile"]).resolve() == DOCKERFILE
    # The OpenSearch URL names the compose service on its HTTP port.
    url = _env(services["retrieval"])["RETRIEVAL_OPENSEARCH_URL"]
    assert re.fullmatch(r"http://(\w+):9200", url) and url.split("/")[2].split(":")[0] in services


def test_compose_opensearch_is_pinned_single_node_without_security() -> None:
    os_svc = _compose()["services"]["opensearch"]
    # The image runs the same OpenSearch version the tests run (the Maven launcher's default).
    launcher = (REPO / "deploy" / "opensearch" / "opensearch.sh").read_text()
    default = re.search(r'^DEFAULT_VERSION="([0-9.]+)"', launcher, re.M)
    assert default is not None
    assert os_svc["image"] == f"opensearchproject/opensearch:{default.group(1)}"
    env = _env(os_svc)
    assert env["discovery.type"] == "single-node"
    assert env["DISABLE_SECURITY_PLUGIN"] == env["DISABLE_INSTALL_DEMO_CONFIG"] == "true"
    assert "-Xmx" in env["OPENSEARCH_JAVA_OPTS"]
    assert "_cluster/health" in " ".join(os_svc["healthcheck"]["test"])
    assert any(v.endswith(":/usr/share/opensearch/data") for v in os_svc["volumes"])


def test_compose_and_kubernetes_run_one_image_tagged_with_the_package_version() -> None:
    image = _compose()["services"]["retrieval"]["image"]
    assert image == _container()["image"]
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert image.rsplit(":", 1)[1] == version


def test_compose_healthcheck_runs_the_script_the_image_ships() -> None:
    test = _compose()["services"]["retrieval"]["healthcheck"]["test"]
    copies = [shlex.split(a) for a in _instr("COPY")]
    shipped = {c[-1] for c in copies if c[0] == "deploy/docker/healthcheck.py"}
    assert test[:3] == ["CMD", "python", next(iter(shipped))]
    assert _port(test[test.index("--target") + 1]) == 50051


# --- Dockerfile --------------------------------------------------------------------------

def _exposed() -> list[int]:
    (expose,) = _instr("EXPOSE")
    return [int(p.split("/")[0]) for p in expose.split()]


def test_listen_port_agrees_everywhere() -> None:
    port = _exposed()[0]
    retrieval = _compose()["services"]["retrieval"]
    assert port == _port(_docker_env()["RETRIEVAL_LISTEN"])
    assert port == _port(_one("ConfigMap")["data"]["RETRIEVAL_LISTEN"])
    assert port == _port(_env(retrieval)["RETRIEVAL_LISTEN"])
    assert int(retrieval["ports"][0].rsplit(":", 1)[1]) == port
    assert _container()["ports"][0]["containerPort"] == port


def test_metrics_port_agrees_everywhere_and_is_scraped() -> None:
    """Every deploy serves /metrics on one port: image, compose, ConfigMap, pod, Service,
    and the pod's scrape annotations."""
    retrieval = _compose()["services"]["retrieval"]
    port = _port(_docker_env()["RETRIEVAL_METRICS_LISTEN"])
    assert _exposed() == [_port(_docker_env()["RETRIEVAL_LISTEN"]), port]
    assert port == _port(_one("ConfigMap")["data"]["RETRIEVAL_METRICS_LISTEN"])
    assert port == _port(_env(retrieval)["RETRIEVAL_METRICS_LISTEN"])
    # Published on the host's loopback only, like gRPC.
    assert [p.rsplit(":", 1)[1] for p in retrieval["ports"]] == [str(_port(_docker_env()["RETRIEVAL_LISTEN"])), str(port)]
    assert all(p.startswith("127.0.0.1:") for p in retrieval["ports"])
    pod_ports = {p["name"]: p["containerPort"] for p in _container()["ports"]}
    assert pod_ports["metrics"] == port
    notes = _one("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and int(notes["prometheus.io/port"]) == port
    assert notes["prometheus.io/path"] == "/metrics"


def test_dockerfile_serves_via_the_cli_with_env_settings() -> None:
    cmd = json.loads(_instr("CMD")[-1])  # exec form: python is PID 1 and gets SIGTERM
    assert cmd[:4] == ["python", "-m", "service", "serve"]
    # No flags: they would override the RETRIEVAL_* env that compose and k8s set.
    assert cmd[4:] == []
    for key in _docker_env():
        if key.startswith("RETRIEVAL_"):
            assert key[10:].lower() in CONFIG_FIELDS, key


def test_dockerfile_stages_and_baked_models() -> None:
    froms = _instr("FROM")
    assert len(froms) >= 2, "multi-stage"
    (arg,) = [a for a in _instr("ARG") if a.startswith("PYTHON_IMAGE=")]
    assert arg == "PYTHON_IMAGE=python:3.11-slim"
    runs = " ".join(_instr("RUN"))
    models_dir = _docker_env()["RETRIEVAL_MODELS_DIR"]
    assert models_dir == "/models"
    assert "pip install '.[models]'" in runs
    assert f"python -m service models build --out {models_dir}" in runs
    assert any(shlex.split(c)[-1] == models_dir for c in _instr("COPY") if c.startswith("--from="))
    (hc,) = _instr("HEALTHCHECK")
    assert json.loads(hc.split("CMD", 1)[1]) == ["python", "/app/healthcheck.py"]


def test_dockerfile_bakes_the_latin_script_embedder_from_its_carded_jar() -> None:
    """The image's model build finds the carded bge jar in ~/.m2 (the models stage has no
    Maven), so "auto" serves the Latin-script leg in a container as on `make run`."""
    card = json.loads((REPO / "service/offline/builder/artifacts/bge-small-en-v1.5-int8/card.json").read_text())
    runs = " ".join(_instr("RUN"))
    assert f"-Dartifact={card['source']['maven']}" in runs and "--no-bge" not in runs
    group = card["source"]["maven"].split(":")[0].replace(".", "/")
    assert any(c.startswith("--from=jars") and c.split()[-1] == f"/root/.m2/repository/{group}" for c in _instr("COPY"))


def test_dockerfile_copies_only_files_that_exist_and_reach_the_context() -> None:
    for args in _instr("COPY"):
        tokens = shlex.split(args)
        if any(t.startswith("--from=") for t in tokens):
            continue
        for src in [t for t in tokens if not t.startswith("--")][:-1]:
            assert (REPO / src).exists(), f"COPY {src}: not in the repository"
            assert not _dockerignored(src), f"COPY {src}: excluded by .dockerignore"


def test_dockerignore_keeps_local_state_out() -> None:
    for path in (".venv", "data", ".cache", ".git", "node_modules", ".pytest_cache"):
        assert _dockerignored(path), path
    for path in ("pyproject.toml", "service/config.py", "deploy/docker/healthcheck.py"):
        assert not _dockerignored(path), path


def test_pip_install_ships_every_service_package() -> None:
    """`pip install .` in the image packs only what setuptools finds; a folder without
    __init__.py would be left out of the image while every test here still passed."""
    setuptools = pytest.importorskip("setuptools")
    found = set(setuptools.find_packages(str(REPO), include=["service*"]))
    dirs = {p.parent.relative_to(REPO).as_posix().replace("/", ".") for p in (REPO / "service").rglob("*.py")}
    assert dirs <= found, sorted(dirs - found)


# --- healthcheck.py, for real ------------------------------------------------------------

@pytest.fixture
async def health_server() -> AsyncIterator[tuple[health.aio.HealthServicer, int]]:
    servicer = health.aio.HealthServicer()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, port
    finally:
        await server.stop(None)


async def _run_check(*args: str, env: dict[str, str] | None = None) -> int:
    # Async subprocess: the server under test shares this event loop and must keep serving.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(HEALTHCHECK), *args, env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    return await asyncio.wait_for(proc.wait(), timeout=30)


async def test_healthcheck_exits_0_on_serving_and_1_otherwise(
        health_server: tuple[health.aio.HealthServicer, int]) -> None:
    servicer, port = health_server
    target = f"127.0.0.1:{port}"
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert await _run_check("--target", target) == 0
    await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert await _run_check("--target", target) == 1
    # A service the server does not know answers NOT_FOUND: unhealthy, never a crash code.
    assert await _run_check("--target", target, "--service", "no.such.Service") == 1


async def test_healthcheck_follows_the_listen_port_from_the_environment(
        health_server: tuple[health.aio.HealthServicer, int]) -> None:
    servicer, port = health_server
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    env = {**os.environ, "RETRIEVAL_LISTEN": f"0.0.0.0:{port}"}
    assert await _run_check(env=env) == 0


async def test_healthcheck_exits_1_when_nothing_listens() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert await _run_check("--target", f"127.0.0.1:{port}", "--timeout", "1") == 1


def test_a_non_editable_install_carries_the_data_serving_and_models_build_need() -> None:
    """The Docker image installs the package (`pip install .`): every committed data file the
    plan rules, `models build` (reranker delta, card, calibrations) and eval read must be
    package data, or the image serves without a reranker and without the quality gate."""
    import subprocess

    root = Path(__file__).resolve().parents[3]
    package_data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    tracked = subprocess.run(["git", "ls-files", "service"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.split()
    needed = [f for f in tracked if f.endswith((".json", ".npz", ".toml"))
              and not f.endswith(("calibration_report.json",))  # a report for readers, not read by code
              and not f.startswith("service/offline/training/checkpoints/")]  # trained, not served: offline only
    assert needed, "no data files found"
    missing = []
    for f in needed:
        covered = False
        for package, patterns in package_data.items():
            prefix = package.replace(".", "/") + "/"
            if f.startswith(prefix) and any(fnmatch.fnmatch(f[len(prefix):], pat) for pat in patterns):
                covered = True
        if not covered:
            missing.append(f)
    assert not missing, f"not package data (pyproject [tool.setuptools.package-data]): {missing}"
