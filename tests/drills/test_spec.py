"""Fault specs parse strictly (a typo never runs a drill) and say what must follow and by when."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gpuwatch.config import Config, load
from gpuwatch.drills.spec import expectation, parse_dcgm, parse_inject
from gpuwatch.errors import ConfigError


def test_inject_spec_with_fields_and_duration() -> None:
    spec = parse_inject("gpu=1,sm_clock_mhz=500,clocks_event_reasons=0,util_gpu_pct=100,for=600")
    assert spec.gpu == 1 and spec.duration_s == 600
    assert spec.body() == {
        "fields": {"sm_clock_mhz": 500, "clocks_event_reasons": 0, "util_gpu_pct": 100},
        "duration_s": 600,
    }


def test_presets_expand_and_explicit_keys_win() -> None:
    spec = parse_inject("gpu=0,preset=clock_low,sm_clock_mhz=400")
    assert spec.fields == {"sm_clock_mhz": 400, "clocks_event_reasons": 0, "util_gpu_pct": 100}
    xid = parse_inject("gpu=2,preset=xid79")
    assert xid.body() == {"fields": {}, "duration_s": 600.0, "event": "xid", "xid": 79}
    assert parse_inject("gpu=0,preset=gpu_lost,for=120").body()["fields"] == {"error": "gpu_lost"}


def test_xid_alone_means_an_xid_event_and_hex_reasons_parse() -> None:
    assert parse_inject("gpu=0,xid=48").event == "xid"
    assert parse_inject("gpu=0,clocks_event_reasons=0x8,for=60").fields == {"clocks_event_reasons": 8}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("gpu=1,sm_clock=500", "sm_clock=500: unknown key"),
        ("gpu=1,sm_clock_mhz=abc", "sm_clock_mhz=abc: not a number"),
        ("gpu=1,sm_clock_mhz", "'sm_clock_mhz' is not key=value"),
        ("gpu=1,,for=10", "empty part"),
        ("gpu=1,for=10,for=20,preset=xid79", "for given twice"),
        ("gpu=x,preset=xid79", "gpu=x: not a number"),
        ("gpu=1.5,preset=xid79", "gpu=1.5: not a whole number"),
        ("gpu=-1,preset=xid79", "gpu=-1: not a GPU index"),
        ("preset=xid79", "gpu=N is missing"),
        ("gpu=0,preset=melt", "preset=melt: unknown preset"),
        ("gpu=0,event=xid", "event=xid needs xid=N"),
        ("gpu=0,event=ecc_dbe,xid=79", "xid=79 goes with event=xid"),
        ("gpu=0,xid=5000", "xid=5000: XIDs are 1 to 1000"),
        ("gpu=0,error=melted", "error=melted: not one of"),
        ("gpu=0,event=fire", "event=fire: not one of"),
        ("gpu=0,preset=xid79,for=0", "for=0: seconds must be in (0, 86400]"),
        ("gpu=0,preset=xid79,expect=no_such_rule", "expect=no_such_rule: not a rule id"),
        ("gpu=0,for=60", "nothing to inject"),
        ("gpu=0,pids=5", "pids=5: unknown key"),
        ("gpu=0,sm_clock_mhz=nan", "sm_clock_mhz=nan: not a number"),
    ],
)
def test_bad_inject_specs_name_the_bad_part(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_inject(text)
    message = str(caught.value)
    assert message.startswith("--inject: ") and fragment in message and "\n" not in message, message


def test_schedule_args_must_not_name_the_gpu() -> None:
    assert parse_inject("preset=xid79", need_gpu=False).gpu is None
    with pytest.raises(ConfigError, match="the schedule entry's `gpu` names the target"):
        parse_inject("gpu=1,preset=xid79", where="drills.schedule[0]: args", need_gpu=False)


def test_dcgm_spec() -> None:
    spec = parse_dcgm("gpu=0,field=230,value=79")
    assert (spec.gpu, spec.field_id, spec.value) == (0, 230, 79.0)
    with pytest.raises(ConfigError, match="--dcgm-inject: value= is missing"):
        parse_dcgm("gpu=0,field=230")
    with pytest.raises(ConfigError, match="field=-3: not a DCGM field id"):
        parse_dcgm("gpu=0,field=-3,value=1")


def test_expectations_and_their_lag_follow_the_rule_windows() -> None:
    config = Config()
    rules = config.rules
    clock = expectation(parse_inject("gpu=0,preset=clock_low"), config)
    assert clock.rules == ("sm_clock_low_unexplained",) and clock.lag_s == rules.clock_window_s * rules.level_duty
    assert expectation(parse_inject("gpu=0,preset=xid79"), config).rules == ("xid_critical",)
    assert expectation(parse_inject("gpu=0,xid=31"), config).rules == ("xid_app", "xid_app_repeated")
    assert expectation(parse_inject("gpu=0,preset=ecc_dbe"), config).event is True
    assert expectation(parse_inject("gpu=0,preset=remap_pending"), config).rules == ("row_remap_pending",)
    assert expectation(parse_inject("gpu=0,preset=gpu_lost"), config).rules == ("gpu_lost",)
    throttle = expectation(parse_inject("gpu=0,clocks_event_reasons=0x8,sm_clock_mhz=900"), config)
    assert throttle.rules == ("clocks_hw_slowdown",) and throttle.lag_s == rules.clock_window_s * rules.throttle_duty
    benign = expectation(parse_inject("gpu=0,sm_clock_mhz=500,clocks_event_reasons=4"), config)
    assert benign.rules == (), "a low clock explained by SW power cap raises nothing specific"
    assert expectation(parse_inject("gpu=0,preset=xid79,expect=gpu_lost"), config).rules == ("gpu_lost",)
    assert expectation(parse_dcgm("gpu=0,field=230,value=79"), config).rules == ("xid_critical",)
    assert expectation(parse_dcgm("gpu=0,field=396,value=1"), config).rules == ("row_remap_pending",)
    assert expectation(parse_dcgm("gpu=0,field=313,value=5"), config).rules == ("ecc_uncorrectable",)
    slow = dataclasses.replace(config, rules=dataclasses.replace(rules, clock_window_s=10.0))
    assert expectation(parse_inject("gpu=0,preset=clock_low"), slow).lag_s == 10.0 * rules.level_duty


def test_drill_timings_must_be_positive(tmp_path: Path) -> None:
    (tmp_path / "none.toml").write_text("")
    with pytest.raises(ConfigError, match=r"drills.poll_s: 0.0 must be positive"):
        load(tmp_path / "none.toml", environ={"GPUWATCH_DRILLS_POLL_S": "0"})
