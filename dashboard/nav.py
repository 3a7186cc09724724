"""The dashboard's pages, made in one place so links and switches name the same objects."""

from __future__ import annotations

from typing import Any

import streamlit as st

PAGE_SPECS = (
    ("live", "Live", ":material/monitoring:", "dashboard.views.live"),
    ("new", "New run", ":material/rocket_launch:", "dashboard.views.new_run"),
    ("runs", "Runs", ":material/table_rows:", "dashboard.views.runs"),
    ("compare", "Compare", ":material/compare_arrows:", "dashboard.views.compare"),
)


def page(name: str) -> Any:
    import importlib

    for url_path, title, icon, module in PAGE_SPECS:
        if url_path == name:
            render = importlib.import_module(module).render
            return st.Page(render, title=title, icon=icon, url_path=url_path, default=url_path == "live")
    raise KeyError(name)


def pages() -> list[Any]:
    return [page(spec[0]) for spec in PAGE_SPECS]


def go(name: str, **query: str | list[str]) -> None:
    st.switch_page(page(name), query_params=query or None)
