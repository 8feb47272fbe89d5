"""deploy/k8s (the Kubernetes manifests) rendered and checked against the API schemas and the code,
without a cluster.

Each overlay (``overlays/disagg``, ``overlays/agg``) is rendered with ``kubectl kustomize`` (skipped
when kubectl is missing, failed instead when ``CI=true``) and checked. Every check is a function
returning a list of problems, so the same function validates the real render and, fed a mutated
copy, shows that it catches a realistic breakage (``test_check_catches``).

What is checked, on both overlays:

* schemas: every object of a built-in kind validates against that kind's schema for Kubernetes
  ``K8S_VERSION``, strictly (no unknown fields), offline with ``kubernetes-validate``; a kind
  without a built-in schema must be a known CRD (KEDA's ScaledObject, checked below);
* commands: every DeepInfer container runs the image's entrypoint with ``serve <service>``, a
  service the CLI has, and the service's own argument parser accepts every flag (the real
  ``deepinfer.cli.main`` runs up to the service's ``parse_args``, in the container's environment:
  its ConfigMaps and env); the overlay runs the services of its mode;
* environment: every DEEPINFER_* variable is read by a service's parser or by the code (grep);
* the gateway routes in the overlay's mode (its parsed ``--mode``);
* probes: workers' readiness is /ready and liveness /health on their parsed metrics port, paths
  the metrics server answers as probes (asked for real); the gateway's readiness is a route it has;
* drain: the grace period covers the preStop hook, the service's drain (``drain_timeout_s`` of its
  class, the NATS drain, uvicorn's graceful shutdown for the gateway);
* storage: every service with a ``--kv-root`` (the engine workers and the kvindex) mounts one
  ReadWriteMany claim there, whose storage class is the overlay's parameter;
* NATS: the seed list names every server of the StatefulSet, its routes too, JetStream is on, the
  streams get as many replicas as there are servers (3);
* Redis: the gateway's and kvindex's URL is a ``redis+sentinel://`` URL naming the 3 Sentinels and
  the master name they monitor; a master and a replica behind them;
* PodDisruptionBudgets select every component that runs (or may scale to) several replicas;
* KEDA ScaledObjects: scale an engine worker Deployment of the same render (which leaves its
  replicas to KEDA), with known fields and prometheus triggers (server address: the overlay's
  parameter; a query, a positive threshold) on metrics the code exports, for the role the target
  reports; every engine worker has one, on its signal (``SIGNALS``);
* scraping: every DeepInfer pod is annotated for Prometheus with the port its /metrics is on and
  carries the label a PodMonitor selects;
* the gateway and the kvindex run at least 2 replicas.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import io
import os
import re
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

from cli_args import ServiceArgs, parse_service

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("disagg", "agg")
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests target (the schemas they are checked against)
IN_CI = os.environ.get("CI", "").lower() == "true"
# The services each overlay runs (``deepinfer serve <service>``), and the engine workers among them
SERVICES = {"disagg": {"gateway", "tokenizer", "kvindex", "balancer", "prefill", "decode"},
            "agg": {"gateway", "tokenizer", "kvindex", "balancer", "worker"}}
ENGINE_WORKERS = {"disagg": {"prefill", "decode"}, "agg": {"worker"}}
# Custom resources the manifests may hold (no built-in schema), checked by hand
CRDS = {("keda.sh/v1alpha1", "ScaledObject")}
# The signals each engine worker scales on (metric names the code exports; its ScaledObject uses at
# least one): prefill its queued prompt compute, decode its waiting requests or KV usage, an
# aggregated worker any of them
SIGNALS = {"prefill": {"deepinfer_queued_prefill_seconds"},
           "decode": {"deepinfer_requests_waiting", "deepinfer_kv_cache_usage_ratio"},
           "worker": {"deepinfer_queued_prefill_seconds", "deepinfer_requests_waiting",
                      "deepinfer_kv_cache_usage_ratio"}}
# The fields of a KEDA ScaledObject's spec and of a trigger (keda.sh/v1alpha1)
SCALED_OBJECT_FIELDS = {"scaleTargetRef", "pollingInterval", "cooldownPeriod", "initialCooldownPeriod",
                        "idleReplicaCount", "minReplicaCount", "maxReplicaCount", "fallback", "advanced", "triggers"}
TRIGGER_FIELDS = {"type", "name", "metadata", "metricType", "useCachedMetrics", "authenticationRef"}
NATS_CLIENT_PORT, NATS_ROUTE_PORT, SENTINEL_PORT = 4222, 6222, 26379


def _need(ok: bool, reason: str) -> None:
    """Skip without ``ok``; in CI (CI=true) fail instead: there the tools must be installed."""
    if not ok:
        if IN_CI:
            pytest.fail(f"{reason} (CI=true: required)")
        pytest.skip(reason)


# ------------------------------------------------------------------------ rendering


@lru_cache(maxsize=None)
def _render(overlay: str) -> tuple:
    kubectl = shutil.which("kubectl")
    _need(kubectl is not None, "kubectl is not installed: the overlays cannot be rendered (kubectl kustomize)")
    r = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, f"kubectl kustomize overlays/{overlay}:\n{r.stderr}"
    return tuple(d for d in yaml.safe_load_all(r.stdout) if d)


def render(overlay: str) -> list[dict]:
    """The rendered objects of an overlay (a fresh copy: checks and mutations may change it)."""
    return copy.deepcopy(list(_render(overlay)))


def parameters(overlay: str) -> dict[str, str]:
    return yaml.safe_load((K8S / "overlays" / overlay / "parameters.yaml").read_text())["data"]


def objects(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def workloads(objs: list[dict]) -> dict[str, dict]:
    return {**objects(objs, "Deployment"), **objects(objs, "StatefulSet")}


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def is_deepinfer(container: dict) -> bool:
    """A container of the DeepInfer image, wherever it is pulled from (``<registry>/deepinfer:<tag>``)."""
    return container["image"].rsplit("/", 1)[-1].split(":")[0].split("@")[0] == "deepinfer"


def deepinfer_containers(objs: list[dict]) -> list[tuple[dict, dict]]:
    """(workload, container) of every DeepInfer container."""
    return [(w, c) for w in workloads(objs).values() for c in pod_spec(w)["containers"] if is_deepinfer(c)]


def container_env(objs: list[dict], c: dict) -> dict[str, str]:
    """The container's environment: its ConfigMaps (envFrom), then its env (literal values and
    ConfigMap keys). A ConfigMap or key that is not in the render is left out (the schema and
    command checks report what that breaks)."""
    maps = objects(objs, "ConfigMap")
    env: dict[str, str] = {}
    for ref in c.get("envFrom", []):
        if "configMapRef" in ref:
            env.update(maps.get(ref["configMapRef"]["name"], {}).get("data", {}))
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "configMapKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["configMapKeyRef"]
            if ref["key"] in maps.get(ref["name"], {}).get("data", {}):
                env[e["name"]] = maps[ref["name"]]["data"][ref["key"]]
    return env


# ----------------------------------------------------------------- service parsing


def service_args(objs: list[dict], c: dict) -> ServiceArgs:
    if c.get("command"):  # the image's entrypoint is `deepinfer` (compose/Dockerfile)
        return ServiceArgs(None, None, set(),
                           f"{c['name']}: command {c['command']} replaces the `deepinfer` entrypoint")
    return parse_service(tuple(c.get("args", [])), tuple(sorted(container_env(objs, c).items())))


def parsed_containers(objs: list[dict]) -> list[tuple[dict, dict, ServiceArgs]]:
    """(workload, container, parse) of every DeepInfer container that parses."""
    out = []
    for w, c in deepinfer_containers(objs):
        p = service_args(objs, c)
        if p.error is None:
            out.append((w, c, p))
    return out


def service_class(service: str):
    """The ``mesh.Service`` subclass ``deepinfer serve <service>`` runs (None for the gateway)."""
    from deepinfer import cli
    from deepinfer.mesh import Service

    module = importlib.import_module(f"deepinfer.{cli.ALIASES.get(service, service)}.service")
    classes = [c for _, c in inspect.getmembers(module, inspect.isclass)
               if issubclass(c, Service) and c.__module__ == module.__name__]
    return classes[0] if classes else None


@lru_cache(maxsize=None)
def source_text() -> str:
    return "\n".join(p.read_text() for d in ("libs", "services") for p in sorted((ROOT / d).rglob("*.py")))


def code_reads_env(name: str) -> bool:
    return re.search(rf"""["']{re.escape(name)}["']""", source_text()) is not None


@lru_cache(maxsize=None)
def exported_metric_names() -> frozenset[str]:
    """Metric names the code defines (string literals starting with ``deepinfer_``)."""
    return frozenset(re.findall(r"""["'](deepinfer_[a-z0-9_]+)["']""", source_text()))


def code_int(path: str, pattern: str) -> int:
    """An integer the code sets, found by ``pattern`` (one group) in ``path``."""
    m = re.search(pattern, (ROOT / path).read_text())
    assert m, f"{pattern!r} not found in {path}: the test follows the code, update it"
    return int(m.group(1))


@lru_cache(maxsize=None)
def served_probe_paths() -> frozenset[str]:
    """The paths a worker's metrics server answers as probes (a JSON body from ``probes``), asked
    for real: ``telemetry.metrics.start_metrics_server`` on a free port, with a stand-in probe."""
    from prometheus_client import CollectorRegistry

    from deepinfer.launcher import free_port
    from deepinfer.telemetry import metrics

    asked: list[str] = []

    def probes(path):
        asked.append(path)
        return True, {"probe": path}

    port = free_port()
    server = metrics.start_metrics_server(port, addr="127.0.0.1", registry=CollectorRegistry(), probes=probes)
    served = set()
    try:
        for path in ("/health", "/ready", "/healthz", "/readyz", "/live", "/livez"):
            asked.clear()
            with contextlib.suppress(urllib.error.URLError):
                urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).read()
            if asked == [path]:
                served.add(path)
    finally:
        server.shutdown()
        threading.Thread(target=server.server_close, daemon=True).start()
    return frozenset(served)


def gateway_routes() -> set[str]:
    return set(re.findall(r"""@app\.get\(["']([^"']+)["']""", (ROOT / "services/gateway/app.py").read_text()))


def prestop_seconds(c: dict) -> int:
    """Seconds a container's preStop hook holds off SIGTERM: ``sleep N`` (exec or the sleep action)."""
    hook = c.get("lifecycle", {}).get("preStop", {})
    if "sleep" in hook:
        return int(hook["sleep"]["seconds"])
    words = " ".join(hook.get("exec", {}).get("command", []))
    return sum(int(n) for n in re.findall(r"\bsleep\s+(\d+)", words))


def probe_port(c: dict, port) -> int | None:
    """A probe's port as a number (a named port resolved through the container's ports)."""
    if isinstance(port, int):
        return port
    return next((p["containerPort"] for p in c.get("ports", []) if p.get("name") == port), None)


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector.get("matchLabels")) and all(labels.get(k) == v for k, v in selector["matchLabels"].items())


# --------------------------------------------------------------------------- checks


def check_schemas(objs: list[dict]) -> list[str]:
    try:
        import kubernetes_validate
    except ImportError:
        kubernetes_validate = None
    _need(kubernetes_validate is not None, "kubernetes-validate is not installed (the `test` extra)")
    problems = []
    for o in objs:
        name = f"{o.get('kind')}/{o.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            if (o.get("apiVersion"), o.get("kind")) not in CRDS:
                problems.append(f"{name}: no schema for {o.get('apiVersion')} {o.get('kind')} in Kubernetes "
                                f"{K8S_VERSION}, and not a known CRD")
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(p) for p in e.absolute_path)
            problems.append(f"{name}: {where}: {e.message}")
    return problems


def check_commands(objs: list[dict], mode: str) -> list[str]:
    problems, served = [], set()
    for w, c in deepinfer_containers(objs):
        p = service_args(objs, c)
        if p.error:
            problems.append(f"{w['metadata']['name']}: {p.error}")
        if p.service is not None:
            served.add(p.service)
    if served != SERVICES[mode]:
        problems.append(f"the {mode} overlay runs {sorted(served)}, not {sorted(SERVICES[mode])}")
    return problems


def check_environment(objs: list[dict]) -> list[str]:
    problems = []
    parsed = parsed_containers(objs)
    parser_vars = {v for _, _, p in parsed for v in p.env_read}
    for w, c, _ in parsed:
        for var in container_env(objs, c):
            if var.startswith("DEEPINFER_") and var not in parser_vars and not code_reads_env(var):
                problems.append(f"{w['metadata']['name']}: {var} is read nowhere in the code")
    return problems


def check_gateway_mode(objs: list[dict], mode: str) -> list[str]:
    modes = [p.get("mode") for _, _, p in parsed_containers(objs) if p.service == "gateway"]
    return [] if modes and all(m == mode for m in modes) else [f"the gateway routes in mode {modes}, not {mode}"]


def check_probes(objs: list[dict]) -> list[str]:
    problems = []
    served = served_probe_paths()
    for w, c, p in parsed_containers(objs):
        name = w["metadata"]["name"]
        if p.service == "gateway":
            get = c.get("readinessProbe", {}).get("httpGet", {})
            if get.get("path") not in gateway_routes() or probe_port(c, get.get("port")) != p.get("port"):
                problems.append(f"{name}: readiness {get} is not a route of the gateway on its --port {p.get('port')}")
            continue
        port = p.get("metrics_port")
        if not port:
            problems.append(f"{name}: no metrics port (DEEPINFER_METRICS_PORT / --metrics-port): nothing to probe")
            continue
        if port not in {cp["containerPort"] for cp in c.get("ports", [])}:
            problems.append(f"{name}: the metrics port {port} is not among the container's ports")
        for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/health"), ("startupProbe", None)):
            get = c.get(probe, {}).get("httpGet")
            if get is None:
                if probe != "startupProbe":
                    problems.append(f"{name}: no HTTP {probe}")
                continue
            if path is not None and get.get("path") != path:
                problems.append(f"{name}: {probe} on {get.get('path')}, not {path}")
            if get.get("path") not in served:
                problems.append(f"{name}: {probe} on {get.get('path')}, which the metrics server does not answer "
                                f"(it answers {sorted(served)})")
            if probe_port(c, get.get("port")) != port:
                problems.append(f"{name}: {probe} on port {get.get('port')}, not the metrics port {port}")
    return problems


def check_drain(objs: list[dict]) -> list[str]:
    """The grace period covers the preStop hook and the drain that SIGTERM starts."""
    nats_drain = code_int("libs/mesh/service.py", r"wait_for\(self\.mesh\.drain\(\), timeout=(\d+)")
    uvicorn_drain = code_int("services/gateway/service.py", r"timeout_graceful_shutdown=(\d+)")
    problems = []
    for w, c, p in parsed_containers(objs):
        if p.service == "gateway":
            drain = uvicorn_drain + nats_drain
        else:
            drain = getattr(service_class(p.service), "drain_timeout_s", 0) + nats_drain
        need = prestop_seconds(c) + drain
        grace = pod_spec(w).get("terminationGracePeriodSeconds", 30)
        if grace < need:
            problems.append(f"{w['metadata']['name']}: terminationGracePeriodSeconds {grace} < preStop "
                            f"{prestop_seconds(c)} s + drain {drain:g} s")
    return problems


def check_storage(objs: list[dict], mode: str, storage_class: str) -> list[str]:
    """Every service with a --kv-root mounts the one ReadWriteMany claim there."""
    problems, claims, mounted = [], set(), set()
    pvcs = objects(objs, "PersistentVolumeClaim")
    for w, c, p in parsed_containers(objs):
        root = p.get("kv_root")
        if root is None:
            continue
        name = w["metadata"]["name"]
        mounted.add(p.service)
        mount = next((m for m in c.get("volumeMounts", []) if m["mountPath"].rstrip("/") == root.rstrip("/")), None)
        if mount is None:
            problems.append(f"{name}: nothing mounted at its --kv-root {root} (DEEPINFER_KV_ROOT)")
            continue
        volume = next((v for v in pod_spec(w).get("volumes", []) if v["name"] == mount["name"]), {})
        claim = volume.get("persistentVolumeClaim", {}).get("claimName")
        if claim not in pvcs:
            problems.append(f"{name}: {root} is not a PersistentVolumeClaim of the render ({volume})")
            continue
        claims.add(claim)
    for claim in claims:
        spec = pvcs[claim]["spec"]
        if spec.get("accessModes") != ["ReadWriteMany"]:
            problems.append(f"claim {claim}: accessModes {spec.get('accessModes')}: every pod, on any node, needs "
                            "ReadWriteMany")
        if spec.get("storageClassName") != storage_class:
            problems.append(f"claim {claim}: storage class {spec.get('storageClassName')!r}, not the parameter's "
                            f"{storage_class!r}")
    if len(claims) > 1:
        problems.append(f"the storage tier is split over claims {sorted(claims)}")
    missing = ({"kvindex"} | ENGINE_WORKERS[mode]) - mounted
    if missing:
        problems.append(f"{sorted(missing)}: no --kv-root (the storage tier)")
    return problems


def check_nats(objs: list[dict]) -> list[str]:
    problems = []
    nats = workloads(objs).get("nats")
    if nats is None or nats["kind"] != "StatefulSet":
        return ["no nats StatefulSet"]
    n, svc = nats["spec"]["replicas"], nats["spec"]["serviceName"]
    if n != 3:
        problems.append(f"NATS runs {n} servers, not 3")
    headless = objects(objs, "Service").get(svc, {}).get("spec", {})
    if headless.get("clusterIP") != "None" or not headless.get("publishNotReadyAddresses"):
        problems.append(f"Service {svc}: not headless with publishNotReadyAddresses (servers find each other by "
                        "name before they are ready)")
    seeds = [f"nats://nats-{i}.{svc}:{NATS_CLIENT_PORT}" for i in range(n)]
    for w, c, p in parsed_containers(objs):
        name = w["metadata"]["name"]
        if p.get("nats", "").split(",") != seeds:
            problems.append(f"{name}: NATS URL {p.get('nats')!r}, not the seed list {','.join(seeds)}")
        replicas = container_env(objs, c).get("DEEPINFER_STREAM_REPLICAS")
        if replicas != str(n):
            problems.append(f"{name}: DEEPINFER_STREAM_REPLICAS={replicas}, not {n} (one per server)")
    conf = "\n".join(m.get("data", {}).get("nats.conf", "") for m in objects(objs, "ConfigMap").values())
    if "jetstream" not in conf:
        problems.append("nats.conf: JetStream is off")
    for i in range(n):
        if f"nats://nats-{i}.{svc}:{NATS_ROUTE_PORT}" not in conf:
            problems.append(f"nats.conf: no route to nats-{i}.{svc}")
    return problems


def check_redis(objs: list[dict]) -> list[str]:
    from deepinfer.kvstore.redis_client import SENTINEL_SCHEME, parse_sentinel_url

    problems = []
    sets = workloads(objs)
    sentinel, redis = sets.get("sentinel"), sets.get("redis")
    if sentinel is None or redis is None:
        return ["no redis and sentinel StatefulSets"]
    n, svc = sentinel["spec"]["replicas"], sentinel["spec"]["serviceName"]
    if n != 3:
        problems.append(f"{n} Sentinels, not 3")
    if redis["spec"]["replicas"] < 2:
        problems.append("no Redis replica to fail over to")
    master = {e["name"]: e.get("value") for e in pod_spec(sentinel)["containers"][0].get("env", [])}.get("MASTER_NAME")
    sentinels = tuple((f"sentinel-{i}.{svc}", SENTINEL_PORT) for i in range(n))
    urls = {p.service: p.get("redis") or p.get("redis_url") for _, _, p in parsed_containers(objs)
            if p.service in ("gateway", "kvindex")}
    if set(urls) != {"gateway", "kvindex"}:
        problems.append(f"gateway and kvindex not both deployed ({sorted(urls)})")
    for service, url in urls.items():
        if not (url or "").startswith(SENTINEL_SCHEME + "://"):
            problems.append(f"{service}: Redis URL {url!r} is not a {SENTINEL_SCHEME}:// URL")
            continue
        u = parse_sentinel_url(url)
        if u.sentinels != sentinels or u.service != master:
            problems.append(f"{service}: {url} does not name the Sentinels {sentinels} and their master {master!r}")
    return problems


def check_disruption_budgets(objs: list[dict]) -> list[str]:
    """Every component with several replicas (or a ScaledObject that may give it several) has a PDB."""
    scaled = {s["spec"]["scaleTargetRef"]["name"]: s["spec"].get("maxReplicaCount", 100)
              for s in objects(objs, "ScaledObject").values()}
    pdbs = objects(objs, "PodDisruptionBudget").values()
    problems = []
    for name, w in workloads(objs).items():
        if max(w["spec"].get("replicas", 1), scaled.get(name, 1)) < 2:
            continue
        labels = w["spec"]["template"]["metadata"].get("labels", {})
        if not any(selects(b["spec"].get("selector", {}), labels) for b in pdbs):
            problems.append(f"{w['kind']}/{name}: several replicas and no PodDisruptionBudget")
    return problems


def check_scaled_objects(objs: list[dict], mode: str, prometheus: str) -> list[str]:
    problems = []
    deployments = objects(objs, "Deployment")
    exported = exported_metric_names()
    engine = {p.service: (w["metadata"]["name"], p) for w, _, p in parsed_containers(objs)
              if p.service in ENGINE_WORKERS[mode]}
    targets = {name: service for service, (name, _) in engine.items()}
    covered = set()
    for so in objects(objs, "ScaledObject").values():
        name, spec = so["metadata"]["name"], so.get("spec", {})
        if so["apiVersion"] != "keda.sh/v1alpha1":
            problems.append(f"ScaledObject/{name}: apiVersion {so['apiVersion']}")
        for key in sorted(set(spec) - SCALED_OBJECT_FIELDS):
            problems.append(f"ScaledObject/{name}: spec.{key} is not a ScaledObject field")
        ref = spec.get("scaleTargetRef", {})
        target = ref.get("name")
        if target not in deployments or ref.get("kind", "Deployment") != "Deployment" or \
                ref.get("apiVersion", "apps/v1") != "apps/v1":
            problems.append(f"ScaledObject/{name}: scaleTargetRef {ref} is not a Deployment of this render")
            continue
        if target not in targets:
            problems.append(f"ScaledObject/{name}: scales {target}, not an engine worker")
            continue
        service = targets[target]
        role = service_class(service).role
        lo, hi = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            problems.append(f"ScaledObject/{name}: replicas {lo}..{hi} (at least one worker must stay)")
        if "replicas" in deployments[target]["spec"]:
            problems.append(f"Deployment/{target}: sets replicas, which KEDA owns (an apply would reset them)")
        triggers = spec.get("triggers") or []
        if not triggers:
            problems.append(f"ScaledObject/{name}: no triggers")
        metrics_used = set()
        for i, t in enumerate(triggers):
            meta = t.get("metadata", {})
            for key in sorted(set(t) - TRIGGER_FIELDS):
                problems.append(f"ScaledObject/{name}: trigger {i} has {key!r}, not a trigger field")
            if t.get("type") != "prometheus":
                problems.append(f"ScaledObject/{name}: trigger {i} is {t.get('type')!r}, not prometheus")
                continue
            if meta.get("serverAddress") != prometheus:
                problems.append(f"ScaledObject/{name}: trigger {i} asks {meta.get('serverAddress')!r}, not the "
                                f"parameter's {prometheus!r}")
            try:
                if float(meta.get("threshold")) <= 0:
                    raise ValueError
            except (TypeError, ValueError):
                problems.append(f"ScaledObject/{name}: trigger {i} threshold {meta.get('threshold')!r} is not a "
                                "positive number (a string)")
            query = meta.get("query") or ""
            names = set(re.findall(r"\b(deepinfer_[a-z0-9_]+)", query))
            if not names:
                problems.append(f"ScaledObject/{name}: trigger {i} query {query!r} reads no DeepInfer metric")
            for metric in sorted(names - exported):
                problems.append(f"ScaledObject/{name}: {metric} is not a metric the code exports")
            roles = set(re.findall(r"""\brole\s*=\s*["']([^"']+)["']""", query))
            if roles != {role}:
                problems.append(f"ScaledObject/{name}: query selects role(s) {sorted(roles)}, not {role!r} "
                                f"(what `serve {service}` reports)")
            metrics_used |= names - {"deepinfer_service_info"}
        if not SIGNALS[service] & metrics_used:
            problems.append(f"ScaledObject/{name}: {service} scales on {sorted(metrics_used)}, none of "
                            f"{sorted(SIGNALS[service])}")
        covered.add(service)
    for service in sorted(set(engine) - covered):
        problems.append(f"{engine[service][0]}: no ScaledObject")
    return problems


def check_scraping(objs: list[dict]) -> list[str]:
    """Prometheus finds every DeepInfer pod's metrics: the prometheus.io annotations name the port
    its /metrics is on (the metrics port; the gateway's HTTP port), and the part-of label a
    PodMonitor selects is on every pod."""
    problems = []
    for w, _, p in parsed_containers(objs):
        meta = w["spec"]["template"]["metadata"]
        port = p.get("port") if p.service == "gateway" else p.get("metrics_port")
        notes = meta.get("annotations", {})
        if notes.get("prometheus.io/scrape") != "true" or notes.get("prometheus.io/port") != str(port):
            problems.append(f"{w['metadata']['name']}: prometheus.io annotations {notes} do not name port {port}")
        if meta.get("labels", {}).get("app.kubernetes.io/part-of") != "deepinfer":
            problems.append(f"{w['metadata']['name']}: pods without the app.kubernetes.io/part-of label")
    return problems


def check_replicas(objs: list[dict]) -> list[str]:
    problems = []
    for w, _, p in parsed_containers(objs):
        if p.service in ("kvindex", "gateway") and w["spec"].get("replicas", 1) < 2:
            problems.append(f"{w['metadata']['name']}: one replica (kvindex: one leads, another stands by; "
                            "gateways: the Service spreads clients)")
    return problems


def run_check(check: str, objs: list[dict], mode: str) -> list[str]:
    p = parameters(mode)
    return {
        "schemas": lambda: check_schemas(objs),
        "commands": lambda: check_commands(objs, mode),
        "environment": lambda: check_environment(objs),
        "gateway_mode": lambda: check_gateway_mode(objs, mode),
        "probes": lambda: check_probes(objs),
        "drain": lambda: check_drain(objs),
        "storage": lambda: check_storage(objs, mode, p["storageClassName"]),
        "nats": lambda: check_nats(objs),
        "redis": lambda: check_redis(objs),
        "disruption_budgets": lambda: check_disruption_budgets(objs),
        "scaled_objects": lambda: check_scaled_objects(objs, mode, p["prometheusAddress"]),
        "scraping": lambda: check_scraping(objs),
        "replicas": lambda: check_replicas(objs),
    }[check]()


CHECKS = ("schemas", "commands", "environment", "gateway_mode", "probes", "drain", "storage", "nats", "redis",
          "disruption_budgets", "scaled_objects", "scraping", "replicas")


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("mode", OVERLAYS)
@pytest.mark.parametrize("check", CHECKS)
def test_overlay(check, mode):
    assert run_check(check, render(mode), mode) == []


def test_probe_paths_are_the_served_ones():
    assert served_probe_paths() >= {"/health", "/ready"}  # the asking works: it finds the probes


def test_parameters_reach_the_render():
    """The storage class and Prometheus address come from the overlay's parameters.yaml, which is
    itself left out of the render."""
    for mode in OVERLAYS:
        objs = render(mode)
        assert "deepinfer-parameters" not in objects(objs, "ConfigMap")
        assert {o["spec"]["storageClassName"] for o in objects(objs, "PersistentVolumeClaim").values()} == \
               {parameters(mode)["storageClassName"]}


# --- each check catches a breakage: (check, overlay, mutation of the rendered objects)


def _container(objs, workload, i=0):
    return pod_spec(workloads(objs)[workload])["containers"][i]


def _env_map(objs):
    return next(m for n, m in objects(objs, "ConfigMap").items() if n.startswith("deepinfer-env"))


def _drop(objs, kind, name):
    objs[:] = [o for o in objs if not (o["kind"] == kind and o["metadata"]["name"] == name)]


def _so(objs, name):
    return objects(objs, "ScaledObject")[name]


BREAKAGES = {
    "unknown field": ("schemas", "disagg", lambda o: _container(o, "deepinfer-decode").update(readynessProbe={})),
    "port as text": ("schemas", "agg", lambda o: _container(o, "deepinfer-worker")["ports"][0].update(
        containerPort="9400")),
    "unknown kind": ("schemas", "agg", lambda o: o.append({"apiVersion": "example.com/v1", "kind": "Thing",
                                                           "metadata": {"name": "x"}})),
    "misspelled flag": ("commands", "disagg", lambda o: _container(o, "deepinfer-gateway")["args"].append(
        "--prefil-router")),
    "flag of another service": ("commands", "agg", lambda o: _container(o, "deepinfer-tokenizer")["args"].extend(
        ["--kv-root", "/kvstore"])),
    "bad flag value": ("commands", "disagg", lambda o: _container(o, "deepinfer-kvindex")["args"].extend(
        ["--leader-lease", "soon"])),
    "unknown service": ("commands", "disagg", lambda o: _container(o, "deepinfer-prefill")["args"].__setitem__(
        1, "prefil")),
    "entrypoint replaced": ("commands", "agg", lambda o: _container(o, "deepinfer-worker").update(
        command=["python", "-m", "deepinfer.cli"])),
    "a worker missing": ("commands", "agg", lambda o: _drop(o, "Deployment", "deepinfer-worker")),
    "misspelled variable": ("environment", "disagg", lambda o: _env_map(o)["data"].update(
        DEEPINFER_KV_ROTO="/kvstore")),
    "gateway in the wrong mode": ("gateway_mode", "agg", lambda o: _env_map(o)["data"].update(
        DEEPINFER_MODE="disagg")),
    "readiness on /readyz": ("probes", "disagg", lambda o: _container(o, "deepinfer-decode")["readinessProbe"][
        "httpGet"].update(path="/readyz")),
    "liveness on the wrong port": ("probes", "agg", lambda o: _container(o, "deepinfer-kvindex")["livenessProbe"][
        "httpGet"].update(port=9401)),
    "startup on /healthz": ("probes", "agg", lambda o: _container(o, "deepinfer-worker")["startupProbe"][
        "httpGet"].update(path="/healthz")),
    "gateway ready on a missing route": ("probes", "disagg", lambda o: _container(o, "deepinfer-gateway")[
        "readinessProbe"]["httpGet"].update(path="/ready")),
    "grace shorter than the drain": ("drain", "disagg", lambda o: pod_spec(workloads(o)["deepinfer-decode"]).update(
        terminationGracePeriodSeconds=30)),
    "preStop eats the grace": ("drain", "disagg", lambda o: _container(o, "deepinfer-gateway")["lifecycle"][
        "preStop"].update(exec={"command": ["sleep", "20"]})),
    "tier mounted elsewhere": ("storage", "agg", lambda o: _container(o, "deepinfer-worker")["volumeMounts"][0].update(
        mountPath="/kv")),
    "tier on an emptyDir": ("storage", "disagg", lambda o: pod_spec(workloads(o)["deepinfer-kvindex"]).update(
        volumes=[{"name": "kvstore", "emptyDir": {}}])),
    "tier ReadWriteOnce": ("storage", "disagg", lambda o: objects(o, "PersistentVolumeClaim")["deepinfer-kvstore"][
        "spec"].update(accessModes=["ReadWriteOnce"])),
    "tier on another class": ("storage", "agg", lambda o: objects(o, "PersistentVolumeClaim")["deepinfer-kvstore"][
        "spec"].update(storageClassName="standard")),
    "seed list short of a server": ("nats", "disagg", lambda o: _env_map(o)["data"].update(
        DEEPINFER_NATS_URL="nats://nats-0.nats:4222,nats://nats-1.nats:4222")),
    "streams on one replica": ("nats", "agg", lambda o: _env_map(o)["data"].update(DEEPINFER_STREAM_REPLICAS="1")),
    "a route missing": ("nats", "agg", lambda o: objects(o, "ConfigMap")["nats-config"]["data"].update(
        {"nats.conf": objects(o, "ConfigMap")["nats-config"]["data"]["nats.conf"].replace(
            "nats://nats-2.nats:6222", "")})),
    "one Redis server": ("redis", "disagg", lambda o: _env_map(o)["data"].update(
        DEEPINFER_REDIS_URL="redis://redis-0.redis:6379")),
    "two Sentinels named": ("redis", "agg", lambda o: _env_map(o)["data"].update(
        DEEPINFER_REDIS_URL="redis+sentinel://sentinel-0.sentinel:26379,sentinel-1.sentinel:26379/deepinfer")),
    "another master name": ("redis", "disagg", lambda o: _env_map(o)["data"].update(
        DEEPINFER_REDIS_URL="redis+sentinel://sentinel-0.sentinel:26379,sentinel-1.sentinel:26379,"
                            "sentinel-2.sentinel:26379/mymaster")),
    "no PDB for the kvindex": ("disruption_budgets", "disagg", lambda o: _drop(o, "PodDisruptionBudget",
                                                                               "deepinfer-kvindex")),
    "no PDB for a scaled worker": ("disruption_budgets", "agg", lambda o: _drop(o, "PodDisruptionBudget",
                                                                                "deepinfer-worker")),
    "target renamed": ("scaled_objects", "disagg", lambda o: _so(o, "deepinfer-prefill")["spec"][
        "scaleTargetRef"].update(name="deepinfer-prefil")),
    "metric renamed": ("scaled_objects", "agg", lambda o: _so(o, "deepinfer-worker")["spec"]["triggers"][0][
        "metadata"].update(query='sum(deepinfer_queued_prefil_seconds * on(instance) group_left '
                                 'deepinfer_service_info{role="decode"})')),
    "wrong role": ("scaled_objects", "disagg", lambda o: _so(o, "deepinfer-prefill")["spec"]["triggers"][0][
        "metadata"].update(query='sum(deepinfer_queued_prefill_seconds * on(instance) group_left '
                                 'deepinfer_service_info{role="decode"})')),
    "decode on the wrong signal": ("scaled_objects", "disagg", lambda o: _so(o, "deepinfer-decode")["spec"].update(
        triggers=[{"type": "prometheus", "metadata": {
            "serverAddress": parameters("disagg")["prometheusAddress"], "threshold": "2",
            "query": 'sum(deepinfer_queued_prefill_seconds * on(instance) group_left '
                     'deepinfer_service_info{role="decode"})'}}])),
    "another Prometheus": ("scaled_objects", "agg", lambda o: _so(o, "deepinfer-worker")["spec"]["triggers"][1][
        "metadata"].update(serverAddress="http://localhost:9090")),
    "threshold not a number": ("scaled_objects", "agg", lambda o: _so(o, "deepinfer-worker")["spec"]["triggers"][2][
        "metadata"].update(threshold="high")),
    "a worker without autoscaling": ("scaled_objects", "disagg", lambda o: _drop(o, "ScaledObject",
                                                                                 "deepinfer-decode")),
    "misspelled ScaledObject field": ("scaled_objects", "disagg", lambda o: _so(o, "deepinfer-decode")["spec"].update(
        maxReplicas=4)),
    "replicas fixed beside KEDA": ("scaled_objects", "agg", lambda o: workloads(o)["deepinfer-worker"]["spec"].update(
        replicas=2)),
    "scraped on the wrong port": ("scraping", "disagg", lambda o: workloads(o)["deepinfer-prefill"]["spec"][
        "template"]["metadata"]["annotations"].update({"prometheus.io/port": "8000"})),
    "one kvindex": ("replicas", "disagg", lambda o: workloads(o)["deepinfer-kvindex"]["spec"].update(replicas=1)),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_check_catches(breakage):
    check, mode, mutate = BREAKAGES[breakage]
    objs = render(mode)
    assert run_check(check, objs, mode) == [], "the check fails on the real render already"
    mutate(objs)
    assert run_check(check, objs, mode), f"{check} does not catch: {breakage}"
