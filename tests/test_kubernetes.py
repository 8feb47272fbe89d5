"""The Kubernetes manifests (deploy/kubernetes) against the code: every DeepInfer container runs a
service the CLI has, with environment variables the code reads; workers are probed on the paths
their metrics port serves (/ready, /health); the engine workers and the kvindex share the storage
tier volume at DEEPINFER_KV_ROOT; the NATS seed list names the cluster's servers, and the streams
get as many replicas as there are servers. (No cluster here: the manifests are read, not applied.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from deepinfer.cli import SERVICES

ROOT = Path(__file__).resolve().parents[1]
DIR = ROOT / "deploy" / "kubernetes"


def docs() -> list[dict]:
    files = yaml.safe_load((DIR / "kustomization.yaml").read_text())["resources"]
    assert sorted(files) == sorted(p.name for p in DIR.glob("*.yaml") if p.name != "kustomization.yaml")
    return [d for f in files for d in yaml.safe_load_all((DIR / f).read_text()) if d]


def kind(k: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs() if d["kind"] == k}


def deepinfer_containers() -> dict[str, dict]:
    """Service role -> its container, over the DeepInfer deployments."""
    out = {}
    for d in kind("Deployment").values():
        for c in d["spec"]["template"]["spec"]["containers"]:
            if c["image"] == "deepinfer":
                out[c["args"][1]] = (d, c)
    return out


def env_of(c: dict) -> dict[str, str]:
    env = {}
    for ref in c.get("envFrom", []):
        env.update(kind("ConfigMap")[ref["configMapRef"]["name"]]["data"])
    env.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
    return env


def test_every_container_runs_a_cli_service_with_variables_the_code_reads():
    code = "\n".join(p.read_text() for p in [*ROOT.glob("libs/**/*.py"), *ROOT.glob("services/**/*.py")])
    roles = deepinfer_containers()
    assert set(roles) == {"gateway", "tokenizer", "kvindex", "balancer", "prefill", "decode"}
    for role, (_, c) in roles.items():
        assert c["args"][0] == "serve" and role in SERVICES
        for name in env_of(c):
            if name.startswith("DEEPINFER_"):
                assert re.search(rf"\b{name}\b", code), f"{role}: {name} is read nowhere"


def test_workers_are_probed_where_their_metrics_port_serves_probes():
    for role, (d, c) in deepinfer_containers().items():
        assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 30  # SIGTERM drains
        if role == "gateway":
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"
            continue
        port = int(env_of(c)["DEEPINFER_METRICS_PORT"])
        assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port}, role
        assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": port}, role


@pytest.mark.parametrize("role", ["prefill", "decode", "kvindex"])
def test_the_storage_tier_is_one_shared_volume(role):
    d, c = deepinfer_containers()[role]
    root = env_of(c)["DEEPINFER_KV_ROOT"]
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == root)
    volume = next(v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    claim = kind("PersistentVolumeClaim")[volume["persistentVolumeClaim"]["claimName"]]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # every pod, on any node


def test_the_nats_seed_list_names_the_cluster_and_streams_are_replicated_over_it():
    nats = kind("StatefulSet")["nats"]
    n = nats["spec"]["replicas"]
    svc = nats["spec"]["serviceName"]
    for role, (_, c) in deepinfer_containers().items():
        env = env_of(c)
        assert env["DEEPINFER_NATS_URL"].split(",") == [f"nats://nats-{i}.{svc}:4222" for i in range(n)], role
        assert int(env["DEEPINFER_STREAM_REPLICAS"]) == n
    conf = kind("ConfigMap")["nats-config"]["data"]["nats.conf"]
    assert "jetstream" in conf and all(f"nats://nats-{i}.{svc}:6222" in conf for i in range(n))


def test_several_kvindexes_and_several_gateways():
    assert deepinfer_containers()["kvindex"][0]["spec"]["replicas"] >= 2  # one leads, the others stand by
    assert deepinfer_containers()["gateway"][0]["spec"]["replicas"] >= 2
