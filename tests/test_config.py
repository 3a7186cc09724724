"""RunConfig: validation rules, JSON round trip, and robustness against arbitrary input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpdash.trainer.config import ConfigInvalid, RunConfig, check, config_fields, validate
from tests.conftest import CPU_MACHINE, GPU_MACHINE


def errors_for(machine=CPU_MACHINE, **changes):  # type: ignore[no-untyped-def]
    return {e.field: e.message for e in validate(RunConfig().replace(**changes), machine)}


def test_defaults_are_valid_on_a_cpu_machine() -> None:
    assert validate(RunConfig(), CPU_MACHINE) == []


def test_nccl_without_cuda_says_use_gloo() -> None:
    assert "use gloo" in errors_for(backend="nccl")["backend"]


def test_fp16_on_cpu_says_use_bf16() -> None:
    assert "use bf16" in errors_for(amp="fp16")["amp"]


def test_fp16_on_gpu_is_fine() -> None:
    assert errors_for(GPU_MACHINE, devices=[0], amp="fp16") == {}


def test_gpu_index_that_does_not_exist() -> None:
    assert "does not exist" in errors_for(GPU_MACHINE, devices=[0, 5])["devices"]


def test_gpus_on_a_machine_without_cuda() -> None:
    assert "has none" in errors_for(devices=[0])["devices"]


def test_duplicate_gpu() -> None:
    assert "twice" in errors_for(GPU_MACHINE, devices=[1, 1])["devices"]


def test_devices_set_world_size() -> None:
    cfg = RunConfig(devices=(0, 1), num_procs=7)
    assert cfg.num_procs == 2 and cfg.world_size == 2 and cfg.resolved_backend == "nccl"


@pytest.mark.parametrize("value", [0, -3])
def test_batch_size_must_be_positive(value: int) -> None:
    assert errors_for(batch_size=value)["batch_size"] == f"must be ≥ 1, got {value}"


def test_num_procs_below_one() -> None:
    assert "must be ≥ 1" in errors_for(num_procs=0)["num_procs"]


def test_num_procs_unreasonably_above_the_machine() -> None:
    assert "would thrash" in errors_for(num_procs=64)["num_procs"]


def test_bf16_comm_hook_on_gloo() -> None:
    assert "needs CUDA and nccl" in errors_for(comm_hook="bf16")["comm_hook"]


def test_dataset_must_fit_the_model() -> None:
    assert "trains on text" in errors_for(recipe="transformer", dataset="digits")["dataset"]


def test_heads_must_divide_width() -> None:
    assert "must divide width" in errors_for(recipe="transformer", width=30, num_heads=4)["num_heads"]


def test_run_must_be_bounded() -> None:
    assert "both 0" in errors_for(max_steps=0, num_epochs=0)["max_steps"]


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigInvalid) as info:
        check(RunConfig().replace(batch_size=0, backend="nccl", amp="fp16"), CPU_MACHINE)
    assert set(info.value.by_field()) == {"batch_size", "backend", "amp"}


def test_unknown_setting_is_named() -> None:
    with pytest.raises(ConfigInvalid, match="config has an unknown setting 'batchsize'"):
        RunConfig.from_dict({"batchsize": 3})


def test_wrong_type_is_named() -> None:
    with pytest.raises(ConfigInvalid, match="batch_size must be a whole number"):
        RunConfig.from_dict({"batch_size": "big"})


def test_bad_choice_lists_the_choices() -> None:
    with pytest.raises(ConfigInvalid, match="amp must be one of off, bf16, fp16"):
        RunConfig.from_dict({"amp": "fp8"})


def test_invalid_json() -> None:
    with pytest.raises(ConfigInvalid, match="not valid JSON"):
        RunConfig.from_json("{nope")


def test_json_round_trip_is_exact() -> None:
    cfg = RunConfig(name="r", devices=(0, 2), amp="bf16", lr=0.123456789, comm_hook="powersgd", static_graph=True)
    again = RunConfig.from_json(cfg.to_json())
    assert again == cfg and again.to_json() == cfg.to_json()


def test_every_field_has_help_text() -> None:
    assert all(f.metadata.get("help") for f in config_fields())


def test_derived_values() -> None:
    cfg = RunConfig(num_procs=4, batch_size=8, grad_accum_steps=2, lr=0.1, scale_lr=True)
    assert cfg.global_batch == 64 and cfg.effective_lr == pytest.approx(0.4)
    assert RunConfig(num_procs=4, lr=0.1, scale_lr=False).effective_lr == 0.1


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10,
)
field_names = st.sampled_from([f.name for f in config_fields()])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(field_names | st.text(max_size=12), json_values, max_size=8))
def test_arbitrary_input_raises_only_config_invalid(data: dict) -> None:
    try:
        cfg = RunConfig.from_dict(data)
        validate(cfg, CPU_MACHINE)
        validate(cfg, GPU_MACHINE)
        assert RunConfig.from_json(cfg.to_json()).to_json() == cfg.to_json()
    except ConfigInvalid as exc:
        assert exc.errors and all(e.field for e in exc.errors)
