"""New run: a form generated from RunConfig, live validation, command previews, Launch."""

from __future__ import annotations

from typing import Any

import streamlit as st
from sqlalchemy.orm import Session

from ddpdash.dashboard import forms, history, nav, state
from ddpdash.dashboard.text import md_escape
from ddpdash.db.runs import RunNotFound, get_run
from ddpdash.trainer.config import ConfigInvalid, Machine, RunConfig
from ddpdash.trainer.control import LaunchError, launch


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
    if spec.kind == "choice":
        options: tuple[str, ...] = spec.choices
        fmt = str
        if spec.name == "amp":
            options = forms.amp_choices(machine, bool(values.get("devices")))
        elif spec.name == "dataset":
            options = forms.dataset_choices(values.get("model", "mlp"))
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


def _apply_preset() -> None:
    model = st.session_state.get(forms.KEY_PREFIX + "model", "mlp")
    st.session_state.update(forms.apply_preset(model, st.session_state.get("_preset", "")))


def render() -> None:
    st.title("New run")
    machine = state.machine()
    _prefill()
    values = forms.values_from_state(st.session_state)
    result = forms.check_form(values, machine)
    for message in result.errors.get("config", []):
        st.error(message)

    left, right = st.columns([3, 2], gap="large")
    with left:
        for section, specs in forms.sections().items():
            collapsed = section in ("Advanced DDP", "Your script")
            has_script = bool(values.get("script") or values.get("module"))
            box = (st.expander(section, expanded=has_script and section == "Your script") if collapsed
                   else st.container(border=True))
            with box:
                if not collapsed:
                    st.markdown(f"**{section}**")
                if section == "Model" and forms.preset_names(values.get("model", "mlp")):
                    st.selectbox("Size preset", forms.preset_names(values.get("model", "mlp")), key="_preset",
                                 index=None, placeholder="choose a size…", on_change=_apply_preset,
                                 help="Fills width, depth, heads and sequence length; large ones are for GPUs.")
                for spec in specs:
                    if forms.visible(spec, values):
                        _widget(spec, machine, values)
                        for message in result.errors.get(spec.name, []):
                            st.error(f"{spec.label} {message}", icon=":material/error:")
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
        if st.button("Launch", type="primary", width="stretch", disabled=False):
            if not result.ok:
                st.error("Nothing was launched: fix the problems shown next to the fields.")
            else:
                assert result.config is not None
                try:
                    run_id = launch(state.engine(), result.config, state.machine())
                except (ConfigInvalid, LaunchError) as exc:
                    st.error(f"Nothing was launched: {exc}")
                else:
                    nav.go("live", run=str(run_id))
    if result.config is not None:
        cli, torchrun = forms.command_previews(result.config)
        st.markdown("**Same run from a terminal**")
        st.code(cli, language="bash", wrap_lines=True)
        st.markdown("**The torchrun command the launcher runs**")
        st.code(torchrun, language="bash", wrap_lines=True)


if __name__ == "__main__":  # run as a page by st.navigation
    render()
