"""The dashboard's pages, made in one place so links and switches name the same objects."""

from __future__ import annotations

from typing import Any

import streamlit as st

# (url path, title, icon, script relative to dashboard/app.py)
PAGE_SPECS = (
    ("live", "Live", ":material/monitoring:", "views/live.py"),
    ("new", "New run", ":material/rocket_launch:", "views/new_run.py"),
    ("runs", "Runs", ":material/table_rows:", "views/runs.py"),
    ("compare", "Compare", ":material/compare_arrows:", "views/compare.py"),
)


def page(name: str) -> Any:
    for url_path, title, icon, script in PAGE_SPECS:
        if url_path == name:
            return st.Page(script, title=title, icon=icon, url_path=url_path, default=url_path == "live")
    raise KeyError(name)


def pages() -> list[Any]:
    return [page(spec[0]) for spec in PAGE_SPECS]


def go(name: str, **query: str | list[str]) -> None:
    st.switch_page(page(name), query_params=query or None)
