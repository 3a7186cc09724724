"""Sweep: one sweep's runs — settings → results, each grid point's loss as a band across its seeds, and
the scaling study when the sweep varies the world size. `?sweep=NAME` reopens it."""

from __future__ import annotations

import streamlit as st
from sqlalchemy.orm import Session

from ddpdash.dashboard import charts, history, nav, state
from ddpdash.dashboard.text import md_escape
from ddpdash.db.runs import list_sweeps
from ddpdash.trainer.control import StopError, stop_sweep


def render() -> None:
    st.title("Sweep")
    state.reconcile_runs()
    engine = state.engine()
    with Session(engine) as s:
        names = list_sweeps(s)
    if not names:
        st.info("No sweeps yet: start one from New run (its Sweep section) or `ddpdash sweep --grid …`.")
        return
    wanted = st.query_params.get("sweep")
    name = st.selectbox("Sweep", names, index=names.index(wanted) if wanted in names else 0)
    st.query_params["sweep"] = name
    with Session(engine) as s:
        comp = history.load_sweep(s, name)
    active = [r for r in comp.runs if r.is_active]
    left, right = st.columns([4, 1])
    left.caption(f"{len(comp.runs)} run(s); {len(active)} queued or running")
    if active:
        with right.popover("Stop sweep", icon=":material/stop_circle:", width="stretch"):
            st.write(f"Stop every run of {md_escape(name)}: queued ones are cancelled, running ones stopped.")
            if st.button("Yes, stop them", type="primary"):
                try:
                    stop_sweep(engine, name)
                except StopError as exc:
                    st.error(str(exc))
                st.rerun()

    c1, c2, c3 = st.columns(3)
    x_axis = c1.selectbox("x-axis", list(history.X_AXES), format_func=lambda k: history.X_AXES[k])
    band = c2.radio("Band across a grid point's runs", list(history.BANDS), format_func=history.BANDS.get,
                    horizontal=True)
    target = c3.number_input("Target loss", value=None, min_value=0.0, format="%g",
                             placeholder="time and samples to reach it")
    groups = history.group_frame(comp, x_axis, band)
    st.altair_chart(charts.overlay_chart(groups, history.X_AXES[x_axis], band=True, legend="grid point"),
                    width="stretch")

    st.subheader("Settings → results")
    table = history.sweep_table(comp, target)
    st.dataframe(table, hide_index=True, width="stretch",
                 column_config={"final_loss": st.column_config.NumberColumn(format="%.4g"),
                                "best_loss": st.column_config.NumberColumn(format="%.4g"),
                                "samples_per_s": st.column_config.NumberColumn(format="%.0f"),
                                "total_time_s": st.column_config.NumberColumn(format="%.1f"),
                                "time_to_target_s": st.column_config.NumberColumn(format="%.1f")})
    pick = st.multiselect("Compare runs of this sweep", table["id"].tolist(), max_selections=history.MAX_COMPARE)
    if st.button("Compare", disabled=len(pick) < 2):
        nav.go("compare", runs=",".join(str(i) for i in pick))

    st.subheader("Scaling study")
    study = history.scaling_study(comp, target)
    if study.empty:
        st.caption("The scaling study appears when the sweep varies the world size (--grid num_procs=1,2,4).")
        return
    a, b = st.columns(2)
    a.altair_chart(charts.scaling_chart(study.assign(run=study["setting"])), width="stretch")
    if study["time_to_target_s"].notna().any():
        b.altair_chart(charts.by_world_size(study, "time_to_target_s", "seconds to the target loss"),
                       width="stretch")
    else:
        b.caption("Type a target loss to see the time and samples to reach it at each world size.")
    st.dataframe(study, hide_index=True, width="stretch",
                 column_config={"efficiency": st.column_config.ProgressColumn(format="percent", min_value=0,
                                                                              max_value=1),
                                "samples_per_s": st.column_config.NumberColumn(format="%.0f"),
                                "ideal_samples_per_s": st.column_config.NumberColumn(format="%.0f"),
                                "effective_lr": st.column_config.NumberColumn(format="%g")})
    st.caption("Each point: the mean over its seeds. The global batch grows with the world size, and with the "
               "linear scaling rule so does the effective lr: compare the samples to the target across sizes.")


if __name__ == "__main__":  # run as a page by st.navigation
    render()
