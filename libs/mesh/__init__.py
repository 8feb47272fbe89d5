"""NATS mesh: connection with reconnect, typed request/reply, service lifecycle."""

from deepinfer.mesh.client import (MeshClient, MeshError, MessageTooLarge, NoResponders, RemoteError,  # noqa: F401
                                   RequestTimeout, nats_servers, stream_replicas)
from deepinfer.mesh.service import Service, run_service  # noqa: F401
