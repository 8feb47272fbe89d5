"""NATS mesh: connection with reconnect, typed request/reply, service lifecycle."""

from deepinfer.mesh.client import MeshClient, MeshError, NoResponders, RemoteError, RequestTimeout  # noqa: F401
from deepinfer.mesh.service import Service, run_service  # noqa: F401
