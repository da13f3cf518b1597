"""The admin listener's dispatcher: a plain ASGI app on hypercorn's trio worker that
composes the resources' route tables.

It answers `/healthz` and `/metrics` unauthenticated, hands `/admin` to the pages (their
own login), asks every `/api/` route for the admin key as a Bearer token, refuses writes
on a standby, and maps errors to statuses in one place. What each route does is in its
resource's module: `_fleet`, `_models`, `_weights`, `_tenants`, `_logs`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol
from urllib.parse import parse_qsl

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from llmgw.cp._admin._adapters import AdapterRoutes, AdapterSource
from llmgw.cp._admin._autoscale import AutoscaleRoutes
from llmgw.cp._admin._fleet import Fleet
from llmgw.cp._admin._http import Route, read_json, send_error
from llmgw.cp._admin._key import authorised, digest
from llmgw.cp._admin._logs import Logs
from llmgw.cp._admin._models import Explainer, Models
from llmgw.cp._admin._rollouts import RolloutRoutes
from llmgw.cp._admin._tenants import Tenants
from llmgw.cp._admin._weights import Weights
from llmgw.cp._fleet._autoscaler import Autoscaler
from llmgw.cp._fleet._catalog_file import CatalogFile
from llmgw.cp._fleet._leader import LeaderView
from llmgw.cp._fleet._reconciler import Reconciler
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.cp._observe import _node_logs
from llmgw.errors import ConfigError, NotFound, PeerError, StaleEpoch, UsageError
from llmgw.router import KeyStore
from llmgw.store import Store
from llmgw.web.asgi import App as Asgi
from llmgw.web.asgi import HttpError, Receive, Scope, Send, lifespan, send_json


class LeaderSource(Protocol):
    """Leadership as the admin API needs it (llmgw/cp/_fleet/_leader.py `Leadership`)."""

    def may_act(self) -> bool: ...
    def view(self) -> LeaderView: ...


class AdminApp:
    """The admin listener's ASGI app: one route table made of every resource's routes."""

    def __init__(
        self,
        registry: NodeRegistry,
        admin_key: str,
        *,
        reconciler: Reconciler | None = None,
        autoscaler: Autoscaler | None = None,
        adapters: AdapterSource | None = None,
        catalog: CatalogFile | None = None,
        keys: KeyStore | None = None,
        metrics: CollectorRegistry | None = None,
        router: Explainer | None = None,
        store: Store | None = None,
        bands: Mapping[str, int] | None = None,
        leadership: LeaderSource | None = None,
        pages: Callable[[Asgi], Asgi] | None = None,
    ) -> None:
        self._registry = registry
        # Whether this control plane leads (llmgw/cp/_fleet/_leader.py); None: it always
        # does (tests). On a standby every non-GET call answers 409.
        self.leadership = leadership
        self._metrics = metrics
        self._digest = digest(admin_key)
        # The admin pages (llmgw/cp/_pages) under /admin, made from this app: they read the
        # API through it (`pages(self)`).
        self.pages = pages(self) if pages is not None else None
        self._fleet = Fleet(registry, store)
        self._models = Models(registry, reconciler, catalog, router, autoscaler)
        self._weights = Weights(registry, catalog)
        self._tenants = Tenants(store, keys, bands)
        self._logs = Logs(registry, store)
        self._rollouts = RolloutRoutes(reconciler, catalog, store)
        self._autoscale = AutoscaleRoutes(autoscaler, catalog, store)
        self._adapters = AdapterRoutes(adapters)
        self._routes: list[Route] = [
            *self._fleet.routes,
            *self._models.routes,
            *self._weights.routes,
            *self._tenants.routes,
            *self._logs.routes,
            *self._rollouts.routes,
            *self._autoscale.routes,
            *self._adapters.routes,
        ]
        # Each pattern matches a whole path, so the order of the rows decides nothing: a
        # (method, path) declared twice is a mistake, not a precedence to resolve.
        owned = [(method, pattern.pattern) for method, pattern, _ in self._routes]
        assert len(set(owned)) == len(owned), "a route is declared by two resources"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/healthz":
            await send_json(send, 200, {"status": "ok"})
            return
        if path == "/metrics" and self._metrics is not None:
            # Unauthenticated, as Prometheus scrapes it: keep the admin listener private.
            page = generate_latest(self._metrics)
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode())],
                }
            )
            await send({"type": "http.response.body", "body": page})
            return
        if self.pages is not None and (path == "/admin" or path.startswith("/admin/")):
            await self.pages(scope, receive, send)  # its own login: a cookie, not a Bearer key
            return
        if not path.startswith("/api/"):
            await send_error(send, 404, f"no such page: {path}")
            return
        if not authorised(scope, self._digest):
            await send_error(send, 401, "an admin key is needed: Authorization: Bearer <key>")
            return
        if path == "/api/v1/leader" and method == "GET":
            await send_json(send, 200, self._leader_json())
            return
        leadership = self.leadership
        if method not in ("GET", "HEAD") and leadership is not None and not leadership.may_act():
            # A standby serves the API read-only; the operator is told where to write.
            await send_json(send, 409, self._standby_refusal())
            return
        for route_method, pattern, handler in self._routes:
            match = pattern.match(path)
            if match and route_method == method:
                try:
                    body = await read_json(receive) if method in ("POST", "PUT", "PATCH") else None
                    query = dict(parse_qsl(scope.get("query_string", b"").decode()))
                    status, result = await handler(body=body, query=query, **match.groupdict())
                except HttpError as exc:
                    await send_error(send, exc.status, str(exc))
                    return
                except NotFound as exc:
                    await send_error(send, 404, str(exc))
                    return
                except (UsageError, ConfigError) as exc:
                    await send_error(send, 400, str(exc))
                    return
                except StaleEpoch as exc:
                    # The agent knows a newer leader: counted, and this one steps down.
                    self._registry.stale_epoch(match.groupdict().get("node") or "?", exc)
                    await send_error(send, 409, f"the agent refused this command as stale: {exc}")
                    return
                except PeerError as exc:
                    await send_error(send, 502, f"the agent answered: {exc}")
                    return
                if isinstance(result, _node_logs.Follow):  # a stream, after its first reply
                    await result.run(receive, send)
                    return
                await send_json(send, status, result)
                return
        await send_error(send, 404, f"no such API route: {method} {path}")

    def _leader_json(self) -> dict[str, Any]:
        """`GET /api/v1/leader`: this control plane's role, epoch, the leader's and its own
        addresses; without a Leadership (tests, a bare app) a single leader at its epoch."""
        if self.leadership is None:
            body: dict[str, Any] = {
                "role": "single", "epoch": self._registry.epoch, "leader": None, "me": None,
                "lease_s": None,
            }  # fmt: skip
        else:
            body = self.leadership.view().json()
        body["commands_refused_stale"] = self._registry.commands_refused_stale
        return body

    def _standby_refusal(self) -> dict[str, Any]:
        """The error body every other refusal has, and the leader's addresses beside it."""
        view = self.leadership.view() if self.leadership is not None else None
        leader = view.leader if view is not None else None
        if leader is None:
            message = "standby; no leader yet: try again in a few seconds"
        else:
            message = f"standby; leader is {leader.describe()}"
        return {
            "error": {"message": message, "code": 409},
            "leader": leader.json() if leader is not None else None,
        }
