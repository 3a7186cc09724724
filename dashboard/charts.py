"""Chart builders: DataFrame in, Altair chart out. No Streamlit, no database.

Input frames are what db.queries.metric_series returns: rank, step, value (bucket mean), vmin, vmax,
time, count — already at most a few thousand points per rank."""

from __future__ import annotations

from collections.abc import Sequence

import altair as alt
import numpy as np
import pandas as pd

MEAN_LABEL = "mean of ranks"
MAX_RANK_LINES = 8  # more ranks than this: their mean, the band of every rank (its edges), and the ranks picked
LOW_LABEL, HIGH_LABEL = "min of all ranks", "max of all ranks"
TOTAL_LABEL = "total"
CHART_HEIGHT = 260
# Zoom and pan along steps: one parameter, made once and added to every chart (a chart has one, so
# one name serves). `.interactive()` made and validated a new one per chart, and named it by hashing
# its spec: ≈ 4 ms a chart, three charts on every Live refresh.
ZOOM = alt.selection_interval(name="zoom", bind="scales", encodings=["x"])


def series_label(rank: int) -> str:
    return f"rank {int(rank)}"


def ema(values: pd.Series, smoothing: float) -> pd.Series:
    """TensorBoard-style smoothing: 0 leaves the curve alone, 0.99 nearly flattens it."""
    if smoothing <= 0:
        return values
    return values.ewm(alpha=1 - min(smoothing, 0.999), adjust=True).mean()


def per_rank_with_aggregate(df: pd.DataFrame, how: str, label: str, smoothing: float = 0.0,
                            only: Sequence[int] | None = None) -> pd.DataFrame:
    """Long frame [series, kind, step, value] with one series per rank (or per rank in `only`) plus their
    mean (or sum) across every rank, ordered by series name, then step. In numpy: it runs for every chart
    on every Live refresh."""
    if df.empty:
        return pd.DataFrame(columns=["series", "kind", "step", "value"])
    rank = df["rank"].to_numpy(dtype=np.int64)
    step = df["step"].to_numpy(dtype=np.int64)
    value = df["value"].to_numpy(dtype=np.float64)
    steps, at = np.unique(step, return_inverse=True)
    known = ~np.isnan(value)  # as pandas: a rank's NaN (a diverged loss) is left out of the mean or sum
    combined = np.bincount(at, weights=np.where(known, value, 0.0), minlength=len(steps))
    if how == "mean":
        with np.errstate(invalid="ignore", divide="ignore"):
            combined /= np.bincount(at, weights=known, minlength=len(steps))
    elif how != "sum":
        raise ValueError(f"unknown aggregate {how!r}: mean or sum")
    ranks, which = np.unique(rank, return_inverse=True)
    names = [series_label(r) for r in ranks.tolist()] + [label]
    code = np.concatenate([which, np.full(len(steps), len(ranks))])
    place = np.argsort(np.argsort(names, kind="stable"))  # each series' place in name order, as a legend's
    order = np.lexsort((np.concatenate([step, steps]), place[code]))
    code = code[order]
    out = pd.DataFrame({
        "series": np.asarray(names, dtype=object)[code],
        "kind": np.where(code == len(ranks), "all ranks", "rank").astype(object),
        "step": np.concatenate([step, steps])[order],
        "value": np.concatenate([value, combined])[order],
    })
    if only is not None:
        out = out[(out["kind"] == "all ranks") | out["series"].isin([series_label(r) for r in only])]
    if smoothing > 0:
        out["value"] = out.groupby("series", sort=False)["value"].transform(lambda v: ema(v, smoothing))
    return out


def rank_band(df: pd.DataFrame) -> pd.DataFrame:
    """Per step, the lowest and the highest value of any rank, as two series of the long frame [series,
    kind, step, value]: many ranks drawn as the edges of their band (one chart, no layer: a layered chart
    costs Altair twice the time on every refresh)."""
    if df.empty:
        return pd.DataFrame(columns=["series", "kind", "step", "value"])
    by_step = df.groupby("step", sort=True)["value"]
    steps = by_step.min().index.to_numpy()
    return pd.DataFrame({"series": np.repeat([LOW_LABEL, HIGH_LABEL], len(steps)).astype(object),
                         "kind": "all ranks", "step": np.tile(steps, 2),
                         "value": np.concatenate([by_step.min().to_numpy(), by_step.max().to_numpy()])})


def _with_band(data: pd.DataFrame, df: pd.DataFrame, ranks: Sequence[int] | None) -> pd.DataFrame:
    """The lines to draw, and for many ranks (`ranks` picked) the edges of every rank's band."""
    return data if ranks is None or df.empty else pd.concat([data, rank_band(df)], ignore_index=True)


def _line(data: pd.DataFrame, y_title: str, log_scale: bool = False, x: str = "step",
          x_title: str = "step") -> alt.Chart:
    scale = alt.Scale(type="log") if log_scale else alt.Scale(zero=False)
    chart = (
        alt.Chart(data, height=CHART_HEIGHT)
        .mark_line(interpolate="linear")
        .encode(
            x=alt.X(f"{x}:Q", title=x_title),
            y=alt.Y("value:Q", title=y_title, scale=scale),
            color=alt.Color("series:N", title=None),
            # Plain field encodings: a condition here costs Altair ~20 ms of schema validation per chart.
            strokeDash=alt.StrokeDash("kind:N", legend=None),
            tooltip=[alt.Tooltip("series:N"), alt.Tooltip(f"{x}:Q", title=x_title),
                     alt.Tooltip("value:Q", format=".4g")],
        )
    )
    return chart.add_params(ZOOM)


def loss_chart(df: pd.DataFrame, smoothing: float = 0.0, log_scale: bool = False,
               ranks: Sequence[int] | None = None) -> alt.Chart:
    """Loss per rank and the mean across ranks; with `ranks` (many ranks), those ranks' lines only, and the
    lowest and highest of every rank at each step."""
    data = _with_band(per_rank_with_aggregate(df, "mean", MEAN_LABEL, smoothing, only=ranks), df, ranks)
    if log_scale:
        data = data[data["value"] > 0]
    return _line(data, "loss", log_scale).properties(title="Loss")


def throughput_chart(df: pd.DataFrame, unit: str = "samples/s", ranks: Sequence[int] | None = None) -> alt.Chart:
    """Throughput per rank (or the `ranks` picked, with every rank's lowest and highest) and in total."""
    data = _with_band(per_rank_with_aggregate(df, "sum", TOTAL_LABEL, only=ranks), df, ranks)
    return _line(data, unit).properties(title=f"Throughput ({unit})")


def timing_chart(step_time: pd.DataFrame, data_time: pd.DataFrame,
                 ranks: Sequence[int] | None = None) -> alt.Chart:
    """Compute time and data-wait time per step, per rank (seconds; the `ranks` picked, when many)."""
    frames = []
    for kind, df in (("step", step_time), ("data wait", data_time)):
        if ranks is not None:
            df = df[df["rank"].isin(ranks)]
        if not df.empty:
            part = df[["rank", "step", "value"]].copy()
            labels = {rank: f"{series_label(rank)} · {kind}" for rank in part["rank"].unique().tolist()}
            part["series"] = part["rank"].map(labels)  # a label per rank, not per point
            part["kind"] = kind
            frames.append(part)
    data = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["series", "step", "value", "kind"])
    return (
        alt.Chart(data, height=CHART_HEIGHT)
        .mark_line()
        .encode(
            x=alt.X("step:Q", title="step"),
            y=alt.Y("value:Q", title="seconds per step", scale=alt.Scale(zero=True)),
            color=alt.Color("series:N", title=None),
            strokeDash=alt.StrokeDash("kind:N", title=None),
            tooltip=[alt.Tooltip("series:N"), alt.Tooltip("step:Q"), alt.Tooltip("value:Q", format=".3g")],
        )
        .add_params(ZOOM)
        .properties(title="Step time and data wait")
    )


def points_per_series(chart: alt.Chart) -> dict[str, int]:
    """How many points each line sends to the browser (for tests and the point budget)."""
    data = chart.data if isinstance(chart.data, pd.DataFrame) else pd.DataFrame()
    return data.groupby("series").size().to_dict() if "series" in data else {}


def validation_chart(df: pd.DataFrame, what: str = "accuracy") -> alt.Chart:
    """Held-out accuracy or loss (rank 0, once per epoch)."""
    data = df[["step", "value"]].assign(series=f"validation {what}", kind="rank 0")
    return _line(data, f"validation {what}").properties(title=f"Validation {what}")


def overlay_chart(data: pd.DataFrame, x_title: str = "step", smoothing: float = 0.0, log_scale: bool = False,
                  band: bool = True, legend: str = "run") -> alt.LayerChart | alt.Chart:
    """Loss of several runs (or groups of runs: `legend`) on one axis, one colour each; the band behind each
    line (min–max over ranks, or the group's band across its runs)."""
    data = data.sort_values(["series", "x"]).copy()
    if smoothing > 0 and not data.empty:
        data["value"] = data.groupby("series")["value"].transform(lambda v: ema(v, smoothing))
    if log_scale:
        data = data[(data["value"] > 0) & (data["lo"] > 0)]
    scale = alt.Scale(type="log") if log_scale else alt.Scale(zero=False)
    base = alt.Chart(data, height=CHART_HEIGHT + 60)
    line = base.mark_line().encode(
        x=alt.X("x:Q", title=x_title),
        y=alt.Y("value:Q", title="loss", scale=scale),
        color=alt.Color("series:N", title=legend),
        tooltip=[alt.Tooltip("series:N", title=legend), alt.Tooltip("x:Q", title=x_title, format=",.4g"),
                 alt.Tooltip("value:Q", title="loss", format=".4g"),
                 alt.Tooltip("lo:Q", title="band low", format=".4g"),
                 alt.Tooltip("hi:Q", title="band high", format=".4g")],
    )
    if not band:
        return line.add_params(ZOOM).properties(title="Loss")
    area = base.mark_area(opacity=0.15).encode(x="x:Q", y=alt.Y("lo:Q", scale=scale), y2="hi:Q",
                                               color=alt.Color("series:N", title=legend))
    return alt.layer(area, line).add_params(ZOOM).properties(title="Loss")


def throughput_bars(table: pd.DataFrame) -> alt.Chart:
    """Mean total samples/s per run (table: run, samples_per_s)."""
    return (
        alt.Chart(table, height=max(80, 28 * len(table) + 50))
        .mark_bar()
        .encode(x=alt.X("samples_per_s:Q", title="samples/s (all ranks)"), y=alt.Y("run:N", sort="-x", title=None),
                color=alt.Color("run:N", legend=None),
                tooltip=[alt.Tooltip("run:N"), alt.Tooltip("samples_per_s:Q", format=",.0f")])
        .properties(title="Throughput")
    )


def by_world_size(table: pd.DataFrame, column: str, title: str) -> alt.Chart:
    """One value per world size, one line per setting (table: setting, world_size, column)."""
    return (
        alt.Chart(table.dropna(subset=[column]), height=CHART_HEIGHT)
        .mark_line(point=True)
        .encode(x=alt.X("world_size:Q", title="world size (ranks)"), y=alt.Y(f"{column}:Q", title=title),
                color=alt.Color("setting:N", title=None),
                tooltip=[alt.Tooltip("setting:N"), alt.Tooltip("world_size:Q"),
                         alt.Tooltip(f"{column}:Q", format=",.4g")])
        .properties(title=title[0].upper() + title[1:])
    )


def scaling_chart(table: pd.DataFrame) -> alt.LayerChart:
    """Measured throughput against ideal linear scaling, by world size."""
    measured = table.assign(kind="measured", value=table["samples_per_s"])
    ideal = table.assign(kind="ideal (linear)", value=table["ideal_samples_per_s"])
    data = pd.concat([measured, ideal], ignore_index=True)[["world_size", "value", "kind", "run", "efficiency"]]
    base = alt.Chart(data, height=CHART_HEIGHT).encode(
        x=alt.X("world_size:Q", title="world size (ranks)"),
        y=alt.Y("value:Q", title="samples/s"),
        color=alt.Color("kind:N", title=None),
        tooltip=[alt.Tooltip("run:N"), alt.Tooltip("world_size:Q"), alt.Tooltip("value:Q", format=",.0f"),
                 alt.Tooltip("efficiency:Q", format=".0%")],
    )
    return alt.layer(base.mark_line(point=True)).properties(title="Scaling")


def step_breakdown_chart(table: pd.DataFrame) -> alt.Chart:
    """Where a step's time goes, per rank: one stacked bar each (livedata.step_breakdown's frame)."""
    data = table.assign(rank=table["rank"].map(series_label), ms=table["seconds"] * 1e3)
    return (
        alt.Chart(data, height=max(60, 36 * data["rank"].nunique()))
        .mark_bar()
        .encode(
            y=alt.Y("rank:N", title=None),
            x=alt.X("ms:Q", title="milliseconds per step (median of recent steps)", stack="zero"),
            color=alt.Color("phase:N", title=None, sort=alt.EncodingSortField("order")),
            order=alt.Order("order:Q"),
            tooltip=[alt.Tooltip("rank:N"), alt.Tooltip("phase:N"), alt.Tooltip("ms:Q", format=".2f", title="ms")],
        )
        .properties(title="Time per step")
    )


def comm_share_chart(df: pd.DataFrame, ranks: Sequence[int] | None = None) -> alt.Chart:
    """The share of each step the backward's communication took, per rank (or the `ranks` picked) and their
    mean (0–100 %)."""
    data = per_rank_with_aggregate(df, "mean", MEAN_LABEL, only=ranks)
    return (_line(data, "communication share of the step")
            .encode(y=alt.Y("value:Q", title="communication share of the step", axis=alt.Axis(format="%"),
                            scale=alt.Scale(domain=[0, 1])))
            .properties(title="Communication share"))
