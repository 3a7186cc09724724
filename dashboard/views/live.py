"""Live: one run's header, charts, ranks, events, logs and machine stats, refreshing while it runs."""

from __future__ import annotations

import time
from pathlib import Path

import streamlit as st
from sqlalchemy.orm import Session

from ddpdash.dashboard import charts, history, livedata, nav, state
from ddpdash.dashboard.text import md_escape
from ddpdash.db.queries import events, rank_states
from ddpdash.db.runs import RunInfo, RunNotFound, get_run, list_runs
from ddpdash.db.vocab import Metric, RunStatus
from ddpdash.trainer.control import StopError, stop
from ddpdash.trainer.profiling import MAX_PROFILE_STEPS, ask_profile, hta_breakdown, latest_profiles, profile_table
from ddpdash.trainer.queue import cancel, is_waiting, move_to_front, waiting_states
from ddpdash.trainer.rundir import RunDir, tail
from ddpdash.trainer.stacks import capture_run, latest_capture

REFRESH_S = 1.5
STATUS_COLORS = {RunStatus.QUEUED: "gray", RunStatus.RUNNING: "blue", RunStatus.STOPPING: "orange",
                 RunStatus.SUCCEEDED: "green", RunStatus.FAILED: "red", RunStatus.STOPPED: "orange",
                 RunStatus.LOST: "violet"}


def _pick_run() -> int | None:
    with Session(state.engine()) as s:
        runs = list_runs(s, limit=200)
    if not runs:
        return None
    ids = [r.id for r in runs]
    labels = {r.id: f"#{r.id} · {r.name} · {r.status}" for r in runs}
    wanted = history.parse_run_id(st.query_params.get("run"))
    default = wanted if wanted in ids else livedata.newest_run_id(state.engine())
    choice = st.selectbox("Run", ids, index=ids.index(default) if default in ids else 0,
                          format_func=lambda i: labels[i])
    st.query_params["run"] = str(choice)  # a link to this page reopens this run
    return int(choice)


def render() -> None:
    state.reconcile_runs()
    run_id = _pick_run()
    if run_id is None:
        st.title("Live")
        st.info("No runs yet. Configure one and launch it: it will show up here, every rank, live.")
        st.page_link(nav.page("new"), label="New run", icon=":material/rocket_launch:")
        return
    with Session(state.engine()) as s:
        run = get_run(s, run_id)
    if st.session_state.get("_live_cache_run") != run_id:
        st.session_state["_live_cache"] = livedata.SeriesCache(run_id, livedata.point_budget(run.world_size))
        st.session_state["_live_cache_run"] = run_id
    c1, c2 = st.columns([3, 1])
    smoothing = c1.slider("Smoothing", 0.0, 0.99, 0.0, 0.01, help="Exponential moving average of the loss.")
    log_scale = c2.toggle("Log scale", value=False)
    picked: list[int] = []
    if run.world_size > charts.MAX_RANK_LINES:
        picked = st.multiselect(
            "Ranks drawn as lines", list(range(run.world_size)), key=f"ranks_drawn_{run_id}",
            placeholder=f"the {livedata.OUTLIER_RANKS} ranks furthest from the others (pick to choose)",
            help=f"{run.world_size} ranks: the charts show their mean and the band of every rank's values, "
                 "and these ranks as lines")
    panel = st.fragment(run_every=REFRESH_S if run.is_active else None)(_panel)
    panel(run_id, smoothing, log_scale, run.is_active, picked)


def _panel(run_id: int, smoothing: float, log_scale: bool, was_active: bool, picked: list[int]) -> None:
    engine = state.engine()
    state.reconcile_runs()  # each tick: a dead supervisor is noticed within seconds, not at the next page load
    cache: livedata.SeriesCache = st.session_state["_live_cache"]
    try:
        with Session(engine) as s:
            run = get_run(s, run_id)
            states = rank_states(s, run_id)
            evs = events(s, run_id)
            cache.refresh(s)
    except RunNotFound:
        st.warning(f"Run {run_id} no longer exists.")
        return
    _header(run, states)
    if was_active and not run.is_active:
        st.rerun()  # the run ended: draw once more without the timer
    _banners(evs)
    drawn = livedata.drawn_ranks(run.world_size, picked, cache.get(Metric.LOSS))
    _charts(cache, smoothing, log_scale, bool(run.config.get("script") or run.config.get("module")), run.is_active,
            drawn)
    st.subheader("Ranks")
    st.dataframe(livedata.rank_table(run, states, cache), hide_index=True, width="stretch")
    _stacks(run, cache, evs)
    _profile(run, evs)
    _events(evs, run)
    _logs(run)
    _system()


def _header(run: RunInfo, states) -> None:  # type: ignore[no-untyped-def]
    left, right = st.columns([4, 1])
    with left:
        st.markdown(f"## {md_escape(run.name)}  :{STATUS_COLORS.get(run.status, 'gray')}-badge[{run.status}]",
                    help=f"run id {run.id} · folder {run.run_dir}")
        cfg = history.run_config(run)
        if cfg is not None:
            st.caption(f"Trains {md_escape(cfg.provenance)}")
        prog = livedata.progress(run, states)
        st.progress(prog.fraction, text=prog.text())
        if run.job_id:
            _slurm_job(run)
    with right:
        if is_waiting(run):
            _queued(run)
        elif run.is_active:
            with st.popover("Stop", icon=":material/stop_circle:", width="stretch"):
                st.write(f"Stop run #{run.id}? Every rank finishes its step, flushes and exits.")
                if st.button("Yes, stop it", type="primary", key=f"confirm_stop_{run.id}"):
                    try:
                        status = stop(state.engine(), run.id)
                        st.toast(f"Run {run.id} {status}")
                    except StopError as exc:
                        st.error(str(exc))
                    st.rerun()
        if run.error and run.status == RunStatus.FAILED:
            st.error(f"failed: rank(s) {list(run.failed_ranks) or '?'}")


def _queued(run: RunInfo) -> None:
    """A run waiting in the queue: its place, what it waits for, Cancel and Move to front."""
    with Session(state.engine()) as s:
        position, reason = waiting_states(s).get(run.id, (0, "starting"))
    st.info(f"Queued, #{position} in line: {reason}" if position else "Admitted: starting", icon=":material/schedule:")
    if st.button("Cancel", icon=":material/cancel:", width="stretch", key=f"cancel_{run.id}"):
        st.toast(f"Run {run.id} " + ("cancelled" if cancel(state.engine(), run.id) else "had already started"))
        st.rerun()
    if position > 1 and st.button("Move to front", icon=":material/vertical_align_top:", width="stretch",
                                  key=f"front_{run.id}"):
        move_to_front(state.engine(), run.id)
        st.rerun()


SCRIPT_LINES = """import ddpdash
...
ddpdash.log({"loss": loss.item()}, step=step, samples=len(batch))
if ddpdash.should_stop():  # the Stop button asked: finish the step and leave
    break"""


def _charts(cache: livedata.SeriesCache, smoothing: float, log_scale: bool, run_is_script: bool = False,
            active: bool = True, drawn: list[int] | None = None) -> None:
    loss = cache.get(Metric.LOSS)
    if loss.empty:
        if run_is_script and not active:
            st.info("This script logged no metrics. Three lines make every rank's loss and throughput show here:")
            st.code(SCRIPT_LINES, language="python")
        elif run_is_script:
            st.info("Waiting for the first metrics. A script that does not call ddpdash.log() shows none: "
                    "its status, logs and system stats are here all the same.")
            st.code(SCRIPT_LINES, language="python")
        else:
            st.info("Waiting for the first metrics: torchrun and the ranks take a few seconds to start.")
        return
    left, right = st.columns(2)
    left.altair_chart(charts.loss_chart(loss, smoothing, log_scale, drawn), width="stretch")
    tokens = cache.get(Metric.TOKENS_PER_S)
    speed = tokens if not tokens.empty else cache.get(Metric.SAMPLES_PER_S)
    right.altair_chart(charts.throughput_chart(speed, "tokens/s" if not tokens.empty else "samples/s", drawn),
                       width="stretch")
    left, right = st.columns(2)
    left.altair_chart(charts.timing_chart(cache.get(Metric.STEP_TIME), cache.get(Metric.DATA_TIME), drawn),
                      width="stretch")
    acc, val_loss = cache.get(Metric.VAL_ACC), cache.get(Metric.VAL_LOSS)
    val, what = (acc, "accuracy") if not acc.empty else (val_loss, "loss")
    if not val.empty:
        right.altair_chart(charts.validation_chart(val, what), width="stretch")
    breakdown, share = livedata.step_breakdown(cache), cache.get(Metric.COMM_SHARE)
    if drawn is not None:
        breakdown = breakdown[breakdown["rank"].isin(drawn)]
    if not breakdown.empty or not share.empty:
        left, right = st.columns(2)
        if not breakdown.empty:
            left.altair_chart(charts.step_breakdown_chart(breakdown), width="stretch")
        if not share.empty:
            right.altair_chart(charts.comm_share_chart(share, drawn), width="stretch")


def _banners(evs) -> None:  # type: ignore[no-untyped-def]
    nonfinite = livedata.first_nonfinite(evs)
    if nonfinite:
        st.error(f"Numbers went wrong — {nonfinite}. Lower the learning rate, add warm-up or gradient clipping, "
                 "or look for a bad batch at that step.", icon=":material/error:")


def _stacks(run: RunInfo, cache: livedata.SeriesCache, evs) -> None:  # type: ignore[no-untyped-def]
    """Every rank's stack: captured once per hang by itself, or when asked; the newest capture with its verdict."""
    latest = latest_capture(evs)
    began = livedata.hang_began(cache, run) if run.is_active else None
    asked = run.is_active and st.button("Stacks", icon=":material/stacks:",
                                        help="Read every rank's stack now (py-spy) and its Flight Recorder: where "
                                             "each one is, who waits for whom")
    # A supervised run's supervisor reads the stacks of a hang itself (trainer/supervisor/diagnose.py).
    unwatched = run.supervisor_pid is None
    if asked or (unwatched and began is not None and (latest is None or latest.at < began)):
        with st.spinner("Reading every rank's stack…"):
            latest = capture_run(state.engine(), run.id)
    if latest is None:
        return
    st.subheader("Stacks")
    when = time.strftime("%H:%M:%S", time.localtime(latest.at))
    st.warning(f"{latest.verdict} (read at {when})", icon=":material/stacks:")
    if latest.finding:
        st.info(f"Flight Recorder: {latest.finding}", icon=":material/flight:")
    columns = st.columns(min(max(len(latest.stacks), 1), 4))
    for i, stack in enumerate(latest.stacks):
        with columns[i % len(columns)]:
            st.markdown(f"**rank {stack.rank}** · {stack.method}" + (f" — {stack.note}" if stack.note else ""))
            if stack.error:
                st.caption(stack.error)
            own = stack.own_frame
            st.code("\n".join(f"{'▶' if f is own else ' '} {f.name}  {f.where}" for f in stack.frames) or "(empty)",
                    language="text")


def _profile(run: RunInfo, evs) -> None:  # type: ignore[no-untyped-def]
    """Profile the next N steps of every rank (torch.profiler); the newest profile's top operators and traces."""
    if run.is_active and run.run_dir:
        c1, c2 = st.columns([1, 3])
        steps = c1.number_input("Steps", min_value=1, max_value=MAX_PROFILE_STEPS, value=5, key=f"profile_n_{run.id}",
                                label_visibility="collapsed")
        if c2.button(f"Profile {steps} steps", icon=":material/speed:",
                     help="Every rank records its next steps with torch.profiler (CPU, CUDA where present)"):
            ask_profile(RunDir(Path(run.run_dir)), int(steps))
            st.toast(f"Every rank profiles its next {steps} steps: the result shows here when they are done")
    profiles = latest_profiles(evs)
    if not profiles:
        return
    first = profiles[0]
    st.subheader("Profile")
    st.caption(f"steps {first.steps[0]}–{first.steps[1]} · the traces open in ui.perfetto.dev or chrome://tracing")
    columns = st.columns(min(len(profiles), 2))
    for i, prof in enumerate(profiles):
        with columns[i % len(columns)]:
            st.markdown(f"**rank {prof.rank}** — top operators by self time")
            st.dataframe(profile_table(prof), hide_index=True, width="stretch",
                         column_config={"share": st.column_config.NumberColumn(format="percent")})
            if prof.trace.exists():
                st.download_button(f"Trace of rank {prof.rank}", prof.trace.read_bytes, file_name=prof.trace.name,
                                   mime="application/gzip", key=f"trace_{prof.trace}", icon=":material/download:")
    breakdown = _hta_breakdown(str(first.trace.parent))
    if breakdown is not None:
        st.markdown("**Holistic Trace Analysis** — temporal breakdown per rank")
        st.dataframe(breakdown, width="stretch")


@st.cache_data(show_spinner=False, max_entries=8)
def _hta_breakdown(folder: str):  # type: ignore[no-untyped-def]
    """HTA reads every trace of a profile: once per profile, not on each refresh."""
    return hta_breakdown(Path(folder))


def _events(evs, run: RunInfo) -> None:  # type: ignore[no-untyped-def]
    st.subheader("Events")
    if evs.empty:
        st.caption("No events yet.")
        return
    table = evs[["time", "kind", "rank", "message"]].copy()
    table["time"] = table["time"].map(lambda t: time.strftime("%H:%M:%S", time.localtime(t)))
    st.dataframe(table, hide_index=True, width="stretch")
    for ev in livedata.failures(evs).itertuples(index=False):
        if ev.detail:
            with st.expander(f"{ev.kind}: {ev.message[:120]}"):
                st.code(ev.detail, language="text")


def _slurm_job(run: RunInfo) -> None:
    """A Slurm run's job: its id, what Slurm says of it (state, reason, nodes), and the script submitted."""
    st.caption(run.job_line)
    script = RunDir(Path(run.run_dir)).job_script if run.run_dir else None
    if script is not None and script.exists():
        with st.expander("Job script", icon=":material/description:"):
            st.code(script.read_text(), language="bash")


def _logs(run: RunInfo) -> None:
    st.subheader("Logs")
    c1, c2 = st.columns([1, 1])
    folder = RunDir(Path(run.run_dir)) if run.run_dir else None
    others = livedata.job_logs(run, folder) if folder is not None else {}
    rank = c1.selectbox("Rank", [*range(run.world_size), *others], key="log_rank",
                        format_func=lambda r: f"rank {r}" if isinstance(r, int) else str(r))
    if not isinstance(rank, int):
        st.code(tail(others[rank], 200) or "(empty)", language="text")
        return
    stream = c2.radio("Stream", ["stderr", "stdout"], horizontal=True, key="log_stream")
    path = folder.rank_log(int(rank), stream) if folder is not None else None
    if path is None:
        st.caption("No log yet for this rank.")
    else:
        st.code(tail(path, 200) or "(empty)", language="text")


def _system() -> None:
    st.subheader("System")
    stats = livedata.system_stats()
    c1, c2 = st.columns(2)
    c1.metric("CPU", f"{stats.cpu_percent:.0f} %")
    c2.metric("Memory", f"{stats.mem_used_gib:.1f} / {stats.mem_total_gib:.1f} GiB")
    if stats.gpus:
        st.dataframe(stats.gpus, hide_index=True, width="stretch")
    else:
        st.caption("No NVML here (no NVIDIA GPU, or nvidia-ml-py not installed): GPU stats hidden.")


if __name__ == "__main__":  # run as a page by st.navigation
    render()
