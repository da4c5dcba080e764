"""What host snapshots cost a one-GPU training loop, mode by mode, from the loop's own step log.

The loop is the one docs/snapshots.md shows: a stack of fp32 Linear layers built on the CPU with
torch's default init, then moved; AdamW (the whole state changes every step); one step is forward,
backward, update and `loss.item()` (the loop's own log, so a step ends when the GPU is done with
it); `HostSnapshot(..., optimizer=opt, replicated=True)`. Per state size it runs, one after the
other on the same model: no snapshots, every 8, every 4, "auto" (each `steps` steps), and reports
per run the wall time and the steady mean step against the plain loop, the longest step, the GPU
memory the snapshots took, K, the mode and the steps a death may lose. The first run with
snapshots starts with a fresh HostSnapshot, so its longest step includes the slots' set-up.

`nearly_full`: the same with a ballast tensor that leaves less free GPU memory than the state's
size (the mode then chosen, and its cost); `restore_time`: a committed snapshot restored onto the
GPU in process (its CUDA context up) and loaded into the model and the optimizer.

Only torch and gpuwatch.snapshots: `python -m gpuwatch.bench.snapshot_cost` runs it on a GPU machine, and
the recovery section of `gpuwatch bench` prints the same columns.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

WIDTH = 8192
STEADY_SKIP = 20  # steps at the start of a run left out of its steady mean
MODES: tuple[tuple[str, int | str | None], ...] = (("none", None), ("every 8", 8), ("every 4", 4), ("auto", "auto"))


@dataclass
class Loop:
    """A model, its optimizer and a batch on one device: the training loop whose steps are timed."""

    model: Any
    optim: Any
    x: Any
    device: Any
    state_bytes: int
    step: int = 0

    def train_step(self) -> float:
        loss = self.model(self.x).square().mean()
        loss.backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        self.step += 1
        return float(loss.item())

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}


@dataclass
class Run:
    """One run of the loop: its step times and what the snapshots said at its end."""

    name: str
    times: list[float]
    setup_times: list[float] = field(default_factory=list)  # steps before the slots were ready (first run only)
    stats: dict[str, Any] = field(default_factory=dict)
    peak_gpu_bytes: int = 0  # the device's peak allocation during the run, over what was allocated at its start

    @property
    def wall_s(self) -> float:
        return sum(self.times)

    @property
    def steady_s(self) -> float:
        return statistics.fmean(self.times[STEADY_SKIP:] or self.times)

    @property
    def longest_s(self) -> float:
        return max(self.times + self.setup_times)


def build(gib: float, device: Any, batch: int, width: int = WIDTH) -> Loop:
    """A Linear stack whose weights and AdamW moments come to about `gib`, built on the CPU, then moved."""
    import torch

    layers = max(1, round(gib * 2**30 / (12 * width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-6)
    x = torch.randn(batch, width, device=device)
    loop = Loop(model, optim, x, device, 0)
    for _ in range(3):  # AdamW's moments exist from the first update on
        loop.train_step()
    loop.state_bytes = sum(t.numel() * t.element_size() for t in _tensors(loop.state()))
    return loop


def measure_modes(loop: Loop, steps: int, job_id: str, *, modes: tuple[tuple[str, Any], ...] = MODES) -> list[Run]:
    """Each mode for `steps` steps, one after the other; one HostSnapshot, set up in the first run with one."""
    from gpuwatch.snapshots import HostSnapshot

    runs: list[Run] = []
    snap: Any = None
    try:
        for name, every in modes:
            base = _allocated(loop.device)
            _reset_peak(loop.device)
            if every is None:
                times = _timed(loop, steps, None)
                runs.append(Run(name, times, peak_gpu_bytes=max(0, _peak(loop.device) - base)))
                continue
            setup: list[float] = []
            if snap is None:
                snap = HostSnapshot(loop.state, every=every, optimizer=loop.optim, replicated=True, job_id=job_id)
                setup = _until_ready(loop, snap)
            else:
                _switch(snap, every)
            times = _timed(loop, steps, snap)
            snap.wait()
            runs.append(Run(name, times, setup, snap.stats(), max(0, _peak(loop.device) - base)))
    finally:
        if snap is not None:
            snap.close(remove=False)  # the slots stay for the next HostSnapshot of this job (nearly_full)
    return runs


def nearly_full(loop: Loop, steps: int, job_id: str, every: int = 8) -> tuple[Run, int]:
    """The loop with a ballast that leaves less free GPU memory than the state's size; the run and the ballast.

    The ballast is taken after a step has put the loop's own peak back in torch's cache (emptying the
    cache first gives back an earlier staging buffer, and with it the loop's gradients and activations),
    so the loop still fits; where the GPU still runs out of memory, the ballast shrinks by half the state's
    size and the run is tried again (three tries).
    """
    import torch

    extra = 0
    for _ in range(3):
        ballast = _ballast(loop, keep=loop.state_bytes // 2 + extra)
        size = 0 if ballast is None else ballast.numel()
        try:
            (run,) = measure_modes(loop, steps, job_id, modes=((f"every {every}, GPU nearly full", every),))
            return run, size
        except torch.cuda.OutOfMemoryError:
            extra += loop.state_bytes // 2  # keep that much more free on the next try
        finally:
            del ballast
            _empty_cache(loop.device)
    raise RuntimeError("the loop ran out of GPU memory beside the ballast three times")


def _ballast(loop: Loop, keep: int) -> Any:
    """A GPU tensor that leaves about `keep` bytes free beside the loop's cached peak (None on the CPU or no room)."""
    import torch

    if loop.device.type != "cuda":
        return None
    _empty_cache(loop.device)  # an earlier staging buffer cached by torch's allocator is free memory too
    loop.train_step()  # the loop's own peak (gradients, activations) back in torch's cache
    _sync(loop.device)
    free, _total = torch.cuda.mem_get_info(loop.device)
    want = free - keep
    while want > 0:
        try:
            return torch.empty(want, dtype=torch.uint8, device=loop.device)
        except torch.cuda.OutOfMemoryError:
            want -= 256 << 20
    return None


def restore_time(loop: Loop, job_id: str) -> dict[str, Any]:
    """A snapshot of the current step, then restored onto the device in process and loaded: seconds, exactness."""
    import torch

    from gpuwatch.snapshots import HostSnapshot

    snap = HostSnapshot(loop.state, every=10**6, optimizer=loop.optim, replicated=True, job_id=job_id)
    try:
        snap.ready(wait=True)
        if not snap.snapshot_now(loop.step):
            return {"error": f"no snapshot committed: {snap.stats()['disabled_reason']}"}
        expected = [t.detach().clone().cpu() for t in _tensors(loop.state())]
        _sync(loop.device)
        started = time.perf_counter()
        restored = snap.restore(device=loop.device if loop.device.type == "cuda" else None)
        restore_s = time.perf_counter() - started
        assert restored is not None
        loop.model.load_state_dict(restored.state["model"])
        loop.optim.load_state_dict(restored.state["optim"])
        _sync(loop.device)
        total_s = time.perf_counter() - started
        exact = all(torch.equal(a, b.cpu()) for a, b in zip(expected, _tensors(loop.state()), strict=True))
        del restored
    finally:
        snap.close(remove=True)
    return {"gib": loop.state_bytes / 2**30, "restore_s": restore_s, "restore_and_load_s": total_s, "exact": exact}


def cleanup(job_id: str) -> None:
    """Remove the job's slots (a HostSnapshot that finishes without having run)."""
    from gpuwatch.snapshots import HostSnapshot

    HostSnapshot(dict, job_id=job_id).close(remove=True)


def rows(gib: float, runs: list[Run], plain: Run | None = None) -> list[dict[str, Any]]:
    """The table's rows: each run against the plain one (default the run named "none", else the first)."""
    plain = plain or next((run for run in runs if run.name == "none"), runs[0])
    out = []
    for run in runs:
        stats = run.stats
        out.append({
            "gib": round(gib, 2),
            "mode": run.name,
            "steps": len(run.times),
            "wall_s": round(run.wall_s, 3),
            "wall_vs_plain": run.wall_s / plain.wall_s - 1,
            "steady_ms": round(run.steady_s * 1e3, 2),
            "steady_vs_plain": run.steady_s / plain.steady_s - 1,
            "longest_ms": round(run.longest_s * 1e3, 1),
            "longest_x_plain": run.longest_s / plain.steady_s,
            "setup_longest_ms": round(max(run.setup_times) * 1e3, 1) if run.setup_times else None,
            "gpu_mib": round(stats.get("gpu_bytes", 0) / 2**20, 1),
            "peak_gpu_mib": round(max(0, run.peak_gpu_bytes - plain.peak_gpu_bytes) / 2**20, 1),
            "K": stats.get("every"),
            "snapshot_mode": stats.get("mode"),
            "cost_share": stats.get("cost_share"),
            "loss_bound_steps": stats.get("loss_bound_steps"),
            "snapshots": stats.get("snapshots"),
            "window_snapshots": stats.get("window_snapshots"),
            "ready_s": stats.get("ready_s"),
        })  # fmt: skip
    return out


COLUMNS = (
    "GiB", "mode", "wall s (vs plain)", "steady step ms (vs plain)", "longest step ms (x plain)", "set-up longest ms",
    "GPU MiB held (peak extra)", "K", "snapshot mode", "cost_share", "loss bound",
)  # fmt: skip


def markdown(table: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in table:
        share = "-" if r["cost_share"] is None else f"{r['cost_share']:+.2%}"
        cells = [
            f"{r['gib']:g}",
            r["mode"],
            f"{r['wall_s']:.2f} ({r['wall_vs_plain']:+.2%})",
            f"{r['steady_ms']:.2f} ({r['steady_vs_plain']:+.2%})",
            f"{r['longest_ms']:.1f} ({r['longest_x_plain']:.1f}x)",
            "-" if r["setup_longest_ms"] is None else f"{r['setup_longest_ms']:.1f}",
            f"{r['gpu_mib']:g} ({r['peak_gpu_mib']:g})",
            "-" if r["K"] is None else str(r["K"]),
            r["snapshot_mode"] or "-",
            share,
            "-" if r["loss_bound_steps"] is None else str(r["loss_bound_steps"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- helpers ------------------------------------------------------------------------------------------


def _timed(loop: Loop, steps: int, snap: Any) -> list[float]:
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        loop.train_step()
        if snap is not None:
            snap.step(loop.step)
        times.append(time.perf_counter() - started)
    return times


def _until_ready(loop: Loop, snap: Any, limit_s: float = 300.0) -> list[float]:
    """Steps until the slots are set up (off the training thread): their times."""
    times: list[float] = []
    deadline = time.perf_counter() + limit_s
    while snap.enabled and snap.ready_step is None and time.perf_counter() < deadline:
        times.extend(_timed(loop, 1, snap))
    return times


def _switch(snap: Any, every: int | str) -> None:
    """Another cadence for the same HostSnapshot (its slots are set up once), measured afresh."""
    snap.wait()
    snap._pacing.restart(every if every == "auto" else int(every))


def _tensors(state: Any) -> list[Any]:
    import torch

    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, list | tuple):
        return [t for v in state for t in _tensors(v)]
    return []


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: Any) -> int:
    import torch

    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def _reset_peak(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: Any) -> int:
    import torch

    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0


def _empty_cache(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
