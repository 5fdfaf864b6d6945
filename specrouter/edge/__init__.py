"""The HTTP edge: the ASGI app, its routes, its lifecycle, and the uvicorn protocol guard."""

from specrouter.edge.app import SpecRouterApp, create_app
from specrouter.edge.lifecycle import Lifecycle

__all__ = ["Lifecycle", "SpecRouterApp", "create_app"]
