"""Chart builders: encodings, per-rank series with their mean, smoothing, and the point budget."""

from __future__ import annotations

import pandas as pd
import pytest

from ddpdash.dashboard import charts


def series(ranks: int = 2, steps: int = 10) -> pd.DataFrame:
    rows = [{"rank": r, "step": s, "value": float(s + r), "vmin": float(s + r), "vmax": float(s + r),
             "time": float(s), "count": 1} for r in range(ranks) for s in range(1, steps + 1)]
    return pd.DataFrame(rows)


def test_loss_chart_has_a_line_per_rank_and_their_mean() -> None:
    spec = charts.loss_chart(series()).to_dict()
    data = pd.DataFrame(next(iter(spec["datasets"].values())))
    assert sorted(data["series"].unique()) == ["mean of ranks", "rank 0", "rank 1"]
    mean = data[data["series"] == "mean of ranks"].sort_values("step")["value"].tolist()
    assert mean == [s + 0.5 for s in range(1, 11)]
    assert spec["encoding"]["x"]["field"] == "step" and spec["encoding"]["y"]["field"] == "value"
    assert {t["field"] for t in spec["encoding"]["tooltip"]} == {"series", "step", "value"}
    assert spec["params"][0]["bind"] == "scales"  # zoom and pan


def test_smoothing_is_an_ema_per_series() -> None:
    data = charts.per_rank_with_aggregate(series(ranks=1), "mean", "mean", smoothing=0.5)
    rank0 = data[data["series"] == "rank 0"]["value"].tolist()
    expected = pd.Series([float(s) for s in range(1, 11)]).ewm(alpha=0.5).mean().tolist()
    assert rank0 == pytest.approx(expected)


def test_no_smoothing_leaves_values_alone() -> None:
    data = charts.per_rank_with_aggregate(series(), "mean", "mean", smoothing=0.0)
    assert data[data["series"] == "rank 1"]["value"].tolist() == [float(s + 1) for s in range(1, 11)]


def test_log_scale_drops_non_positive_points() -> None:
    df = series()
    df.loc[0, "value"] = -1.0
    spec = charts.loss_chart(df, log_scale=True).to_dict()
    assert spec["encoding"]["y"]["scale"]["type"] == "log"
    assert all(r["value"] > 0 for r in next(iter(spec["datasets"].values())))


def test_throughput_shows_the_total_across_ranks() -> None:
    spec = charts.throughput_chart(series()).to_dict()
    data = pd.DataFrame(next(iter(spec["datasets"].values())))
    total = data[data["series"] == "total"].sort_values("step")["value"].tolist()
    assert total == [2 * s + 1 for s in range(1, 11)]


def test_timing_chart_separates_step_and_data_wait() -> None:
    spec = charts.timing_chart(series(), series()).to_dict()
    data = pd.DataFrame(next(iter(spec["datasets"].values())))
    assert set(data["kind"]) == {"step", "data wait"} and spec["encoding"]["strokeDash"]["field"] == "kind"


def test_charts_draw_every_point_they_are_given() -> None:
    """Charts never drop points: downsampling (min/max kept) happens in the query, before them."""
    chart = charts.loss_chart(series(ranks=4, steps=2000))
    assert charts.points_per_series(chart) == {**{f"rank {r}": 2000 for r in range(4)}, "mean of ranks": 2000}


def test_overlay_has_band_and_line_layers() -> None:
    data = pd.DataFrame({"series": ["a", "a", "b"], "run_id": [1, 1, 2], "rank": [-1, -1, -1], "x": [1, 2, 1],
                         "value": [3.0, 2.0, 4.0], "lo": [2.5, 1.5, 3.5], "hi": [3.5, 2.5, 4.5]})
    spec = charts.overlay_chart(data).to_dict()
    assert [layer["mark"]["type"] for layer in spec["layer"]] == ["area", "line"]
    assert spec["layer"][0]["encoding"]["y2"]["field"] == "hi"


def test_empty_frames_still_make_charts() -> None:
    empty = pd.DataFrame(columns=["rank", "step", "value", "vmin", "vmax", "time", "count"])
    assert charts.loss_chart(empty).to_dict()["mark"]["type"] == "line"


def test_a_rank_without_a_value_is_left_out_of_the_mean_and_the_total() -> None:
    df = series()
    df.loc[(df["rank"] == 1) & (df["step"] == 3), "value"] = float("nan")  # a diverged loss on one rank
    for how, label in (("mean", "mean of ranks"), ("sum", "total")):
        data = charts.per_rank_with_aggregate(df, how, label)
        at_3 = data[(data["series"] == label) & (data["step"] == 3)]["value"].tolist()
        assert at_3 == [3.0]  # rank 0's value alone


def test_lines_come_ordered_by_series_then_step_whatever_the_input_order() -> None:
    df = series(ranks=11, steps=3).sample(frac=1, random_state=1)
    data = charts.per_rank_with_aggregate(df, "mean", "mean of ranks")
    keys = list(zip(data["series"], data["step"], strict=True))
    assert keys == sorted(keys) and len(keys) == 12 * 3
    assert data.loc[data["series"] == "rank 10", "kind"].eq("rank").all()
    assert data.loc[data["series"] == "mean of ranks", "kind"].eq("all ranks").all()


def test_many_ranks_are_a_band_their_mean_and_the_ranks_picked() -> None:
    from ddpdash.dashboard import livedata

    df = series(ranks=64, steps=40)
    df.loc[df["rank"] == 17, "value"] += 50.0  # one rank far from the rest
    drawn = livedata.drawn_ranks(64, [], df)
    assert drawn is not None and 17 in drawn and len(drawn) == livedata.OUTLIER_RANKS
    assert livedata.drawn_ranks(64, [5, 2], df) == [2, 5]  # the user's pick wins
    assert livedata.drawn_ranks(charts.MAX_RANK_LINES, [], df) is None  # a few ranks: every one a line
    spec = charts.loss_chart(df, ranks=[2, 5]).to_dict()
    lines = pd.DataFrame(next(iter(spec["datasets"].values())))
    assert sorted(lines["series"].unique()) == ["max of all ranks", "mean of ranks", "min of all ranks", "rank 2",
                                                "rank 5"]
    mean = lines[lines["series"] == "mean of ranks"].sort_values("step")["value"]
    assert mean.iloc[0] == pytest.approx(1 + 63 / 2 + 50 / 64)  # the mean is of every rank, not the drawn ones
    assert lines.loc[lines["series"] == "max of all ranks", "value"].max() == pytest.approx(40 + 17 + 50)
    assert lines.loc[lines["series"] == "min of all ranks", "value"].min() == 1
    assert spec["title"] == "Loss"
