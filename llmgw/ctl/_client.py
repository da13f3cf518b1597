"""The admin API's client for `llmgw ctl`: where it is, its key, a call, a followed stream.

Every answer the control plane refuses becomes one `CtlError` line for the operator
(exit code 1): the route, the status and the API's message; a standby's refusal
of a write is its own message, which names the leader. A missing or unreadable
key or ctl.yaml is a `ConfigError` (exit code 2).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

import httpx

from llmgw import config
from llmgw.errors import ConfigError, LlmgwError

DEFAULT_CTL_CONFIG = Path("~/.config/llmgw/ctl.yaml")
TIMEOUT_S = 120
# A followed stream: the control plane sends a keepalive line at least every few
# seconds while the agent answers, and ends the stream itself when it stops answering.
FOLLOW_TIMEOUT = httpx.Timeout(30.0, connect=10.0)


class CtlError(LlmgwError):
    """One clear line for the operator; exit code 1."""


def settings(args: argparse.Namespace) -> tuple[str, str]:
    """(admin URL, admin key): the environment first, then ctl.yaml (--config)."""
    path = args.config or Path(os.environ.get("LLMGW_CTL_CONFIG", str(DEFAULT_CTL_CONFIG)))
    path = path.expanduser()
    cfg = config.CtlConfig()
    if path.exists() or args.config is not None:
        cfg = config.load(path, config.CtlConfig)
    url = os.environ.get("LLMGW_ADMIN_URL") or cfg.admin_url
    key = os.environ.get("LLMGW_ADMIN_KEY") or cfg.admin_key
    if not key and cfg.admin_key_file is not None:
        try:
            key = cfg.admin_key_file.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{path}: admin_key_file: {exc.strerror or exc}") from None
    if not key:
        raise ConfigError(
            "no admin key: set LLMGW_ADMIN_KEY (the control plane wrote the first one to "
            "admin.key in its state directory) or admin_key in " + str(path)
        )
    return url.rstrip("/"), key


def api_get(args: argparse.Namespace, route: str) -> Any:
    return api(args, "GET", route)


def api(args: argparse.Namespace, method: str, route: str, body: Any = None) -> Any:
    """The answer's JSON; a refusal or a control plane out of reach is a `CtlError`."""
    url, key = settings(args)
    try:
        response = httpx.request(
            method,
            url + route,
            headers={"Authorization": f"Bearer {key}"},
            json=body,
            timeout=TIMEOUT_S,
        )
    except httpx.ConnectError:
        raise CtlError(f"cannot reach the control plane at {url} (connection refused)") from None
    except httpx.TimeoutException:
        raise CtlError(f"the control plane at {url} did not answer within {TIMEOUT_S} s") from None
    except httpx.HTTPError as exc:
        raise CtlError(f"cannot talk to the control plane at {url}: {exc}") from None
    if response.status_code == 401:
        raise CtlError(f"the control plane at {url} refused the admin key (401)")
    if response.status_code >= 400:
        standby = standby_message(response)
        if standby is not None:  # a write sent to a standby: name the leader, nothing else
            raise CtlError(standby)
        raise refused(route, response)
    return response.json()


def follow(args: argparse.Namespace, route: str) -> Generator[dict[str, Any], None, None]:
    """The items of `route` asked with follow=1 (one JSON object a line), as they come.

    A refusal names `route` as the operator's command asked for it, without follow=1.
    The caller closes it (`.close()`) when it stops reading early."""
    url, key = settings(args)
    followed = route + ("&" if "?" in route else "?") + "follow=1"
    try:
        with httpx.stream(
            "GET", url + followed, headers={"Authorization": f"Bearer {key}"},
            timeout=FOLLOW_TIMEOUT,
        ) as response:  # fmt: skip
            if response.status_code >= 400:
                response.read()
                raise refused(route, response)
            for raw in response.iter_lines():
                if raw.strip():
                    yield json.loads(raw)
    except httpx.TimeoutException:
        raise CtlError(f"the control plane at {url} sent nothing for 30 s") from None
    except httpx.HTTPError as exc:
        raise CtlError(f"following logs from the control plane at {url}: {exc}") from None


def refused(route: str, response: httpx.Response) -> CtlError:
    """`ROUTE: STATUS: MESSAGE`, the message from the API's error body (or the text's start)."""
    try:
        message = response.json()["error"]["message"]
    except Exception:
        message = response.text[:200]
    return CtlError(f"{route}: {response.status_code}: {message}")


def standby_message(response: httpx.Response) -> str | None:
    """A standby's 409 ("standby; leader is H:P (admin H:P)"), or None for any other error."""
    if response.status_code != 409:
        return None
    try:
        error = response.json().get("error")
    except Exception:
        return None
    if isinstance(error, dict):
        error = error.get("message")
    # A string: a control plane from before the error body was the same for every refusal.
    return error if isinstance(error, str) and error.startswith("standby;") else None


def leader_line(args: argparse.Namespace) -> str | None:
    """`control plane: leader, epoch 7` / `control plane: standby; leader is H:P (admin H:P)`;
    None from a control plane that predates the leader route."""
    try:
        data = api(args, "GET", "/api/v1/leader")
    except CtlError:
        return None
    role, epoch, leader = data.get("role"), data.get("epoch"), data.get("leader")
    if role == "standby":
        if isinstance(leader, dict):
            rpc, admin = leader.get("rpc"), leader.get("admin")
            return f"control plane: standby; leader is {rpc} (admin {admin})"
        return "control plane: standby; no leader yet"
    return f"control plane: {role}, epoch {epoch}"
