"""mkdocs hooks (mkdocs.yml ``hooks:``): pages that may or may not exist yet.

Later changes add ``docs/topologies.md``, ``docs/reliability.md`` and
``docs/observability.md``.  Naming a missing page in ``nav`` fails
``mkdocs build --strict``, and an existing page left out of it is reported
as omitted; so each is appended to its nav section here when its file exists.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

#: (nav section, title, file) of pages listed only when present
OPTIONAL_PAGES = [
    ("Guides", "Deployment topologies", "topologies.md"),
    ("Design notes", "Reliability", "reliability.md"),
    ("Guides", "Observability", "observability.md"),
]


def on_config(config: Any) -> Any:
    docs = Path(config["docs_dir"])
    nav = config["nav"]
    for section, title, file in OPTIONAL_PAGES:
        if not (docs / file).is_file():
            continue
        for entry in nav:
            if isinstance(entry, dict) and section in entry:
                pages = entry[section]
                if not any(file in item.values() for item in pages if isinstance(item, dict)):
                    pages.append({title: file})
                break
        else:
            nav.append({title: file})
    return config


# Docstrings use Sphinx roles (:class:`~sa_fence.Lease`), which mkdocstrings
# leaves as text in front of the code span: show the code span alone, with
# the last dotted part for a "~" target, as Sphinx would.
_ROLE = re.compile(r":(?:class|func|meth|data|attr|mod|exc|obj):<code>(~?)([\w.]+)</code>")


def _role(match: re.Match[str]) -> str:
    target = match.group(2)
    return f"<code>{target.rsplit('.', 1)[-1] if match.group(1) else target}</code>"


def on_page_content(html: str, **_: Any) -> str:
    return _ROLE.sub(_role, html)
