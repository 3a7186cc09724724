"""Per-process resources for the dashboard: the engine (made once), the machine, throttled reconciliation."""

from __future__ import annotations

import streamlit as st
from sqlalchemy import Engine

from ddpdash.db.engine import default_db_url
from ddpdash.db.migrate import StoreError, open_store
from ddpdash.trainer.config import Machine, detect_machine
from ddpdash.trainer.control import reconcile


@st.cache_resource(show_spinner=False)
def _engine(url: str) -> Engine:
    return open_store(url)


def engine() -> Engine:
    """One engine per database URL for the whole server process; a store that cannot be opened is one
    message on the page (and the page stops), not a traceback."""
    try:
        return _engine(default_db_url())
    except StoreError as exc:
        st.error(f"The database cannot be used: {exc}")
        st.stop()
        raise  # st.stop() does not return


@st.cache_resource(show_spinner="Looking for GPUs…")
def machine() -> Machine:
    return detect_machine()


@st.cache_data(ttl=60, show_spinner=False)
def slurm_target() -> tuple[str | None, list[str]]:
    """Why Slurm is not offered here (None: it is), and the cluster's partitions, default first."""
    from ddpdash.trainer.control import slurm_missing, slurm_partitions

    why = slurm_missing()
    return why, [] if why else slurm_partitions()


@st.cache_data(ttl=3, show_spinner=False)
def _reconcile_now(url: str) -> list[int]:
    return reconcile(engine())


def reconcile_runs() -> list[int]:
    """Any reader of runs notices runs whose supervisor is gone (at most every few seconds)."""
    return _reconcile_now(str(engine().url))
