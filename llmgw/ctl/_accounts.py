"""`llmgw ctl` on who may use the router: keys, tenants and their limits, usage, audit.

Each command takes the parsed arguments (their flags are in `_args`), asks the
admin API, prints, and returns the exit code. The spans and dates the flags take
(`--since 7d`, `--expires 2026-12-31`) are read here, before anything is asked.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import time
from typing import Any
from urllib.parse import quote, urlencode

from llmgw.ctl._client import CtlError, api, api_get
from llmgw.ctl._tables import format_audit, format_keys, format_tenants, format_usage, when

_DURATION = re.compile(r"^(\d+)([mhd])$")
_UNIT_S = {"m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, what: str) -> float:
    """90m, 24h, 7d -> seconds."""
    found = _DURATION.match(text.strip())
    if found is None or int(found.group(1)) == 0:
        raise CtlError(f"{what}: {text!r} is not a time span; expected minutes, hours or days "
                       "such as 90m, 24h, 7d")  # fmt: skip
    return int(found.group(1)) * _UNIT_S[found.group(2)]


def parse_expires(text: str, *, now: float) -> float:
    """--expires: a span from now (30d) or a date or ISO time (UTC unless it says)."""
    if _DURATION.match(text.strip()):
        return now + parse_duration(text, "--expires")
    try:
        at_time = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise CtlError(f"--expires: {text!r} is neither a time span (90m, 24h, 30d) nor a date "
                       "(2026-12-31) or ISO time (2026-12-31T18:00+01:00)") from None  # fmt: skip
    if at_time.tzinfo is None:
        at_time = at_time.replace(tzinfo=datetime.UTC)
    at = at_time.timestamp()
    if at <= now:
        raise CtlError(f"--expires: {text} ({when(at)}) is not in the future")
    return at


# --- keys ------------------------------------------------------------------------------


def keys_create(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"tenant": args.tenant, "default_band": args.band, "name": args.name}
    if args.models:
        body["models"] = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.max_band:
        body["max_band"] = args.max_band
    if args.expires is not None:
        body["expires_at"] = parse_expires(args.expires, now=time.time())
    data = api(args, "POST", "/api/v1/keys", body)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    key = data["key"]
    if data.get("tenant_created"):
        print(f"tenant {key['tenant']} did not exist: created with no limits "
              f"(set some with `llmgw ctl tenants set {key['tenant']}`)")  # fmt: skip
    expiry = "" if key.get("expires_at") is None else f", expires {when(key['expires_at'])}"
    print(f"key {key['key_id']} for tenant {key['tenant']} (max band {key['max_band']}{expiry});"
          " its secret (shown only now):")  # fmt: skip
    print(data["secret"])
    return 0


def keys_list(args: argparse.Namespace) -> int:
    data = api(args, "GET", "/api/v1/keys")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(format_keys(data["keys"]))
    return 0


def keys_revoke(args: argparse.Namespace) -> int:
    api(args, "DELETE", f"/api/v1/keys/{args.key_id}")
    print(f"{args.key_id} revoked")
    return 0


# --- tenants ---------------------------------------------------------------------------


def _limit_arg(value: str | None, what: str, *, none_ok: bool) -> tuple[bool, int | None]:
    """(given, value) for --rpm/--tpm: a count, or `none` (set only) to lift it."""
    if value is None:
        return False, None
    if none_ok and value.strip().lower() == "none":
        return True, None
    if not value.strip().isdigit():
        lift = " or none" if none_ok else ""
        raise CtlError(f"--{what}: {value!r} is not a count >= 0{lift}")
    return True, int(value)


def _limits_body(args: argparse.Namespace, *, none_ok: bool) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for field in ("rpm", "tpm"):
        given, value = _limit_arg(getattr(args, field), field, none_ok=none_ok)
        if given:
            body[field] = value
    if args.max_band is not None:
        lift = none_ok and args.max_band.strip().lower() == "none"
        body["max_band"] = None if lift else args.max_band
    return body


def tenants_list(args: argparse.Namespace) -> int:
    data = api_get(args, "/api/v1/tenants")
    if args.json:
        print(json.dumps(data, indent=2))
    elif not data["tenants"]:
        print("no tenants (llmgw ctl tenants create NAME)")
    else:
        print(format_tenants(data["tenants"]))
        print("(- : no limit; KEYS: keys neither revoked nor expired)")
    return 0


def tenants_create(args: argparse.Namespace) -> int:
    body = {"name": args.name, **_limits_body(args, none_ok=False)}
    data = api(args, "POST", "/api/v1/tenants", body)
    print(json.dumps(data, indent=2) if args.json else format_tenants([data["tenant"]]))
    return 0


def tenants_set(args: argparse.Namespace) -> int:
    body = _limits_body(args, none_ok=True)
    if not body:
        raise CtlError("tenants set: nothing to change; give --rpm, --tpm or --max-band")
    data = api(args, "PATCH", f"/api/v1/tenants/{quote(args.name, safe='')}", body)
    print(json.dumps(data, indent=2) if args.json else format_tenants([data["tenant"]]))
    return 0


def tenants_delete(args: argparse.Namespace) -> int:
    api(args, "DELETE", f"/api/v1/tenants/{quote(args.name, safe='')}")
    print(f"tenant {args.name} deleted")
    return 0


# --- what was done ---------------------------------------------------------------------


def usage(args: argparse.Namespace) -> int:
    query = [("since", str(int(parse_duration(args.since, "--since"))))]
    if args.tenant:
        query.append(("tenant", args.tenant))
    data = api_get(args, "/api/v1/usage?" + urlencode(query))
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(format_usage(data["rows"], data["totals"]))
    return 0


def audit(args: argparse.Namespace) -> int:
    data = api_get(args, f"/api/v1/audit?limit={args.limit}")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(format_audit(data["entries"]))
    return 0
