"""`gpuwatch drill` through click's CliRunner (the lead registers it with `main.add_command(drill)`): exit
codes, one-line errors, dry runs that change nothing, the verdict printed and handed to the daemon."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from tests.drills.conftest import ClientApi, FakeDaemon, Tools, fake_gpu, main, start_drill_node
from tests.helpers import SimNode


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, ["drill", *args], env={"GPUWATCH_CONFIG": "", **(env or {})})


def one_line_error(result: Result, fragment: str) -> None:
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuwatch: error: ") and fragment in lines[0], result.stderr


@pytest.fixture
def cli_node(node: SimNode, monkeypatch: pytest.MonkeyPatch) -> SimNode:
    monkeypatch.setattr("gpuwatch.drills.daemon_client.HttpApi", lambda config, **_: ClientApi(node))
    return node


def test_list_shows_kinds_and_next_runs_without_a_daemon(tmp_path: Path) -> None:
    config = tmp_path / "gpuwatch.toml"
    config.write_text(
        '[[drills.schedule]]\ncron = "0 15 * * fri"\ndrill = "inject"\ngpu = "idle"\nargs = "preset=xid79"\n'
        '[[drills.schedule]]\ncron = "30 3 1 * *"\ndrill = "reset_gpu"\nallow_destructive = true\n'
    )
    result = invoke("--list", "--config", str(config), "--listen", "127.0.0.1:1")
    assert result.exit_code == 0, result.stdout
    for kind in ("inject", "dcgm_inject", "xid_fault", "kill_rank", "reset_gpu", "pcie_remove"):
        assert f"\n  {kind} " in result.stdout
    assert "reset_gpu    --reset-gpu GPU" in result.stdout and "[--yes, destructive]" in result.stdout
    lines = [line for line in result.stdout.splitlines() if line.startswith("  [")]
    assert lines[0].startswith("  [0] inject on GPU idle, cron '0 15 * * fri', args 'preset=xid79': next ")
    assert lines[1].startswith("  [1] reset_gpu on GPU idle, cron '30 3 1 * *': next ")
    assert lines[0].count(" 15:00") == 3 and lines[1].count("-01 03:30") == 3


def test_list_with_a_bad_schedule_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "gpuwatch.toml"
    config.write_text('[[drills.schedule]]\ncron = "0 15 * * fri"\ndrill = "pcie_remove"\n')
    one_line_error(invoke("--list", "--config", str(config)), "drills.schedule[0]: pcie_remove touches the card")


@pytest.mark.parametrize("args", [[], ["--xid-fault", "0", "--reset-gpu", "1"], ["--list", "--kill-rank", "0"]])
def test_exactly_one_drill(args: list[str]) -> None:
    one_line_error(invoke(*args), "give one of --list, --clear, --inject, --dcgm-inject")


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("gpu=1,sm_clock=500", "--inject: sm_clock=500: unknown key"),
        ("gpu=1,sm_clock_mhz=fast", "--inject: sm_clock_mhz=fast: not a number"),
        ("sm_clock_mhz=500", "--inject: gpu=N is missing"),
    ],
)
def test_bad_inject_spec_is_one_line_naming_the_part(spec: str, fragment: str) -> None:
    one_line_error(invoke("--inject", spec), fragment)


def test_inject_drill_prints_a_passing_verdict_and_the_daemon_stores_it(cli_node: SimNode) -> None:
    result = invoke("--inject", "gpu=1,preset=xid79")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert "drill inject on GPU 1 (GPU-" in result.stdout and ": PASS in " in result.stdout
    assert "  pass     finding " in result.stdout and "  skip     trainer_stop_requested" in result.stdout
    assert "step finding..." in result.stderr, "the current step is shown while the drill runs"
    (stored,) = cli_node.client.get("/v1/drills").json()["runs"]
    assert stored["trigger"] == "cli" and stored["spec"] == "gpu=1,preset=xid79"


def test_failed_drill_exits_1_and_names_the_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node = start_drill_node(tmp_path, **{"rules.disabled": "xid"})
    monkeypatch.setattr("gpuwatch.drills.daemon_client.HttpApi", lambda config, **_: ClientApi(node))
    try:
        result = invoke("--inject", "gpu=0,preset=xid79", env={"GPUWATCH_DRILLS_EVENT_DETECT_TIMEOUT_S": "0.5"})
        assert result.exit_code == 1, result.stdout
        assert ": FAIL in " in result.stdout and "  not run  alert_metric" in result.stdout
        assert "drill inject FAILED at step finding: not within 0.5 s: GPU 0 findings: none" in result.stderr
        (stored,) = node.client.get("/v1/drills").json()["runs"]
        assert stored["result"] == "fail" and stored["broke_at"] == "finding"
    finally:
        node.close()


def test_json_verdict(cli_node: SimNode) -> None:
    result = invoke("--inject", "gpu=2,preset=ecc_dbe", "--json")
    body = json.loads(result.stdout)
    assert (
        result.exit_code == 0
        and body["result"] == "pass"
        and body["steps"][1]["detail"].startswith("ecc_uncorrectable (unhealthy")
    )


def test_dry_run_inject_prints_the_plan_and_injects_nothing(cli_node: SimNode) -> None:
    result = invoke("--inject", "gpu=1,preset=clock_low,for=300", "--dry-run")
    assert result.exit_code == 0, result.stdout
    assert result.stdout.startswith("plan: drill inject on GPU 1")
    assert " 1. inject " in result.stdout and " 2. finding " in result.stdout and "(deadline 108 s)" in result.stdout
    assert result.stdout.rstrip().endswith("dry run: nothing was done")
    assert cli_node.client.get("/v1/injections").json() == {"injections": []}


def test_reset_without_yes_is_a_dry_run_that_changes_nothing(
    tools: Tools, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = FakeDaemon([fake_gpu(0)])
    monkeypatch.setattr("gpuwatch.drills.daemon_client.HttpApi", lambda config, **_: fake)
    env = {"GPUWATCH_TOOLS_NVIDIA_SMI": str(tools.nvidia_smi), "GPUWATCH_TOOLS_SYSFS_ROOT": str(tools.sysfs)}
    for option in ("--reset-gpu", "--pcie-remove"):
        result = invoke(option, "0", env=env)
        assert result.exit_code == 0, (result.stdout, result.stderr)
        assert f"run {tools.nvidia_smi} -r -i 0" in result.stdout or "write 1 to" in result.stdout
        assert result.stdout.rstrip().endswith("dry run: nothing was done; add --yes to do it")
    assert fake.posts == []
    assert all(argv[1].startswith("--query-compute-apps") for argv in tools.argv()), tools.argv()
    assert (tools.sysfs / "bus/pci/devices/0000:18:00.0/remove").read_text() == ""
    assert (tools.sysfs / "bus/pci/rescan").read_text() == ""


def test_refusals_are_one_line_exit_2(cli_node: SimNode, tools: Tools) -> None:
    env = {"GPUWATCH_TOOLS_NVIDIA_SMI": str(tools.nvidia_smi)}
    one_line_error(invoke("--reset-gpu", "0", "--yes", env=env), "GPU 0 has processes that are not trainers on it")
    one_line_error(invoke("--kill-rank", "1", "--yes"), "no trainer on GPU 1 (trainers: none)")
    one_line_error(invoke("--inject", "gpu=7,preset=xid79"), "the daemon has no GPU 7")
    one_line_error(invoke("--dcgm-inject", "gpu=0,field=230,value=79"), "the daemon reads sim, so it never sees")
    assert cli_node.gpu(0)["quarantined"] is False


def test_unreachable_daemon_is_one_line() -> None:
    one_line_error(
        invoke("--inject", "gpu=0,preset=xid79", "--listen", "127.0.0.1:1"), "cannot reach the gpuwatch daemon"
    )
