"""The dashboard's pages, made in one place so links and switches name the same objects."""

from __future__ import annotations

from typing import Any

import streamlit as st

# (name, title, icon, script relative to dashboard/app.py); the name is the page's URL path.
PAGE_SPECS = (
    ("live", "Live", ":material/monitoring:", "views/live.py"),
    ("new", "New run", ":material/rocket_launch:", "views/new_run.py"),
    ("runs", "Runs", ":material/table_rows:", "views/runs.py"),
    ("compare", "Compare", ":material/compare_arrows:", "views/compare.py"),
    ("sweep", "Sweep", ":material/grid_view:", "views/sweep.py"),
)
DEFAULT = "live"
# Live is the default page, served at `/`; Streamlit still reserves the default page's own path, so it
# gets one nobody types, and `/live` is a hidden second page on the same script.
DEFAULT_URL_PATH = "overview"


def page(name: str) -> Any:
    for spec_name, title, icon, script in PAGE_SPECS:
        if spec_name == name:
            default = name == DEFAULT
            return st.Page(script, title=title, icon=icon, url_path=DEFAULT_URL_PATH if default else name,
                           default=default)
    raise KeyError(name)


def pages() -> list[Any]:
    spec = next(s for s in PAGE_SPECS if s[0] == DEFAULT)
    alias = st.Page(spec[3], title=spec[1], icon=spec[2], url_path=DEFAULT, visibility="hidden")
    return [page(s[0]) for s in PAGE_SPECS] + [alias]


def go(name: str, **query: str | list[str]) -> None:
    st.switch_page(page(name), query_params=query or None)
