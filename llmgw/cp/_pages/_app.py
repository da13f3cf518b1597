"""The admin pages: a quart-trio app under `/admin` on the admin listener.

Login with an admin key sets `llmgw_admin`, a random session id (never the key),
HttpOnly, SameSite=Strict, Path=/admin. Every other path needs it: a page
redirects to the login form (303), `/admin/data/...` answers 401. Every POST form
carries `csrf`, the session's own token: missing 400, wrong 403. Sessions are
kept in the store too, so a login holds on every control plane that shares it
(llmgw/cp/_pages/_sessions.py).

The pages read what `llmgw ctl` reads: the admin API, called in-process through
the admin app (`api_client`), so they show nothing the API does not and need
no access of their own to the registry or the reconciler.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlencode

import trio
from quart import Response, g, redirect, render_template, request
from quart_trio import QuartTrio

from llmgw.cp._pages import _view
from llmgw.cp._pages._sessions import SESSION_TTL_S, Sessions
from llmgw.web.asgi import App as Asgi
from llmgw.web.asgi import Message

log = logging.getLogger("llmgw.cp.pages")

COOKIE = "llmgw_admin"
LOG_LINES = 200
MIRROR_MAX_ENTRIES = 2000

Api = Callable[..., Awaitable[tuple[int, Any]]]

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)


def api_client(app: Asgi, admin_key: str) -> Api:
    """`await api("GET", "/api/v1/nodes", query={...}, body=...)` -> (status, JSON).

    `path` is decoded, as an ASGI scope's is: a node id goes in as it is."""

    async def call(
        method: str, path: str, *, query: dict[str, str] | None = None, body: Any = None
    ) -> tuple[int, Any]:
        raw = b"" if body is None else json.dumps(body).encode()
        sent: list[Message] = []

        async def receive() -> Message:
            return {"type": "http.request", "body": raw, "more_body": False}

        async def send(message: Message) -> None:
            sent.append(message)

        scope = {
            "type": "http", "method": method, "path": path,
            "query_string": urlencode(query or {}).encode(),
            "headers": [(b"authorization", f"Bearer {admin_key}".encode())],
        }  # fmt: skip
        await app(scope, receive, send)
        status = int(sent[0]["status"])
        data = b"".join(m.get("body", b"") for m in sent[1:])
        try:
            return status, json.loads(data) if data else None
        except ValueError:
            return status, {"error": {"message": data.decode(errors="replace")[:500]}}

    return call


def _message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    return str(body)


def _mirror_entries(root: Path, wanted: list[str]) -> list[tuple[str, int]]:
    """Each top-level entry of the mirror, and each path a model's source names, with the
    bytes under it (symlinks not followed)."""

    def size(p: Path) -> int:
        if p.is_symlink():
            return 0
        if p.is_file():
            return p.stat().st_size
        total = 0
        for dirpath, _dirs, files in os.walk(p):
            for f in files:
                fp = Path(dirpath, f)
                if not fp.is_symlink():
                    total += fp.stat().st_size
        return total

    paths: dict[str, Path] = {}
    try:
        for child in sorted(root.iterdir())[:MIRROR_MAX_ENTRIES]:
            paths["/" + child.name + ("/" if child.is_dir() else "")] = child
    except OSError:
        return []
    real_root = root.resolve()
    for w in wanted:
        rel = w.strip("/")
        p = (root / rel).resolve()
        if rel and p.is_relative_to(real_root) and p.exists():
            paths.setdefault("/" + rel + ("/" if p.is_dir() else ""), p)
    return [(k, size(v)) for k, v in sorted(paths.items())]


def make_pages(
    api: Api, admin_key: str, *, mirror_dir: Path | None = None,
    sessions: Sessions | None = None,
) -> Asgi:  # fmt: skip
    here = Path(__file__).parent
    app = QuartTrio(
        __name__,
        template_folder=str(here / "templates"),
        static_folder=str(here / "static"),
        static_url_path="/admin/static",
    )
    app.config["MAX_CONTENT_LENGTH"] = 64 * 1024
    app.config["SEND_FILE_MAX_AGE_DEFAULT"] = 0
    digest = hashlib.sha256(admin_key.encode()).digest()
    store = sessions if sessions is not None else Sessions()

    @app.before_request
    async def guard() -> Any:
        path = request.path
        if path == "/admin/login" or path.startswith("/admin/static/"):
            return None
        sid = request.cookies.get(COOKIE)
        session = await store.get(sid)
        if session is None:
            if path.startswith("/admin/data/"):
                return Response("an admin session is needed: log in at /admin/login", 401,
                                content_type="text/plain; charset=utf-8")  # fmt: skip
            return redirect("/admin/login", 303)
        if request.method == "POST":
            form = await request.form
            token = form.get("csrf")
            if not token:
                return Response("csrf: this form carries no CSRF token; reload the page", 400,
                                content_type="text/plain; charset=utf-8")  # fmt: skip
            if not hmac.compare_digest(token.encode(), session.csrf.encode()):
                return Response("csrf: the token is not this session's; reload the page", 403,
                                content_type="text/plain; charset=utf-8")  # fmt: skip
        g.session = session
        g.sid = sid
        return None

    @app.after_request
    async def headers(response: Response) -> Response:
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "same-origin"
        response.headers["X-Frame-Options"] = "DENY"
        if not request.path.startswith("/admin/static/"):
            response.headers["Cache-Control"] = "no-store"
        return response

    async def page(template: str, **context: Any) -> str:
        return await render_template(template, csrf=g.session.csrf, **context)

    # --- login --------------------------------------------------------------------------

    @app.get("/admin/login")
    async def login_form() -> Any:
        return await render_template("login.html", error=None)

    @app.post("/admin/login")
    async def login() -> Any:
        form = await request.form
        key = form.get("key", "")
        if not hmac.compare_digest(hashlib.sha256(key.strip().encode()).digest(), digest):
            log.warning("admin pages: a login with a wrong key from %s", request.remote_addr)
            body = await render_template(
                "login.html", error="that is not the admin key (server.yaml's state_dir/admin.key)"
            )
            return body, 403
        sid, _session = store.create()
        response = redirect("/admin/", 303)
        response.set_cookie(
            COOKIE,
            sid,
            httponly=True,
            samesite="Strict",
            path="/admin",
            max_age=int(SESSION_TTL_S),
            secure=request.scheme == "https",  # plain HTTP on a private network: not Secure
        )
        return response

    @app.post("/admin/logout")
    async def logout() -> Any:
        store.end(g.sid)
        response = redirect("/admin/login", 303)
        response.delete_cookie(COOKIE, path="/admin", httponly=True, samesite="Strict")
        return response

    # --- data ---------------------------------------------------------------------------

    async def get(path: str, **query: str) -> tuple[int, Any]:
        return await api("GET", path, query={k: v for k, v in query.items() if v})

    async def cluster_data() -> dict[str, Any]:
        now = time.time()
        _s, nodes = await get("/api/v1/nodes")
        status, st = await get("/api/v1/status")
        models = st.get("models", []) if status == 200 else []
        rs, reps = await get("/api/v1/replicas")
        stale: dict[str, int] = {}
        for r in reps.get("replicas", []) if rs == 200 else []:
            stale[r["model"]] = stale.get(r["model"], 0) + bool(r.get("stale"))
        _e, ev = await get("/api/v1/events", limit="30")
        events = [
            {**e, "when": _view.fmt_time(e.get("at"))}
            for e in reversed(ev.get("events", []) if isinstance(ev, dict) else [])
        ]
        return {
            "nodes": [_view.node_row(n, now) for n in nodes.get("nodes", [])],
            "models": [{**m, "stale": stale.get(m["model"], 0)} for m in models],
            "traffic": st.get("traffic", []) if status == 200 else [],
            "events": events,
        }

    async def node_data(node: str) -> dict[str, Any] | None:
        _s, nodes = await get("/api/v1/nodes")
        found = next((n for n in nodes.get("nodes", []) if n.get("node_id") == node), None)
        if found is None:
            return None
        hs, history = await get(f"/api/v1/nodes/{node}/history")
        return {
            "id": node,
            "fig": _view.node_figures(found),
            "charts": _view.history_charts(history if hs == 200 else None),
            "history_note": None if hs == 200 else _message(history),
            "history_since": _view.history_since(history) if hs == 200 else None,
        }

    async def replicas_data() -> dict[str, Any]:
        now = time.time()
        status, body = await get("/api/v1/replicas")
        rows = []
        for r in body.get("replicas", []) if status == 200 else []:
            p = r.get("progress") or None
            rows.append({
                **r,
                "age": _view.fmt_age(None if r.get("since") is None else now - r["since"]),
                "progress": p,
                "progress_text": None if p is None else (f"{_view.fmt_bytes(p.get('done_bytes'))}"
                                 f" of {_view.fmt_bytes(p.get('total_bytes'))}"),
            })  # fmt: skip
        return {"replicas": rows, "error": None if status == 200 else _message(body)}

    async def log_sources(node: str) -> list[str]:
        """What the node lists (the agent itself, each shard's processes); just the agent's
        own when it does not answer (the tail's error then says why)."""
        status, body = await get(f"/api/v1/nodes/{node}/log-sources")
        if status != 200 or not isinstance(body, dict) or not isinstance(body.get("sources"), list):
            return ["agent"]
        return [str(x) for x in body["sources"]]

    async def log_lines(node: str, source: str) -> tuple[list[str], str | None]:
        status, body = await get(f"/api/v1/nodes/{node}/logs",
                                 source=source, lines=str(LOG_LINES))  # fmt: skip
        if status != 200:
            return [], _message(body)
        lines = body.get("lines", []) if isinstance(body, dict) else []
        out = []
        for line in lines:
            if isinstance(line, dict):
                src = line.get("source")
                text = str(line.get("text"))
                out.append(f"[{src}] {text}" if src and src != source else text)
            else:
                out.append(str(line))
        return out, None

    async def mirror_data() -> dict[str, Any]:
        _m, models = await get("/api/v1/models")
        model_list = models.get("models", []) if isinstance(models, dict) else []
        _n, nodes = await get("/api/v1/nodes")
        if mirror_dir is None:
            return {
                "rows": [],
                "note": "this control plane serves no mirror (server.yaml mirror.dir)",
            }
        wanted = [str(m.get("source", "")).removeprefix("mirror:") for m in model_list
                  if str(m.get("source", "")).startswith("mirror:")]  # fmt: skip
        # Sizes are a walk of the tree: off the event loop, as the heartbeats wait on it.
        entries = await trio.to_thread.run_sync(_mirror_entries, mirror_dir, wanted)
        return {"rows": _view.mirror_rows(entries, model_list, nodes.get("nodes", [])),
                "note": None if entries else f"the mirror {mirror_dir} holds nothing"}  # fmt: skip

    async def keys_data() -> dict[str, Any]:
        status, body = await get("/api/v1/keys")
        keys = [{**k, "created": _view.fmt_time(k.get("created_at"))}
                for k in body.get("keys", [])] if status == 200 else []  # fmt: skip
        return {"keys": keys, "error": None if status == 200 else _message(body)}

    async def model_names() -> list[str]:
        status, body = await get("/api/v1/models")
        return [str(m.get("name")) for m in body.get("models", [])] if status == 200 else []

    async def place_data(model: str) -> dict[str, Any] | None:
        if not model:
            return None
        status, body = await api("POST", "/api/v1/place", body={"model": model})
        if status != 200:
            return {"error": _message(body)}
        return dict(body)

    # --- pages --------------------------------------------------------------------------

    @app.get("/admin/")
    async def cluster() -> Any:
        return await page("cluster.html", title="Cluster", data=await cluster_data())

    @app.get("/admin/data/cluster")
    async def cluster_fragment() -> Any:
        return await render_template("_cluster.html", data=await cluster_data())

    @app.get("/admin/nodes/<node>")
    async def node_page(node: str) -> Any:
        data = await node_data(node)
        if data is None:
            return await page("missing.html", title="No such node",
                              what=f"no node {node!r} has registered"), 404  # fmt: skip
        return await page("node.html", title=f"Node {node}", node=node, data=data)

    @app.get("/admin/data/nodes/<node>")
    async def node_fragment(node: str) -> Any:
        data = await node_data(node)
        if data is None:
            return Response(f"no node {node!r} has registered", 404, content_type="text/plain")
        return await render_template("_node.html", node=node, data=data)

    @app.get("/admin/replicas")
    async def replicas() -> Any:
        return await page("replicas.html", title="Replicas", data=await replicas_data())

    @app.get("/admin/data/replicas")
    async def replicas_fragment() -> Any:
        return await render_template("_replicas.html", data=await replicas_data())

    @app.get("/admin/logs")
    async def logs() -> Any:
        _s, nodes = await get("/api/v1/nodes")
        node_ids = [str(n.get("node_id")) for n in nodes.get("nodes", [])]
        node = request.args.get("node", "")
        sources = await log_sources(node) if node in node_ids else []
        source = request.args.get("source", "") or (sources[0] if sources else "")
        lines, error = await log_lines(node, source) if node in node_ids else ([], None)
        return await page("logs.html", title="Logs", nodes=node_ids, node=node,
                          sources=sources, source=source, lines=lines, error=error)  # fmt: skip

    @app.get("/admin/data/logs")
    async def logs_data() -> Any:
        node = request.args.get("node", "")
        source = request.args.get("source", "")
        lines, error = await log_lines(node, source)
        return {"lines": lines, "error": error}

    @app.get("/admin/mirror")
    async def mirror() -> Any:
        return await page("mirror.html", title="Mirror", data=await mirror_data())

    @app.get("/admin/data/mirror")
    async def mirror_fragment() -> Any:
        return await render_template("_mirror.html", data=await mirror_data())

    @app.get("/admin/keys")
    async def keys() -> Any:
        return await page("keys.html", title="API keys", data=await keys_data(), secret=None)

    @app.post("/admin/keys")
    async def keys_create() -> Any:
        form = await request.form
        tenant = form.get("tenant", "").strip()
        name = form.get("name", "").strip()
        body: dict[str, Any] = {"tenant": tenant}
        if name:
            body["name"] = name
        status, made = await api("POST", "/api/v1/keys", body=body)
        if status != 201:
            return await page("keys.html", title="API keys", data=await keys_data(),
                              secret=None, error=_message(made)), 400  # fmt: skip
        # Shown once, in this response only: nothing keeps it.
        return await page("keys.html", title="API keys", data=await keys_data(),
                          secret=made["secret"], made=made["key"])  # fmt: skip

    @app.post("/admin/keys/<key_id>/revoke")
    async def keys_revoke(key_id: str) -> Any:
        status, body = await api("DELETE", f"/api/v1/keys/{key_id}")
        if status != 200:
            return await page("keys.html", title="API keys", data=await keys_data(),
                              secret=None, error=_message(body)), status  # fmt: skip
        return redirect("/admin/keys", 303)

    @app.get("/admin/place")
    async def place() -> Any:
        model = request.args.get("model", "")
        return await page("place.html", title="Placement", models=await model_names(),
                          model=model, answer=await place_data(model))  # fmt: skip

    @app.get("/admin/data/place")
    async def place_fragment() -> Any:
        model = request.args.get("model", "")
        return await render_template("_place.html", model=model, answer=await place_data(model))

    return cast(Asgi, app)  # an ASGI app: hypercorn's types, not ours
