"""What ``deepinfer <argv>`` parses under a given environment, without running the service: the
deployment checks (tests/e2e/test_compose.py, tests/e2e/test_kubernetes.py) run each container's command
through the real CLI parsers and record which environment variables the code looked up."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
from functools import lru_cache
from unittest import mock


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace):
        super().__init__("parsed")
        self.namespace = namespace


class RecordingEnv(dict):
    """A stand-in for ``os.environ`` that remembers which variables were looked up."""

    def __init__(self, data):
        super().__init__(data)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)

    def setdefault(self, key, default=None):
        self.read.add(key)
        return super().setdefault(key, default)


class ServiceArgs:
    """What ``deepinfer <argv>`` parses in a container, or the problem that stops it."""

    def __init__(self, service: str | None, namespace: argparse.Namespace | None, env_read: set[str],
                 error: str | None):
        self.service, self.namespace, self.env_read, self.error = service, namespace, env_read, error

    def get(self, dest: str, default=None):
        return getattr(self.namespace, dest, default) if self.namespace is not None else default


@lru_cache(maxsize=None)
def parse_service(argv: tuple[str, ...], env: tuple[tuple[str, str], ...]) -> ServiceArgs:
    """``deepinfer *argv`` (``serve <service> ...``) up to its argument parsing, in environment ``env``."""
    from deepinfer import cli

    if len(argv) < 2 or argv[0] != "serve":
        return ServiceArgs(None, None, set(), f"command {list(argv)} is not `serve <service> ...`")
    service = argv[1]
    if service not in cli.SERVICES:
        return ServiceArgs(service, None, set(), f"`deepinfer serve {service}`: not a service the CLI accepts "
                                                  f"({', '.join(cli.SERVICES)})")
    with contextlib.suppress(ImportError):  # imported outside the fake environment; cmd_serve reports failures
        importlib.import_module(f"deepinfer.{cli.ALIASES.get(service, service)}.service")
    recording = RecordingEnv(env)
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    err = io.StringIO()
    try:
        with mock.patch.object(argparse.ArgumentParser, "parse_args", capture), \
                mock.patch.object(os, "environ", recording), contextlib.redirect_stderr(err):
            rc = cli.main(list(argv))
    except _Parsed as p:
        return ServiceArgs(service, p.namespace, recording.read, None)
    except SystemExit as e:
        said = err.getvalue().strip().splitlines() or [""]
        return ServiceArgs(service, None, recording.read, f"`deepinfer {' '.join(argv)}` exits {e.code}: {said[-1]}")
    return ServiceArgs(service, None, recording.read,
                       f"`deepinfer {' '.join(argv)}` returned {rc} before parsing its arguments: "
                       f"{err.getvalue().strip()[-400:]}")
