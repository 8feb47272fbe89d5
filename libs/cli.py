"""The ``deepinfer`` command.

    deepinfer up [--model PATH] [--port 8000] [--mode agg|disagg] [--workers N] [--tokenizer N] [--prefill N] [--decode N]
                [--gateways N] [--batch-invariant]
        start nats-server, redis-server and every service; Ctrl-C stops them all
    deepinfer serve <service> [args...]
        run one service in this process (operators / the launcher); it reads
        DEEPINFER_NATS_URL, DEEPINFER_REDIS_URL, DEEPINFER_MODEL, DEEPINFER_KV_ROOT
    deepinfer status [--nats URL]
        list the live workers of a running mesh (from their load reports) and their load
    deepinfer convert
        convert the embedded default model (once) and print its directory
    deepinfer bench serve | compare | replay | soak [args...]
        serving benchmarks of any OpenAI-compatible endpoint (docs/benchmarks.md)
    deepinfer economics [args...]
        revenue, margin, payback and cache storage of a day of traffic
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import time

SERVICES = ("gateway", "tokenizer", "prefill", "decode", "worker", "vision", "kvindex", "balancer")
# another name of a service: an aggregated-serving worker is a decode worker (it prefills what it gets)
ALIASES = {"worker": "decode"}
# the serving mode `deepinfer up` starts by default: the faster one on a 2-core machine
# (benchmarks/bench_peers.py; docs/benchmarks.md)
DEFAULT_MODE = "disagg"
# Services a mesh runs only for some models: vision workers for vision-language models (config.json
# with a vision_config); `deepinfer up` starts one for those, a text-only deployment needs none.
MULTIMODAL_ONLY = ("vision",)


def _say(msg: str) -> None:
    print(f"[deepinfer] {msg}", flush=True)


# ------------------------------------------------------------------------ serve


def cmd_serve(service: str, argv: list[str]) -> int:
    service = ALIASES.get(service, service)
    module_name = f"deepinfer.{service}.service"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name not in (module_name, f"deepinfer.{service}"):
            raise  # the service exists but one of its imports is missing
        print(f"deepinfer: no service {service!r} (no module {module_name})", file=sys.stderr)
        return 2
    main = getattr(module, "main", None)
    if main is None:
        print(f"deepinfer: {module_name} has no main(argv)", file=sys.stderr)
        return 2
    rc = int(main(argv) or 0)
    if sys.argv[1:2] == ["serve"]:
        # this process is the service (`deepinfer serve ...`), stopped and flushed (NATS drained,
        # spans exported): exit without the interpreter's teardown of torch and the other modules,
        # ~0.3-0.5 s of CPU per process on every stop of a mesh
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


# --------------------------------------------------------------------------- up


def _served_model(url: str) -> str | None:
    """The model id the gateway serves (``GET /v1/models``), or None if it can't say."""
    import httpx

    try:
        return httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
    except Exception:
        return None


class _Stop(Exception):
    """Raised in the main thread by SIGTERM / SIGINT while `up` runs."""


def cmd_up(args: argparse.Namespace) -> int:
    from deepinfer.launcher import LauncherError, Mesh, free_port, port_is_free

    port = args.port
    if port is None:
        port = 8000 if port_is_free(8000) else free_port()
    agg = args.mode == "agg"
    replicas = {"tokenizer": args.tokenizer, "prefill": args.prefill, "decode": args.workers if agg else args.decode,
                "gateway": args.gateways}
    extra = {"decode": ["--speculative", args.speculative]} if args.speculative != "none" else {}
    if args.batch_invariant:  # every engine worker: a prefill and a decode worker must agree bit for bit
        for role in ("prefill", "decode"):
            extra[role] = [*extra.get(role, []), "--batch-invariant"]
    mesh = Mesh(model=args.model, gateway_port=port, replicas=replicas, workdir=args.workdir, extra_args=extra,
                mode=args.mode)
    _say(f"serving mode: {args.mode} (" + ("workers that prefill and decode, `deepinfer serve worker`"
                                             if agg else "prefill workers hand off to decode workers")
         + ("; the default, measured the faster on a 2-core machine: docs/benchmarks.md" if args.mode == DEFAULT_MODE
            else "") + ")")

    def on_signal(signum, _frame):
        raise _Stop(signal.Signals(signum).name)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    rc = 0
    try:
        mesh.start(timeout=args.timeout, progress=_say)
        url = mesh.gateway_url
        model_id = _served_model(url)
        model_field = f'\"model\": \"{model_id}\", ' if model_id else ""
        print(
            f"\nDeepInfer is up: {url}  (OpenAI API at {url}/v1, model {model_id or '?'})\n"
            + (f"  more gateways: {', '.join(mesh.gateway_urls[1:])} (the same mesh; put a load balancer in front)\n"
               if len(mesh.gateway_urls) > 1 else "") +
            f"  logs:  {mesh.workdir}/logs\n"
            f"  mesh:  NATS {mesh.nats_url}, Redis {mesh.redis_url}, storage tier {mesh.kv_root}\n"
            f"  workers: deepinfer status --nats {mesh.nats_url}\n"
            f"  scale: DEEPINFER_NATS_URL={mesh.nats_url} DEEPINFER_REDIS_URL={mesh.redis_url} "
            f"DEEPINFER_KV_ROOT={mesh.kv_root} DEEPINFER_MODEL={mesh.model_dir} deepinfer serve "
            f"{'worker --worker-id worker-extra' if agg else 'prefill --worker-id prefill-extra'}\n"
            f"  metrics: {url}/metrics (gateway); workers: "
            f"{', '.join(f'{w} :{p}' for w, p in mesh.metrics_ports.items()) or 'none'}\n"
            f"  try:   curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f"           -d '{{{model_field}\"messages\": "
            f"[{{\"role\": \"user\", \"content\": \"Say hello\"}}], \"max_tokens\": 32}}'\n"
            "Press Ctrl-C to stop.\n",
            flush=True,
        )
        reported: set[str] = set()
        while True:
            time.sleep(1.0)
            for p in mesh.dead_services():
                if p.name not in reported:
                    reported.add(p.name)
                    _say(f"warning: {p.name} exited (code {p.returncode}); log {p.log_path}:\n{p.log_tail(20)}")
            for infra in (mesh.nats, mesh.redis):
                if infra is not None and not infra.alive and infra.name not in reported:
                    reported.add(infra.name)
                    _say(f"warning: {infra.name} exited (code {infra.returncode}); log {infra.log_path}")
    except _Stop as e:
        _say(f"{e}: stopping...")
    except LauncherError as e:
        print(f"deepinfer: start-up failed: {e}", file=sys.stderr)
        rc = 1
    finally:
        # A second Ctrl-C must not interrupt the shutdown halfway.
        for s in old:
            signal.signal(s, signal.SIG_IGN)
        mesh.stop()
        for s, h in old.items():
            signal.signal(s, h)
    if rc == 0:
        _say("stopped")
    return rc


# ---------------------------------------------------------------------- convert


def cmd_convert(args: argparse.Namespace) -> int:
    from deepinfer.models.convert import resolve_model

    print(resolve_model(args.model))
    return 0


# ------------------------------------------------------------------------- main


def _positive(s: str) -> int:
    n = int(s)
    if n < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepinfer", description="DeepInfer: an LLM serving mesh on NATS.")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start nats, redis and every service; Ctrl-C stops all")
    up.add_argument("--model", default=None, help="Hugging Face model directory (default: embedded SmolLM2-135M-Instruct)")
    up.add_argument("--port", type=int, default=None, help="gateway port (default 8000 when free, else any free port)")
    up.add_argument("--tokenizer", type=_positive, default=1, help="tokenizer workers")
    up.add_argument("--prefill", type=_positive, default=1, help="prefill workers")
    up.add_argument("--decode", type=_positive, default=1, help="decode workers (--mode disagg)")
    up.add_argument("--mode", choices=["agg", "disagg"], default=DEFAULT_MODE,
                    help="agg: workers that prefill and decode their requests (one engine, prefill chunks "
                         "mixed into decode steps); disagg: prefill workers hand off to decode workers "
                         f"(default {DEFAULT_MODE})")
    up.add_argument("--workers", type=_positive, default=1, help="prefill-and-decode workers (--mode agg)")
    up.add_argument("--batch-invariant", action="store_true",
                    help="engine workers give a request the same bits whatever the cache, chunking and batch "
                         "(a seed reproduces its text; slower, fp32 under --dtype auto)")
    up.add_argument("--gateways", type=_positive, default=1,
                    help="gateways sharing the workers, each on its own port (the first on --port)")
    up.add_argument("--speculative", choices=["none", "ngram", "draft"], default="none",
                    help="speculative decoding on the decode workers (default none; see `deepinfer serve decode -h`)")
    up.add_argument("--timeout", type=float, default=180, help="seconds to wait for the mesh to become healthy")
    up.add_argument("--workdir", default=None, help="logs / NATS store / KV blocks (default: a temporary dir)")

    serve = sub.add_parser("serve", help="run one service in this process")
    serve.add_argument("service", choices=SERVICES)
    serve.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the service")

    from deepinfer import status

    status.add_arguments(sub.add_parser("status", help="list the live workers of a running mesh and their load"))

    conv = sub.add_parser("convert", help="convert the embedded default model and print its directory")
    conv.add_argument("--model", default=None, help=argparse.SUPPRESS)

    from deepinfer import economics
    from deepinfer.bench import compare, replay, serve, soak

    bench = sub.add_parser("bench", help="benchmark clients").add_subparsers(dest="bench", required=True)
    serve.add_arguments(bench.add_parser("serve", help="benchmark an OpenAI-compatible endpoint",
                                         description=serve.DESCRIPTION))
    compare.add_arguments(bench.add_parser("compare", help="the same workload against two endpoints, with ratios",
                                           description=compare.DESCRIPTION))
    replay.add_arguments(bench.add_parser("replay", help="replay a Mooncake-format trace through a gateway",
                                          description=replay.DESCRIPTION))
    soak.add_arguments(bench.add_parser("soak", help="mixed load for a set time: RSS per process, errors, latency drift",
                                        description=soak.DESCRIPTION))
    economics.add_arguments(sub.add_parser("economics", help="revenue, margin, payback and cache storage per day",
                                           description=economics.DESCRIPTION))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `serve` passes everything after the service name through untouched, even --help.
    if len(argv) >= 2 and argv[0] == "serve" and argv[1] in SERVICES:
        return cmd_serve(argv[1], argv[2:])
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return cmd_serve(args.service, args.args)
    if args.command == "up":
        return cmd_up(args)
    if args.command == "convert":
        return cmd_convert(args)
    if args.command == "status":
        from deepinfer import status

        return status.cli(args)
    if args.command == "bench":
        from deepinfer.bench import compare, replay, serve, soak

        return {"serve": serve, "compare": compare, "replay": replay, "soak": soak}[args.bench].cli(args)
    if args.command == "economics":
        from deepinfer import economics

        return economics.cli(args)
    return 2  # unreachable: subcommand is required


if __name__ == "__main__":
    sys.exit(main())
