"""README.md and the user docs: short, for users, every command real, every link somewhere; the quick start run
as written (the daemon line in a fresh venv of a copy of the checkout; the test line's venv, install and pytest are
.ci/run's)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import click
import pytest

from gpuwatch.cli import main
from gpuwatch.testing.daemon_process import free_port
from tests.helpers import start_sim_node

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
USER_DOCS = [
    README,
    REPO / "systemd" / "README.md",
    REPO / "dashboards" / "RUNBOOK.md",
    *sorted((REPO / "docs").glob("*.md")),
]
# Lab notes have no place in a user's page: issue numbers, work sessions, the machines measurements ran on.
LAB_NOTES = re.compile(
    r"\bissue \d+|\bstop \d+\b|\bround \d+\b|\b(first|second|third) round\b|\blent\b|\bthe lead\b|\bhelpers?\b"
    r"|\bthis session\b|\bdevice time\b",
    re.IGNORECASE,
)
# Pages the README links that other branches add (they are merged together); drop a name once its page is in.
PENDING_PAGES = {
    "docs/recovery-in-place.md",
    "docs/snapshots.md",
    "docs/security.md",
    "docs/performance-interference.md",
}


def quick_start() -> list[str]:
    block = README.read_text().split("<!-- quick start")[1].split("<!-- end of quick start -->")[0]
    code = block.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line for line in code.splitlines() if line.strip()]


def demo() -> list[str]:
    block = README.read_text().split("<!-- demo:")[1].split("<!-- end of demo -->")[0]
    code = block.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line for line in code.splitlines() if line.strip()]


def test_the_readme_is_short() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, len(lines)


def test_the_user_docs_hold_no_lab_notes() -> None:
    found = {
        f"{page.relative_to(REPO)}:{n}": line.strip()
        for page in USER_DOCS
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if LAB_NOTES.search(line)
    }
    assert found == {}


def test_every_relative_link_leads_to_a_file() -> None:
    missing = set()
    for page in USER_DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            path = (page.parent / target).resolve()
            if not path.exists():
                missing.add(str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path))
    assert missing <= PENDING_PAGES, sorted(missing - PENDING_PAGES)


def test_the_quick_start_is_two_commands_and_ci_runs_the_second() -> None:
    """CI makes the test line's venv, installs its extra once, and runs its pytest as two lanes that make the whole:
    the fast one in parallel, then the slow one."""
    daemon, tests = quick_start()
    assert daemon.startswith("python3 -m venv .venv && ") and "/gpuwatch run --backend sim " in daemon
    assert tests == "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest"
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert ci.count("python3 -m venv .venv") == 1 and ". .venv/bin/activate" in ci
    assert [line for line in ci if "pip install" in line and "-e" in line] == ["python -m pip install -q -e '.[test]'"]
    lanes = [line for line in ci if line.startswith("python -m pytest")]
    assert lanes == ['python -m pytest -m "not slow" -n auto', "python -m pytest -m slow"]


def _command(words: list[str]) -> click.Command:
    command: click.Command = main
    for word in words:
        assert isinstance(command, click.Group) and word in command.commands, (words, word)
        command = command.commands[word]
    return command


def _code(text: str) -> list[str]:
    """The README's shell: each line of its sh blocks, and each `code span` outside blocks."""
    found: list[str] = []
    fence: str | None = None  # the language of the block we are in
    for line in text.splitlines():
        if line.startswith("```"):
            fence = line[3:] if fence is None else None
        elif fence == "sh":
            found.append(line)
        elif fence is None:
            found += [span.replace("\\|", "|") for span in re.findall(r"`([^`]+)`", line)]
    return found


def test_every_command_and_option_the_readme_names_exists() -> None:
    """The commands table, the quick start and the examples: each `gpuwatch SUB [SUB] --option` is real."""
    checked = 0
    for code in _code(README.read_text()):
        for words, rest in re.findall(r"(?:^|[\s/])gpuwatch ((?:[a-z]+ ?)+)(.*)", code):
            command = _command(words.split()[:1])
            if isinstance(command, click.Group) and words.split()[1:2] and words.split()[1] in command.commands:
                command = command.commands[words.split()[1]]
            known = {opt for param in command.params for opt in param.opts + param.secondary_opts} | {"--help"}
            options = re.findall(r"(?<![\w-])--[a-z][a-z-]*", rest.split(" -- ")[0])  # the job's own come after --
            for option in options:
                assert option in known, (code, option)
                checked += 1
    assert checked > 30, checked  # not vacuous


def test_the_demo_node_spends_its_breaker_budget_in_15_minutes(tmp_path: Path) -> None:
    """What the README says of the demo node: GPU 5 is quarantined at once and GPU 3 once degraded for 15 minutes;
    after that the node's circuit breaker refuses the quarantine a drill's fault calls for."""
    node = start_sim_node(tmp_path, "demo")
    try:
        node.run_for(14 * 60)
        assert node.gpu(5)["quarantined"] and (node.gpu(3)["state"], node.gpu(3)["quarantined"]) == ("degraded", False)
        node.run_for(2 * 60)
        assert node.gpu(3)["quarantined"]
        drill = {"event": "xid", "xid": 79, "duration_s": 600}  # `gpuwatch drill --inject 'gpu=0,preset=xid79'`
        assert node.client.post("/v1/gpus/0/inject", json=drill, headers=node.auth).status_code == 200
        node.run_for(30)
        assert (node.gpu(0)["state"], node.gpu(0)["quarantined"]) == ("unhealthy", False)
    finally:
        node.close()


@pytest.mark.slow
def test_the_quick_start_daemon_and_the_demo_run_as_written(tmp_path: Path) -> None:
    """The first line in a fresh copy of the checkout (its own venv, from the package index as a user's would
    be), its /tmp/gpuwatch moved into the test's tmp dir and its port picked free; then the status command, and
    the training demo's lines in order in that venv: it ends with a resume and leaves no quarantine behind."""
    checkout = tmp_path / "checkout"
    ignore = shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info", "build", "dist", ".*_cache")
    shutil.copytree(REPO, checkout, ignore=ignore)
    scratch = str(tmp_path / "gpuwatch")
    daemon_line = quick_start()[0].replace("/tmp/gpuwatch", scratch)
    listen = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUWATCH_", "VIRTUAL_ENV", "PYTHONPATH"))}
    env |= {"GPUWATCH_CONFIG": "", "GPUWATCH_LISTEN": listen}
    log = (tmp_path / "daemon.log").open("w")
    process = subprocess.Popen(
        ["bash", "-c", daemon_line], cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        gpus = _wait_for_both_faults(f"http://{listen}", process, tmp_path / "daemon.log")
        assert (gpus[3]["state"], gpus[5]["state"], gpus[5]["quarantined"]) == ("degraded", "unhealthy", True)
        status_line = ".venv/bin/gpuwatch status --state-dir /tmp/gpuwatch/state"
        assert status_line in README.read_text()
        status = subprocess.run(
            status_line.replace("/tmp/gpuwatch", scratch).split(), cwd=checkout, env=env, capture_output=True, text=True
        )
        assert status.returncode == 0, status.stderr
        assert "GPU 5, " in status.stdout and "state: unhealthy, quarantined: yes" in status.stdout
        _run_the_demo(checkout, scratch, env, f"http://{listen}")
    finally:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C, as the README says
        code = process.wait(timeout=60)
        log.close()
    assert code == 0, (tmp_path / "daemon.log").read_text()[-3000:]


def _run_the_demo(checkout: Path, scratch: str, env: dict[str, str], url: str) -> None:
    """The demo's lines as written, pasted into one shell, but torch from wherever pip is configured to take it (the
    README's CPU index may be out of reach here): the job resumes on the GPUs left without losing a step, and GPU 1
    is back in service at the end."""
    lines = demo()
    cpu_build = (
        ".venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu && .venv/bin/pip install numpy"
    )
    assert lines[0] == cpu_build and "kill -0 $! && " in lines[2]
    lines[0] = ".venv/bin/pip install torch numpy"
    done = subprocess.run(
        ["bash", "-c", "\n".join(lines).replace("/tmp/gpuwatch", scratch)],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    said = done.stdout + done.stderr
    print(said[-3000:])
    assert done.returncode == 0, said[-4000:]
    summary = json.loads(next(line for line in done.stdout.splitlines() if line.startswith('{"steps_done"')))
    assert (summary["restarts"], summary["lost_steps"], summary["world_sizes"]) == (1, 0, [2, 2]), summary
    assert "gpuwatch launch: launch 2 resumed from step " in said and "2 rank(s) on GPU 0,2" in said, said[-3000:]
    assert "none of its ranks there reports" not in said  # the daemon stopped the ranks it hears from itself
    with urllib.request.urlopen(url + "/v1/gpus/1", timeout=5) as response:
        assert json.loads(response.read())["quarantined"] is False


def _wait_for_both_faults(url: str, process: subprocess.Popen[bytes], log: Path) -> dict[int, dict[str, Any]]:
    deadline = time.monotonic() + 480  # the venv and its packages first, then a minute of the demo
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(url + "/v1/gpus", timeout=5) as response:
                gpus = {g["index"]: g for g in json.loads(response.read())["gpus"]}
            if gpus[3]["state"] == "degraded" and gpus[5]["quarantined"]:
                return gpus
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"the demo's faults were not flagged: {log.read_text()[-3000:]}")
