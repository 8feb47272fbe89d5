"""Command-line options every service shares, with environment defaults."""

from __future__ import annotations

import argparse
import os

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def log_level(s: str) -> str:
    """``--log-level`` / DEEPINFER_LOG_LEVEL: one of LOG_LEVELS, any case (argparse applies a
    ``type`` to an environment default too, where ``choices`` would not be checked)."""
    if s.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{s!r} is not one of {', '.join(LOG_LEVELS)}")
    return s.upper()


def env_bool(name: str, default: bool) -> bool:
    """A boolean setting's environment default: 1/true/yes/on or 0/false/no/off (any case); unset
    or empty -> ``default``. Raises ValueError naming the variable for anything else."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: expected 1/true/yes/on or 0/false/no/off")


class _ToEnvironment(argparse.Action):
    """Stores the option's value in the process environment (``dest`` names the variable), where
    every part of the service that needs it reads it (``mesh.client.stream_replicas``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values < 1:
            parser.error(f"{option_string} must be at least 1")
        os.environ[self.dest] = str(values)


def service_parser(role: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"deepinfer serve {role}", description=description)
    p.add_argument("--nats", "--nats-url", dest="nats", default=os.environ.get("DEEPINFER_NATS_URL", "nats://127.0.0.1:4222"),
                   help="NATS URL, or a comma-separated seed list of a cluster's servers (env DEEPINFER_NATS_URL)")
    p.add_argument("--stream-replicas", dest="DEEPINFER_STREAM_REPLICAS", type=int, action=_ToEnvironment,
                   help="replicas of the JetStream streams and buckets this service creates (env "
                        "DEEPINFER_STREAM_REPLICAS; default 1: one server; 3 in a 3-server cluster)")
    p.add_argument("--model", default=os.environ.get("DEEPINFER_MODEL"),
                   help="Hugging Face-format model directory (env DEEPINFER_MODEL; default: the embedded SmolLM2)")
    p.add_argument("--worker-id", default=None, help="unique id of this replica (default: random)")
    p.add_argument("--log-level", default=os.environ.get("DEEPINFER_LOG_LEVEL", "INFO"), type=log_level,
                   help="DEBUG, INFO, WARNING or ERROR (env DEEPINFER_LOG_LEVEL; default INFO)")
    p.add_argument("--metrics-port", type=int, default=int(os.environ.get("DEEPINFER_METRICS_PORT") or 0),
                   help="serve Prometheus metrics on http://0.0.0.0:PORT/metrics (env DEEPINFER_METRICS_PORT; "
                        "default 0: no metrics server)")
    return p
