"""Compare: 2–10 runs side by side — overlaid loss, throughput and scaling, config diff, summary."""

from __future__ import annotations

import streamlit as st
from sqlalchemy.orm import Session

from ddpdash.dashboard import charts, history, state
from ddpdash.db.runs import list_runs


def render() -> None:
    st.title("Compare")
    engine = state.engine()
    with Session(engine) as s:
        runs = list_runs(s, limit=500)
    labels = {r.id: history.run_label(r) for r in runs}
    wanted = [i for i in history.parse_run_ids(st.query_params.get_all("runs")) if i in labels]
    chosen = st.multiselect("Runs (2 to 10)", list(labels), default=wanted, format_func=lambda i: labels[i],
                            max_selections=history.MAX_COMPARE)
    if chosen:
        st.query_params["runs"] = ",".join(str(i) for i in chosen)  # a link reopens this comparison
    if len(chosen) < 2:
        st.info("Choose at least two runs (or select them on the Runs page and press Compare).")
        return
    with Session(engine) as s:
        comp = history.load_comparison(s, chosen)

    c1, c2, c3, c4 = st.columns(4)
    x_axis = c1.selectbox("x-axis", list(history.X_AXES), format_func=lambda k: history.X_AXES[k])
    lines = c2.radio("Lines", ["each run, min–max over ranks", "each rank", "each group, band across runs"],
                     help="A group: a sweep's grid point (its seeds), or the group set by hand (--group)")
    smoothing = c3.slider("Smoothing", 0.0, 0.99, 0.0, 0.01)
    log_scale = c4.toggle("Log scale")
    if lines.startswith("each group"):
        band = c4.radio("Band", list(history.BANDS), format_func=history.BANDS.get)
        overlay, legend = history.group_frame(comp, x_axis, band), "group"
    else:
        overlay, legend = history.overlay_frame(comp, x_axis, per_rank=lines == "each rank"), "run"
    st.altair_chart(charts.overlay_chart(overlay, history.X_AXES[x_axis], smoothing, log_scale,
                                         band=lines != "each rank", legend=legend), width="stretch")

    st.subheader("Summary")
    target = st.number_input("Target loss", value=None, min_value=0.0, format="%g",
                             placeholder="type a loss to see time and samples to reach it")
    st.dataframe(history.summary_table(comp, target), hide_index=True, width="stretch",
                 column_config={"final_loss": st.column_config.NumberColumn(format="%.4g"),
                                "best_loss": st.column_config.NumberColumn(format="%.4g"),
                                "samples_per_s": st.column_config.NumberColumn(format="%.0f"),
                                "comm_share": st.column_config.NumberColumn("comm share", format="percent"),
                                "total_time_s": st.column_config.NumberColumn(format="%.1f")})

    left, right = st.columns(2)
    summary = history.summary_table(comp)
    left.altair_chart(charts.throughput_bars(summary[["run", "samples_per_s"]].dropna()), width="stretch")
    scaling = history.scaling_table(comp)
    with right:
        if scaling.empty:
            st.caption("Scaling efficiency appears when the chosen runs share a config and differ in world size.")
        else:
            st.altair_chart(charts.scaling_chart(scaling), width="stretch")
            st.dataframe(scaling, hide_index=True, width="stretch",
                         column_config={"efficiency": st.column_config.ProgressColumn(format="percent",
                                                                                      min_value=0, max_value=1)})

    st.subheader("Config diff")
    diff = history.config_diff(comp.runs)
    if diff.empty:
        st.caption("The chosen runs have identical settings.")
    else:
        st.dataframe(diff, hide_index=True, width="stretch")
        st.caption(f"{len(diff)} setting(s) differ; identical ones are folded away.")


if __name__ == "__main__":  # run as a page by st.navigation
    render()
