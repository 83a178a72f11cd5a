"""Passwords out of the URLs the tools print."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def redact_url(url: object) -> str:
    """``url`` (a Redis or database URL, or a SQLAlchemy ``URL``) with its password
    shown as ``***``: every URL a tool prints goes through this."""
    text = url.render_as_string(hide_password=True) if hasattr(url, "render_as_string") else url
    text = str(text)
    try:
        parts = urlsplit(text)
        password = parts.password
    except ValueError:  # not a URL at all: show nothing that could be a secret in it
        return "<unparsable URL>"
    if not password:
        return text
    user, _, host = parts.netloc.rpartition("@")
    name = user.split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{name}:***@{host}"))
