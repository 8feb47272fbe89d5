"""Remote images: fetching an ``http(s)`` image URL for a request, within a policy against SSRF.

A client-supplied URL makes the gateway open a connection, so by default it may only reach the
public internet (a client must not make it probe internal hosts or a cloud metadata endpoint).
``RemotePolicy`` (gateway settings, ``GatewayConfig``):

  allow_remote     --[no-]allow-remote-images / DEEPINFER_ALLOW_REMOTE_IMAGES (default on, as vLLM):
                   off -> every http(s) image URL is refused (400 ``image_url_not_allowed``);
  allowed_domains  --allowed-media-domains / DEEPINFER_ALLOWED_MEDIA_DOMAINS (comma-separated;
                   default empty: any host): the URL's host must be one of them, exactly (as
                   vLLM's --allowed-media-domains); checked on every redirect too;
  allow_private    --[no-]allow-private-image-urls / DEEPINFER_ALLOW_PRIVATE_IMAGE_URLS (default off):
                   off -> every address the host resolves to must be a public one: loopback,
                   private (RFC 1918, IPv6 ULA), link-local (169.254.169.254, the metadata
                   address), carrier-grade NAT, multicast, reserved or unspecified addresses
                   refuse the URL (IPv4-mapped IPv6 addresses are checked as IPv4).

How ``fetch`` runs, all within one deadline of ``timeout_s`` (DNS, connects, redirects, body):

  1. the URL: http or https with a host, the domain list;
  2. the connection (``_CheckedBackend``, httpcore's network backend hook): the host is resolved
     here, every address checked, and the connection opened to a checked address (TLS still
     verifies the host name), so a DNS answer that changes between the check and the connect
     (rebinding) cannot lead to an internal host;
  3. a redirect (301, 302, 303, 307, 308; at most ``MAX_REDIRECTS``): its target is checked as in
     1-2; anything else but 200 is refused with its status;
  4. the body: ``Content-Length`` and the bytes read bounded by ``max_bytes``.

Every failure is a 400 whose message says what happened: "no complete answer within 2 s",
"could not resolve host ...", "connection refused by ...", "HTTP 404", "... is a private address";
its code: ``image_url_not_allowed`` (the policy), ``invalid_image_url`` (no host, a bad port),
``image_too_large`` (the body), else ``image_fetch_failed``.
NOTE: the connection never goes through an HTTP proxy (the environment's proxy variables are
ignored): the address check is on the image host itself.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import httpcore

from deepinfer.gateway.api.errors import OpenAIError, bad_request

MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
USER_AGENT = b"deepinfer-gateway (image fetch)"


@dataclass(frozen=True)
class RemotePolicy:
    allow_remote: bool = True
    allow_private: bool = False
    allowed_domains: tuple[str, ...] = ()  # empty: any host


class Refused(Exception):
    """The fetch cannot go on; the message says why (it becomes the 400's message)."""

    def __init__(self, message: str, code: str = "image_fetch_failed"):
        super().__init__(message)
        self.code = code


def address_problem(address: str) -> str | None:
    """Why ``address`` (an IP literal) is not a public address, or None when it is."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for kind in ("loopback", "link_local", "private", "multicast", "reserved", "unspecified"):
        if getattr(ip, f"is_{kind}"):
            return f"a {kind.replace('_', '-')} address"
    return None if ip.is_global else "not a public address"


def check_url(url: str, policy: RemotePolicy) -> None:
    """The URL's shape and host against the policy (before any connection). Raises Refused."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Refused(f"{url[:100]!r} is not an http(s) URL with a host", code="invalid_image_url")
    if not policy.allow_remote:
        raise Refused("this server does not fetch remote image URLs (--no-allow-remote-images); "
                      "send the image as a data: URL", code="image_url_not_allowed")
    if policy.allowed_domains and parts.hostname.rstrip(".") not in policy.allowed_domains:
        raise Refused(f"images from {parts.hostname} are not allowed (allowed domains: "
                      f"{', '.join(policy.allowed_domains)})", code="image_url_not_allowed")
    try:
        parts.port
    except ValueError:
        raise Refused(f"{url[:100]!r} has an invalid port", code="invalid_image_url") from None


class _CheckedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's default backend, but a TCP connection resolves the host itself, refuses it
    unless every address passes the policy, and connects to those checked addresses only."""

    def __init__(self, allow_private: bool):
        self.inner = httpcore.AnyIOBackend()
        self.allow_private = allow_private

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise Refused(f"could not resolve host {host}: {e.strerror or e}") from None
        addresses = list(dict.fromkeys(info[4][0] for info in infos))
        if not self.allow_private:
            for a in addresses:
                problem = address_problem(a)
                if problem is not None:
                    where = f"{host} is" if a == host else f"host {host} resolves to {a},"
                    raise Refused(f"{where} {problem}: refused (the server allows only public addresses; "
                                  "--allow-private-image-urls turns that off)", code="image_url_not_allowed")
        why = "no address"
        for a in addresses:
            try:
                return await self.inner.connect_tcp(a, port, timeout, local_address, socket_options)
            except httpcore.ConnectError as e:
                why = _os_reason(e)
        raise Refused(f"could not connect to {host} port {port}: {why}")

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise Refused("unix sockets are not image URLs")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


async def fetch(url: str, max_bytes: int, timeout_s: float, policy: RemotePolicy, param: str,
                field: str = "image_url") -> bytes:
    """The body of the image at ``url`` (see the module docstring); ``field``: what the API calls
    the URL, for messages. Raises a 400 ``OpenAIError``."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _fetch(url, max_bytes, policy, param)
    except TimeoutError:
        message = f"no complete answer within {timeout_s:g} s (the whole download's limit)"
    except Refused as e:
        raise bad_request(f"{field} refused: {e}" if e.code == "image_url_not_allowed"
                          else f"could not fetch {field}: {e}", param=param, code=e.code) from None
    except httpcore.TimeoutException:
        message = f"no complete answer within {timeout_s:g} s (the whole download's limit)"
    except (httpcore.NetworkError, httpcore.ProtocolError) as e:
        message = f"the connection failed ({type(e).__name__}: {e or 'closed by the server'})"
    except httpcore.UnsupportedProtocol as e:
        message = f"unsupported URL ({e or 'scheme'})"
    raise bad_request(f"could not fetch {field}: {message}", param=param, code="image_fetch_failed")


async def _fetch(url: str, max_bytes: int, policy: RemotePolicy, param: str) -> bytes:
    async with httpcore.AsyncConnectionPool(network_backend=_CheckedBackend(policy.allow_private)) as pool:
        for _ in range(MAX_REDIRECTS + 1):
            check_url(url, policy)
            async with pool.stream("GET", url, headers=[(b"User-Agent", USER_AGENT), (b"Accept", b"image/*")]) as r:
                if r.status in REDIRECTS:
                    location = _header(r, b"location")
                    if not location:
                        raise Refused(f"HTTP {r.status} without a Location")
                    url = urljoin(url, location)
                    continue
                if r.status != 200:
                    raise Refused(f"HTTP {r.status}")
                return await _body(r, max_bytes, param)
    raise Refused(f"more than {MAX_REDIRECTS} redirects")


async def _body(r: httpcore.Response, max_bytes: int, param: str) -> bytes:
    length = _header(r, b"content-length")
    if length.isdigit() and int(length) > max_bytes:
        raise _too_large(f"{length} bytes (limit {max_bytes})", param)
    body = bytearray()
    async for piece in r.aiter_stream():
        body += piece
        if len(body) > max_bytes:
            raise _too_large(f"over {max_bytes} bytes", param)
    return bytes(body)


def _too_large(what: str, param: str) -> OpenAIError:
    return bad_request(f"image too large: {what}", param=param, code="image_too_large")


def _os_reason(e: BaseException) -> str:
    """The operating system's reason behind a connect error ("connection refused"), else its text."""
    seen = e
    while seen is not None:
        if isinstance(seen, OSError) and (seen.errno or seen.strerror):
            return (os.strerror(seen.errno) if seen.errno else seen.strerror).lower()
        seen = seen.__cause__ or seen.__context__
    return str(e) or type(e).__name__


def _header(r: httpcore.Response, name: bytes) -> str:
    return next((v.decode("latin-1").strip() for k, v in r.headers if k.lower() == name), "")
