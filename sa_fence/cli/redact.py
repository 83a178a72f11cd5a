"""Passwords out of the URLs, and out of any text, the tools print.

Two kinds of secret are hidden, whether or not the text parses as a URL:

* the password of a userinfo, ``user:password@`` (``postgresql://u:pw@h/db``,
  but also ``postgresql+psycopg//u:pw@h/db``, a colon short): everything
  between the first ``:`` after the ``//`` (or the start) and the last ``@``;
* a ``password=`` parameter (``?password=pw``, ``&sslpassword=pw``,
  ``password=pw`` in a libpq conninfo).

Each becomes ``***``.  The rule errs on hiding too much: text that merely
looks like ``a:b@c`` loses its ``b``.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

__all__ = ["redact_text", "redact_url"]

#: ``password=...`` and the like (``sslpassword``, ``passwd``, ``pwd``), up to ``&``,
#: ``;``, whitespace or a quote
_PASSWORD_PARAMETER = re.compile(r"(?i)(\b[\w.-]*pass(?:word|wd)?=|\bpwd=)[^&;\s'\"]+")
_WHITESPACE = re.compile(r"(\s+)")
HIDDEN = "***"


def _hide_userinfo(text: str) -> str:
    """``text`` taken as one URL-like string, the password of its userinfo hidden."""
    head, at, tail = text.rpartition("@")
    if not at:
        return text
    slashes = head.find("//")
    start = slashes + 2 if slashes >= 0 else 0
    colon = head.find(":", start)
    if colon < 0 or colon == len(head) - 1:  # a user name alone is no secret
        return text
    return f"{head[: colon + 1]}{HIDDEN}@{tail}"


def _hide_parameters(text: str) -> str:
    return _PASSWORD_PARAMETER.sub(lambda m: m.group(1) + HIDDEN, text)


def redact_text(text: str) -> str:
    """Any text (an error message, argparse's) with every password in it hidden: each
    whitespace-separated word is read as a possible URL (see the module)."""
    words = _WHITESPACE.split(str(text))
    return _hide_parameters("".join(w if "@" not in w else _hide_userinfo(w) for w in words))


def redact_url(url: object) -> str:
    """``url`` (a Redis or database URL, or a SQLAlchemy ``URL``, parsable or not) with
    its password shown as ``***``: every URL a tool prints goes through this."""
    text = url.render_as_string(hide_password=True) if hasattr(url, "render_as_string") else url
    text = str(text)
    try:
        netloc = urlsplit(text).netloc
    except ValueError:  # (a bad IPv6 address) mere text then
        netloc = ""
    if "@" in netloc:  # parsed: hide the password as the parsers read it, keep the rest
        start = text.index(netloc)  # (its "@" keeps it out of the scheme)
        before, rest = text[:start], text[start + len(netloc) :]
        user, _, host = netloc.rpartition("@")
        name, colon, _ = user.partition(":")
        text = f"{before}{name}:{HIDDEN}@{host}{rest}" if colon else text
    else:
        rest = text
    if "@" in rest:  # not parsed, or an "@" after the host: the whole string as one URL
        text = _hide_userinfo(text)
    return _hide_parameters(text)
