"""os-release(5): which distribution a machine runs, for its package family and its report.

Pure: the text of /etc/os-release (or /usr/lib/os-release) in, an `OsRelease`
out; anything that cannot be read raises `ParseError(source, problem)`.
"""

from __future__ import annotations

import re

import attrs

from llmgw.errors import ParseError

__all__ = ["OsRelease", "parse_os_release"]


@attrs.frozen
class OsRelease:
    id: str | None
    id_like: tuple[str, ...]
    version_id: str | None
    pretty_name: str | None = None


_ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)")


def _unquote(value: str, source: str, key: str) -> str:
    value = value.strip()
    if value[:1] in ('"', "'"):
        quote = value[0]
        if len(value) < 2 or value[-1] != quote:
            raise ParseError(source, f"{key} has an unterminated quote: {value[:80]!r}")
        inner = value[1:-1]
        if quote == '"':
            # os-release(5): \" \\ \$ \` are the escapes inside double quotes.
            inner = re.sub(r'\\([\\"$`])', r"\1", inner)
        return inner
    return value


def parse_os_release(text: str, *, source: str = "/etc/os-release") -> OsRelease:
    """id, id_like and version_id from os-release(5): quoted or not, comments, blanks."""
    values: dict[str, str] = {}
    for ln in text.splitlines():
        s = ln.strip()
        if not s or s.startswith("#"):
            continue
        m = _ASSIGN.fullmatch(s)
        if m is None:
            raise ParseError(source, f"line is not KEY=value: {s[:80]!r}")
        values[m.group(1)] = _unquote(m.group(2), source, m.group(1))
    if not values:
        raise ParseError(source, "no KEY=value lines")
    return OsRelease(
        id=values.get("ID") or None,
        id_like=tuple(values.get("ID_LIKE", "").split()),
        version_id=values.get("VERSION_ID") or None,
        pretty_name=values.get("PRETTY_NAME") or None,
    )
