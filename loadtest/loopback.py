"""HTTP to processes on loopback: httpx's module functions and clients without httpx's
TLS set-up on every call.

Each httpx client (so each `httpx.get`) loads certifi's CA bundle into a new SSL context,
about 30 ms of CPU, although nothing on loopback speaks TLS; a wait that polls every 20 ms
would keep a core busy on that alone. These take httpx's arguments and share one context.
A module-level call still opens and closes a connection of its own, as httpx's do, so a
caller that counts a server's sockets sees no pooled connection."""

from __future__ import annotations

import ssl
from contextlib import AbstractContextManager
from typing import Any

import httpx

_TLS = ssl.create_default_context()


def request(method: str, url: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, url, verify=_TLS, **kwargs)


def get(url: str, **kwargs: Any) -> httpx.Response:
    return request("GET", url, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return request("POST", url, **kwargs)


def put(url: str, **kwargs: Any) -> httpx.Response:
    return request("PUT", url, **kwargs)


def patch(url: str, **kwargs: Any) -> httpx.Response:
    return request("PATCH", url, **kwargs)


def stream(method: str, url: str, **kwargs: Any) -> AbstractContextManager[httpx.Response]:
    return httpx.stream(method, url, verify=_TLS, **kwargs)


def client(**kwargs: Any) -> httpx.Client:
    return httpx.Client(verify=_TLS, **kwargs)


def async_client(**kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(verify=_TLS, **kwargs)
