"""New run: a form generated from RunConfig, live validation, command previews, Launch."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import streamlit as st
from sqlalchemy.orm import Session

from ddpdash.dashboard import forms, history, nav, state
from ddpdash.dashboard.text import md_escape
from ddpdash.db.runs import RunNotFound, get_run
from ddpdash.trainer.config import ConfigInvalid, Machine, RunConfig
from ddpdash.trainer.control import LaunchError, check_recipe, launch
from ddpdash.trainer.sweep import launch_sweep

CHECK_KEY = "_recipe_check"  # (the config checked, as JSON; its CheckResult): shown while the form is unchanged


def _prefill() -> None:
    clone = st.query_params.get("clone")
    if clone and st.session_state.get("_cloned_from") != clone:
        try:
            run_id = history.parse_run_id(clone)
            if run_id is None:
                raise ValueError("not a run id")
            with Session(state.engine()) as s:
                cfg = RunConfig.from_dict(get_run(s, run_id).config)
            st.session_state.update(forms.widget_state(cfg.replace(name=f"{cfg.name}-clone")))
            st.session_state["_cloned_from"] = clone
            st.toast(f"Form filled from run {clone}")
        except (RunNotFound, ValueError, ConfigInvalid) as exc:
            st.warning(f"Could not clone run {md_escape(clone)}: {md_escape(str(exc))}")
    elif forms.KEY_PREFIX + "name" not in st.session_state:
        st.session_state.update(forms.widget_state(RunConfig()))


def _widget(spec: forms.FieldSpec, machine: Machine, values: dict[str, Any]) -> None:
    kw: dict[str, Any] = {"key": spec.key, "help": spec.help}
    missing = spec.key not in st.session_state
    if spec.name == "devices":
        if not machine.has_cuda:
            st.caption("No CUDA GPU on this machine: ranks run as CPU processes (gloo).")
            return
        st.multiselect("GPUs", list(range(len(machine.gpus))), format_func=lambda i: forms.gpu_label(i, machine),
                       **({"default": []} if missing else {}), **kw)
        return
    if spec.name == "recipe":
        _recipe_widgets(spec)
        return
    if spec.name == "params":
        _params_editor(spec)
        return
    if spec.name in ("launcher", "partition"):
        why_not, partitions = state.slurm_target()
        if why_not:  # Slurm is offered only where sbatch is
            st.caption(f"Runs launch on this machine ({why_not}: no Slurm cluster to submit to).")
            return
        options = ("local", "slurm") if spec.name == "launcher" else ("", *partitions)
        if not missing and st.session_state[spec.key] not in options:
            st.session_state[spec.key] = options[0]
        st.selectbox(spec.label, options, format_func=lambda p: p or "the cluster's default", **kw)
        return
    if spec.kind == "choice":
        options: tuple[str, ...] = spec.choices
        fmt = str
        if spec.name == "amp":
            options = forms.amp_choices(machine, bool(values.get("devices")))
        elif spec.name == "dataset":
            options = forms.dataset_choices(values.get("recipe", "mlp"))
        elif spec.name == "backend":
            fmt = lambda b: forms.backend_label(b, machine)  # noqa: E731
        if not missing and st.session_state[spec.key] not in options:
            st.session_state[spec.key] = options[0]
        st.selectbox(spec.label, options, format_func=fmt,
                     **({"index": options.index(spec.default) if spec.default in options else 0} if missing else {}),
                     **kw)
    elif spec.kind == "str_list":
        st.text_area(spec.label, height=100, placeholder="--epochs\n3", **({"value": ""} if missing else {}), **kw)
    elif spec.kind == "bool":
        st.toggle(spec.label, **({"value": spec.default} if missing else {}), **kw)
    elif spec.kind == "int":
        st.number_input(spec.label, step=1, **({"value": spec.default} if missing else {}), **kw)
    elif spec.kind == "float":
        st.number_input(spec.label, format="%g", step=None, **({"value": float(spec.default)} if missing else {}),
                        **kw)
    else:
        st.text_input(spec.label, max_chars=200, **({"value": spec.default} if missing else {}), **kw)


def _recipe_widgets(spec: forms.FieldSpec) -> None:
    st.selectbox("Recipe", forms.RECIPE_CHOICES, key=forms.RECIPE_CHOICE_KEY, help=spec.help)
    if st.session_state.get(forms.RECIPE_CHOICE_KEY) == forms.OWN_RECIPE:
        st.text_input("Your recipe", key=forms.OWN_RECIPE_KEY, placeholder="path/to/model.py:build",
                      help="A file (or package.module) and the function in it that returns a ddpdash.Recipe.")


def _params_editor(spec: forms.FieldSpec) -> None:
    import pandas as pd

    if forms.PARAMS_EDITOR_KEY not in st.session_state:
        st.session_state.update({forms.PARAMS_ROWS_KEY: [], forms.PARAMS_EDITOR_KEY: "_params_first"})
    rows = pd.DataFrame(st.session_state[forms.PARAMS_ROWS_KEY], columns=list(forms.PARAM_COLUMNS), dtype=str)
    st.markdown("Parameters", help=spec.help)
    st.data_editor(rows, key=st.session_state[forms.PARAMS_EDITOR_KEY], num_rows="dynamic", hide_index=True,
                   width="stretch", column_config={"key": st.column_config.TextColumn("key"),
                                                   "value": st.column_config.TextColumn("value")})


def _apply_preset() -> None:
    model = st.session_state.get(forms.RECIPE_CHOICE_KEY, "mlp")
    st.session_state.update(forms.apply_preset(model, st.session_state.get("_preset", "")))


def render() -> None:
    st.title("New run")
    machine = state.machine()
    _prefill()
    values = forms.values_from_state(st.session_state)
    result = forms.with_check(forms.check_form(values, machine), st.session_state.get(CHECK_KEY))
    for message in result.errors.get("config", []):
        st.error(message)

    left, right = st.columns([3, 2], gap="large")
    with left:
        for section, specs in forms.sections().items():
            if not any(forms.visible(spec, values) for spec in specs):
                continue
            collapsed = section in ("Advanced DDP", "Your script")
            has_script = bool(values.get("script") or values.get("module"))
            box = (st.expander(section, expanded=has_script and section == "Your script") if collapsed
                   else st.container(border=True))
            with box:
                if not collapsed:
                    st.markdown(f"**{section}**")
                if section == "Model" and forms.preset_names(values.get("recipe", "mlp")):
                    st.selectbox("Size preset", forms.preset_names(values.get("recipe", "mlp")), key="_preset",
                                 index=None, placeholder="choose a size…", on_change=_apply_preset,
                                 help="Fills width, depth, heads and sequence length; large ones are for GPUs.")
                for spec in specs:
                    if forms.visible(spec, values):
                        _widget(spec, machine, values)
                        for message in result.errors.get(spec.name, []):
                            st.error(f"{spec.label} {message}", icon=":material/error:")
                        for detail in result.details.get(spec.name, []):
                            st.code(detail, language="python", wrap_lines=True)
    with right:
        _summary_and_launch(result)


def _summary_and_launch(result: forms.FormResult) -> None:
    with st.container(border=True):
        st.markdown("**Summary**")
        if result.config is not None:
            for label, value in forms.summary(result.config).items():
                st.markdown(f"{label}: `{value}`")
        for message in result.errors.get("memory_check", []):
            st.error(f"Memory: {message}", icon=":material/memory:")
        problems = sum(len(v) for v in result.errors.values())
        if problems:
            st.warning(f"{problems} problem(s) to fix before launch: see the fields marked in red.")
        _recipe_check(result)
        if st.button("Launch", type="primary", width="stretch", disabled=False):
            if not result.ok:
                st.error("Nothing was launched: fix the problems shown next to the fields.")
            else:
                assert result.config is not None
                try:
                    with st.spinner("Checking the recipe…") if forms.needs_check(result.config) else nullcontext():
                        run_id = launch(state.engine(), result.config, state.machine())
                except ConfigInvalid as exc:
                    st.session_state[CHECK_KEY] = forms.failed_check(result.config, exc)
                    st.rerun()  # the check's findings go next to their fields
                except LaunchError as exc:
                    st.error(f"Nothing was launched: {exc}")
                else:
                    nav.go("live", run=str(run_id))
    if result.config is not None and result.ok:
        _sweep(result.config)
    if result.config is not None:
        if forms.check_failed(result.config, st.session_state.get(CHECK_KEY)):
            st.error("Nothing was launched: the check found the problems shown next to the fields.")
        cli, torchrun = forms.command_previews(result.config)
        st.markdown("**Same run from a terminal**")
        st.code(cli, language="bash", wrap_lines=True)
        if result.config.on_slurm:
            st.markdown("**The job script ddpdash submits** (`sbatch --parsable job.sh`)")
            st.code(forms.job_script_preview(result.config), language="bash")
        else:
            st.markdown("**The torchrun command the launcher runs**")
            st.code(torchrun, language="bash", wrap_lines=True)


def _sweep(cfg: RunConfig) -> None:
    """A grid of runs from these settings: how many it makes, then every run validated and queued."""
    with st.expander("Sweep: a grid of runs", icon=":material/grid_view:"):
        grid = st.text_area("Grid, one setting per line", key="_sweep_grid", height=90,
                            placeholder="num_procs=1,2\nbatch_size=32,64\nparam.width=64,128",
                            help="setting=value1,value2 (semicolons when a value holds commas); param.KEY for your "
                                 "parameters, arg.--option for your script's arguments")
        seeds = st.number_input("Seeds per grid point", min_value=1, max_value=20, value=1, step=1, key="_sweep_seeds")
        name = st.text_input("Sweep name", key="_sweep_name", placeholder="sweep-DATE-TIME")
        plan = forms.sweep_plan(cfg, grid, int(seeds))
        if not grid.strip():
            st.caption("Add a line to sweep a setting.")
            return
        (st.caption if plan.ok else st.error)(plan.description)
        if st.button("Launch sweep", disabled=not plan.ok, icon=":material/grid_view:", width="stretch"):
            try:
                with st.spinner("Checking every run of the grid…"):
                    sweep_name, _ = launch_sweep(state.engine(), cfg, plan.axes, plan.seeds, state.machine(), name)
            except (ConfigInvalid, LaunchError) as exc:
                st.error(f"Nothing was launched: {exc}")
            else:
                nav.go("sweep", sweep=sweep_name)


def _recipe_check(result: forms.FormResult) -> None:
    """The Check button, and what the last check of this very config found."""
    cfg = result.config
    if cfg is None or not forms.needs_check(cfg):
        return
    if st.button("Check", width="stretch", help="Import the recipe, build it and take one batch through it on the "
                                                "CPU, in a separate process: nothing is launched"):
        with st.spinner("Checking the recipe…"):
            st.session_state[CHECK_KEY] = (cfg.to_json(), check_recipe(cfg))
        st.rerun()
    report = forms.check_report(cfg, st.session_state.get(CHECK_KEY))
    if report is not None:
        st.success("The recipe checks out.", icon=":material/check_circle:")
        st.table({label: value for label, value in report.lines()})


if __name__ == "__main__":  # run as a page by st.navigation
    render()
