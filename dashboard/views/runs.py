"""Runs: every run with filters, sort and pages; edit, open, clone, export, delete; pick runs to compare."""

from __future__ import annotations

import streamlit as st
from sqlalchemy.orm import Session

from ddpdash.dashboard import history, nav, state
from ddpdash.dashboard.text import md_escape
from ddpdash.db.queries import count_runs, export_points, run_filter_options
from ddpdash.db.runs import RunNotFound, clean_tags, get_run, update_run
from ddpdash.db.vocab import RunStatus
from ddpdash.trainer.control import DeleteError, delete_run

PAGE_SIZE = 50


@st.cache_data(ttl=2, show_spinner=False)
def _runs_frame(url: str, version: int):  # type: ignore[no-untyped-def]
    """Every run (the grouping by sweep needs them all); both arguments are part of the cache key: an edit
    bumps `version`, and the table is read again."""
    with Session(state.engine()) as s:
        return history.runs_frame(s)


def _page(f: history.RunFilter, sort_by: str, descending: bool, page: int) -> history.RunsPage:
    with Session(state.engine()) as s:
        return history.runs_page(s, f, sort_by, descending, page, PAGE_SIZE)


def _export(run_id: int, fmt: str) -> str:
    """Built when the user presses the button (Streamlit calls it then), not on every rerun."""
    with Session(state.engine()) as s:
        return export_points(s, run_id, fmt)


def _bump() -> None:
    st.session_state["_runs_version"] = st.session_state.get("_runs_version", 0) + 1


def render() -> None:
    st.title("Runs")
    state.reconcile_runs()
    with Session(state.engine()) as s:
        options, total = run_filter_options(s), count_runs(s)
    if not total:
        st.info("No runs yet.")
        st.page_link(nav.page("new"), label="New run", icon=":material/rocket_launch:")
        return
    f = _filters(options)
    if st.toggle("Group by sweep", help="One row per sweep; open one to see its grid, bands and scaling study"):
        df = _runs_frame(str(state.engine().url), st.session_state.get("_runs_version", 0))
        _sweeps(history.filter_runs(df, f))
        return
    c1, c2, c3 = st.columns([2, 1, 1])
    sort_by = c1.selectbox("Sort by", history.SORTABLE, index=0)
    descending = c2.toggle("Descending", value=True)
    page = int(c3.number_input("Page", min_value=1, value=1, step=1))
    listing = _page(f, sort_by, descending, page)
    page_df = shown = listing.rows
    st.caption(f"{listing.matched} of {listing.total} runs; page {min(page, listing.pages)} of {listing.pages}")
    event = st.dataframe(
        page_df, hide_index=True, width="stretch", on_select="rerun", selection_mode="multi-row",
        key="runs_table",
        column_config={
            "slurm": "Slurm" if page_df["slurm"].any() else None,  # hidden where no run went to Slurm
            "started": st.column_config.DatetimeColumn("started", format="YYYY-MM-DD HH:mm:ss"),
            "duration_s": st.column_config.NumberColumn("duration (s)", format="%.0f"),
            "final_loss": st.column_config.NumberColumn("final loss", format="%.4g"),
            "best_loss": st.column_config.NumberColumn("best loss", format="%.4g"),
            "samples_per_s": st.column_config.NumberColumn("samples/s", format="%.0f"),
            "comm_share": st.column_config.NumberColumn(
                "comm share", format="percent",
                help="The median share of a step the backward's all-reduce took (DDP's sampled timings)"),
        },
    )
    selected = [int(page_df.iloc[i]["id"]) for i in event.selection.rows] if event and event.selection else []
    labels = dict(zip(shown["id"].astype(int), "#" + shown["id"].astype(str) + " " + shown["name"], strict=True))
    st.caption("Tick rows in the table (or pick them below): one to edit, export or delete; two or more to compare.")
    left, right = st.columns([3, 1], vertical_alignment="bottom")
    to_compare = left.multiselect("Compare runs", list(labels), default=[i for i in selected if i in labels],
                                  format_func=labels.get, max_selections=history.MAX_COMPARE, key="compare_pick")
    if right.button("Compare", type="primary", icon=":material/compare_arrows:", disabled=len(to_compare) < 2):
        nav.go("compare", runs=",".join(str(i) for i in to_compare))
    one = st.selectbox("Manage run", list(labels), index=list(labels).index(selected[0]) if len(selected) == 1
                       and selected[0] in labels else None, format_func=labels.get, placeholder="choose a run…",
                       key="manage_pick")
    if one is not None:
        _one_run(int(one))


def _filters(options: dict[str, list[str]]) -> history.RunFilter:
    c1, c2, c3, c4, c5, c6 = st.columns([2, 2, 2, 1, 2, 2])
    statuses = c1.multiselect("Status", RunStatus.ALL)
    models = c2.multiselect("Model", options["trains"])
    backends = c3.multiselect("Backend", options["backends"])
    tag = c4.selectbox("Tag", ["", *options["tags"]])
    sweep = c5.selectbox("Sweep", ["", *options["sweeps"]])
    text = c6.text_input("Search name and notes")
    return history.RunFilter(tuple(statuses), tuple(models), tuple(backends), tag or "", text, sweep or "")


def _sweeps(shown) -> None:  # type: ignore[no-untyped-def]
    table = history.sweeps_frame(shown)
    if table.empty:
        st.info("No sweeps among these runs: `ddpdash sweep --grid …` or New run's Sweep section makes one.")
        return
    st.dataframe(table, hide_index=True, width="stretch",
                 column_config={"best_final_loss": st.column_config.NumberColumn("best final loss", format="%.4g"),
                                "started": st.column_config.DatetimeColumn("started", format="YYYY-MM-DD HH:mm")})
    name = st.selectbox("Open sweep", table["sweep"].tolist(), index=None, placeholder="choose a sweep…")
    if name:
        nav.go("sweep", sweep=name)


def _one_run(run_id: int) -> None:
    engine = state.engine()
    try:
        with Session(engine) as s:
            run = get_run(s, run_id)
    except RunNotFound:
        st.info(f"Run {run_id} was deleted meanwhile.")
        return
    st.subheader(f"#{run.id} {md_escape(run.name)}")
    with st.form(f"edit_{run.id}"):
        name = st.text_input("Name", value=run.name, max_chars=200)
        tags = st.text_input("Tags (comma-separated)", value=", ".join(run.tags))
        notes = st.text_area("Notes", value=run.notes)
        if st.form_submit_button("Save"):
            if not name.strip():
                st.error("Name must not be empty.")
            else:
                with Session(engine) as s, s.begin():
                    update_run(s, run.id, name=name.strip(), tags=clean_tags(tags.split(",")), notes=notes)
                _bump()
                st.rerun()
    c1, c2, c3, c4, c5 = st.columns(5)
    if c1.button("Open Live", icon=":material/monitoring:"):
        nav.go("live", run=str(run.id))
    if c2.button("Clone into New run", icon=":material/content_copy:"):
        nav.go("new", clone=str(run.id))
    c3.download_button("Export CSV", lambda: _export(run.id, "csv"), file_name=f"run-{run.id}.csv",
                       mime="text/csv")
    c4.download_button("Export JSON", lambda: _export(run.id, "json"), file_name=f"run-{run.id}.json",
                       mime="application/json")
    with c5.popover("Delete", icon=":material/delete:", disabled=run.is_active,
                    help="Stop the run first" if run.is_active else None):
        st.write(f"Delete run #{run.id} with its metrics, events, logs and checkpoints? This cannot be undone.")
        if st.button("Yes, delete it", type="primary", key=f"delete_{run.id}"):
            try:
                delete_run(engine, run.id)
            except DeleteError as exc:
                st.error(str(exc))
            else:
                _bump()
                st.rerun()


if __name__ == "__main__":  # run as a page by st.navigation
    render()
