"""`gpuwatch bench`: run the measurements, print the table, write the JSON.

It exits 0 whatever the figures are (targets are informational), 1 when a measurement could not run
at all (its error is in the table and the JSON), 2 on a bad flag or a backend that is not there.
The measurement modules are imported only when the command runs, so `gpuwatch` starts as fast as before.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import os
import platform
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from gpuwatch import __version__
from gpuwatch.base.command_error import FiniteFloatRange, OneLineCommand, fail

# In the order they run: the long footprint and the trainer jobs come last.
SECTIONS = (
    "sampling",
    "trainer",
    "serving",
    "detection",
    "footprint",
    "remediation",
    "interference",
    "recovery",
    "scale",
)
DEFAULT_SIM_GPUS = 8
TABLE_WIDTH = 150  # when stdout is not a terminal (a file, CI): rich would wrap at 80


def parse_only(value: str | None) -> list[str]:
    """The sections `--only` names (all when None), in run order; exits 2 on an unknown or empty list."""
    if value is None:
        return list(SECTIONS)
    names = [part.strip() for part in value.split(",") if part.strip()]
    unknown = [name for name in names if name not in SECTIONS]
    if unknown or not names:
        what = f"unknown section(s) {', '.join(unknown)}" if unknown else "no section named"
        fail(f"--only: {what} (choose from {','.join(SECTIONS)})")
    return [name for name in SECTIONS if name in names]


def parse_names(flag: str, value: str | None, choices: tuple[str, ...]) -> tuple[str, ...] | None:
    """The names a list flag gives, in the order of `choices` (`all`: every one; None when not given); exits 2
    on an unknown or empty list."""
    if value is None:
        return None
    names = [part.strip() for part in value.split(",") if part.strip()]
    if names == ["all"]:
        return choices
    unknown = [name for name in names if name not in choices]
    if unknown or not names:
        what = f"unknown name(s) {', '.join(unknown)}" if unknown else "no name given"
        fail(f"{flag}: {what} (choose from {','.join(choices)}, or all)")
    return tuple(name for name in choices if name in names)


@click.command(cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--backend", type=click.Choice(["sim", "nvml"]), default="nvml", show_default=True, help="What to sample."
)
@click.option("--gpus", type=click.IntRange(1, 64), help="sim: GPUs to simulate (default 8); nvml: the first N.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the figures here.")
@click.option("--quick", is_flag=True, help="Short runs (a smoke test): fewer rounds, shorter windows, 20 s footprint.")
@click.option("--only", help=f"Comma-separated sections to run (default all): {','.join(SECTIONS)}.")
@click.option("--footprint-s", type=FiniteFloatRange(min=1.0), help="Footprint period in s (default 600, quick 20).")
@click.option(
    "--interference-s",
    type=FiniteFloatRange(min=0.0),
    help="Interference: seconds of the monitors' interleaved rounds, every step kind (default 120; fewer: 2 rounds).",
)
@click.option(
    "--interference-segment-s",
    type=FiniteFloatRange(min=0.1),
    help="Interference: seconds of one timed segment of those rounds (default 3, quick 0.4).",
)
@click.option(
    "--interference-conditions",
    help="Interference: what runs beside the job, comma-separated, or all "
    "(default gpuwatch_1s,gpuwatch_1s_event_set,nvitop_exporter_1s).",
)
@click.option("--interference-steps", help="Interference: the job's steps, short,long or one (default short).")
@click.option(
    "--interference-restart/--interference-freeze",
    default=True,
    help="Interference: start and stop each monitor around its segments (default), or freeze it between them.",
)
@click.option(
    "--event-set-s",
    type=FiniteFloatRange(min=0.0),
    help="Interference: seconds of the event-set probe, an idle NVML event set against none (default 50; 0: none).",
)
@click.option(
    "--attribute-s",
    type=FiniteFloatRange(min=0.0),
    help="Interference: seconds each NVML call kind is timed in the attribution (default 0: not run; 1.5 runs it).",
)
@click.option(
    "--attribute-rate",
    type=FiniteFloatRange(min=1.0, max=100000.0),
    help="Interference: calls a second of the attribution's helper (default 1000).",
)
def bench(
    backend: str,
    gpus: int | None,
    json_path: Path | None,
    quick: bool,
    only: str | None,
    footprint_s: float | None,
    interference_s: float | None,
    interference_segment_s: float | None,
    interference_conditions: str | None,
    interference_steps: str | None,
    interference_restart: bool,
    event_set_s: float | None,
    attribute_s: float | None,
    attribute_rate: float | None,
) -> None:
    """Measure gpuwatch's overhead and latency against the NVML floor and its peers; targets are informational."""
    from rich.console import Console

    from gpuwatch.bench import interference
    from gpuwatch.bench.harness import Context, InterferenceFlags, progress
    from gpuwatch.bench.report import Section, Skip, print_table, write_json

    chosen = parse_only(only)
    flags = InterferenceFlags(
        rounds_s=interference_s,
        segment_s=interference_segment_s,
        conditions=parse_names("--interference-conditions", interference_conditions, tuple(interference.CONDITIONS)),
        steps=parse_names("--interference-steps", interference_steps, interference.STEPS),
        restart=interference_restart,
        event_set_s=event_set_s,
        attribute_s=attribute_s,
        attribute_rate=attribute_rate,
    )
    machine, gpus = _machine(backend, gpus)
    with tempfile.TemporaryDirectory(prefix="gpuwatch-bench-") as workdir:
        ctx = Context(
            backend=backend,
            gpus=gpus,
            quick=quick,
            footprint_s=footprint_s or (20.0 if quick else 600.0),
            workdir=Path(workdir),
            interference=flags,
        )
        header: dict[str, Any] = {
            "tool": "gpuwatch bench",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "mode": "quick" if quick else "full",
            "backend": backend,
            "gpus": gpus,
            "sections_run": chosen,
            "machine": machine,
            "versions": _versions(),
        }
        progress(f"{header['mode']} run of {', '.join(chosen)} on {backend} with {gpus} GPU(s)")
        sections: list[Section] = []
        for name in chosen:
            runner: Callable[[Context], Section] = importlib.import_module(f"gpuwatch.bench.{name}").run
            started = time.monotonic()
            try:
                section = runner(ctx)
            except Skip as exc:
                section = Section(name, "skipped", str(exc))
            except Exception as exc:  # one measurement that breaks must not lose the others' figures
                section = Section(name, "error", f"{type(exc).__name__}: {exc}")
            section.figures["wall_s"] = time.monotonic() - started
            progress(f"{name}: {section.status}" + (f": {section.reason}" if section.reason else ""))
            sections.append(section)
    print_table(header, sections, Console(width=None if sys.stdout.isatty() else TABLE_WIDTH))
    if json_path is not None:
        write_json(json_path, header, sections)
        progress(f"wrote {json_path}")
    sys.exit(1 if any(s.status == "error" for s in sections) else 0)


def _machine(backend: str, gpus: int | None) -> tuple[dict[str, Any], int]:
    """Hostname, CPUs and the GPUs as the backend sees them; and how many GPUs the bench measures.

    Exits 2 with one line when the backend is not there (NVML without a driver or GPU).
    """
    from gpuwatch.bench.harness import Context
    from gpuwatch.bench.sampling import bench_config, open_backend
    from gpuwatch.errors import GpuwatchError

    wanted = gpus or (DEFAULT_SIM_GPUS if backend == "sim" else 64)
    ctx = Context(backend=backend, gpus=wanted, quick=True, footprint_s=0.0, workdir=Path(tempfile.gettempdir()))
    try:
        instance, statics = open_backend(ctx, bench_config(ctx))
    except GpuwatchError as exc:
        hint = "" if backend == "sim" else "; on a machine without GPUs use --backend sim"
        fail(f"bench --backend {backend}: {exc}{hint}")
    try:
        driver = _nvml_driver() if backend == "nvml" else None
    finally:
        instance.close()
    machine = {
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "gpu_names": [s.name for s in statics],
        "gpu_driver": driver,
    }
    return machine, len(statics)


def _nvml_driver() -> str:
    import pynvml

    version: str | bytes = pynvml.nvmlSystemGetDriverVersion()
    return version.decode() if isinstance(version, bytes) else version


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or None


def _versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"gpuwatch": __version__, "python": platform.python_version()}
    for key, dist in (("pynvml", "nvidia-ml-py"), ("torch", "torch"), ("nvitop_exporter", "nvitop-exporter")):
        try:
            versions[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[key] = None
    return versions
