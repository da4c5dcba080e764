"""`gpuwatch launch --in-place`: run one worker per usable GPU and keep the job going through faults.

torchrun's rule, one worker failed so stop them all, is what an in-place job must not have, so
this launcher runs the node's workers itself with torch's own parts: a store for the job that only
clients proving the job's secret reach (gpuwatch.inplace.jobstore; the launcher hosts it on
loopback, or at --rdzv-endpoint, or connects to the one there on another node), one worker per GPU
with CUDA_VISIBLE_DEVICES set to that GPU's UUID, and the membership in generations
(gpuwatch.inplace.coordinator, run by the launcher that hosts the store).

* A worker exits: its exit is published at once (`gone`), so the survivors form the next
  generation without waiting for any timeout. A worker that died is replaced on the same GPU when
  the daemon still calls it usable (counted against --max-restarts); one that left because its GPU
  was quarantined (exit 75) is not, until the daemon releases that GPU. With spares, every worker
  runs under the spare's runner, whose last word tells a job that ended from one that was killed as
  soon as the process's exit begins (/proc): a killed worker is published and replaced then, not
  when the kernel and the driver have freed its memory, where the GPU has room for both.
* Every second the daemon's GPU list is read: a released GPU (or one that became usable) with no
  worker gets one, which joins the job and takes the state from a peer.
* When no member is left at all, new workers start on the usable GPUs and the first of them loads
  the newest checkpoint (relaunch and load, the old path); with no usable GPU it stops (exit 3).

Workers run in sessions of their own; SIGINT and SIGTERM to the launcher are passed to them.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch.distributed as dist

from gpuwatch.errors import GpuwatchError
from gpuwatch.inplace.jobstore import JobStore, StoreServer
from gpuwatch.inplace.protocol import (
    GONE,
    JOB_ENV,
    MEMBER_ENV,
    NODE,
    NODE_ENV,
    STORE_ENV,
    append_event,
    job_prefix,
    latest_generation,
    read_generation,
)
from gpuwatch.inplace.relay import RELAY_ENV, NodeRelay, node_relay
from gpuwatch.inplace.secret import SECRET_FILE_ENV, SecretError, new_secret_file, read_secret
from gpuwatch.launcher.coordination import coordinate
from gpuwatch.launcher.exit_dates import ExitDates
from gpuwatch.launcher.join_watch import DEFAULT_JOIN_WITHIN_S, JoinWatch
from gpuwatch.spares.pool import Spare, SparePool
from gpuwatch.spares.room import held_by
from gpuwatch.trainer.contract import (
    EXIT_RESUME,
    FREEING_ENV,
    RUNTIME_DIR_ENV,
    SPARE_STAGE_ENV,
    SPARE_WARM_S_ENV,
    STANDBY_BESIDE_ENV,
)

EXIT_STOPPED = 3


@dataclass(frozen=True)
class GpuView:
    """One GPU as the daemon sees it now: whether a job may use it, and its quarantine epoch."""

    index: int
    uuid: str
    usable: bool  # neither quarantined nor unhealthy
    epoch: int  # grows with every quarantine: a higher one than at a worker's start means quarantined since


GpuList = Callable[[], list[GpuView]]
"""The node's GPUs by index; raises GpuwatchError when the daemon cannot be asked."""

_POLL_S = 0.02
_REPLACE_AFTER_S = 1.0  # a dead worker's GPU: let the daemon judge it before a replacement starts there
# ... shorter when a warm spare takes the rank: the daemon is asked again just before. A GPU's own fault
# (an XID in the kernel log) reached the daemon milliseconds after it happened, before the rank ended.
_SPARE_AFTER_S = 0.1
_EXIT_POLL_S = 0.005  # how often a spare-run worker's /proc/PID/stat is read for the start of its exit
_PF_EXITING = 0x4
_NO_WORD = -1  # the code published for a worker whose exit began without its runner's word (killed)
_STOP_GRACE_S = 30.0
STANDBY_HELD = (
    "RANK",
    "WORLD_SIZE",
    MEMBER_ENV,
    SPARE_WARM_S_ENV,
    SPARE_STAGE_ENV,
)  # what a standby learns at the hand-over
_STAGES = {
    "standby": "a standby at the job's join",
    "warm": "warm, without the job's set-up",
    "starting": "still starting",
}
_STORE_TIMEOUT = datetime.timedelta(seconds=600)


class InPlaceStopped(Exception):
    """The launcher's end other than success: one line, and the exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class InPlacePlan:
    """What an in-place launch needs: the job, its command, limits and where the job's store is."""

    job_id: str
    command: tuple[str, ...]
    runtime_dir: str
    nproc: int | None = None  # None: every usable GPU
    min_nproc: int = 1
    max_restarts: int = 3
    endpoint: str | None = None  # host:port of the job's store (multi-node); None: a local store
    nnodes: str | None = None  # "N" or "MIN:MAX": the first generation waits for MIN launchers
    daemon_poll_s: float = 1.0
    secret_file: str | None = None  # the job's secret (needed with an endpoint); None: a new one, this node only
    join_within_s: float = DEFAULT_JOIN_WITHIN_S  # a job none of whose workers joined by then is refused (exit 2)


@dataclass
class _Worker:
    member: str
    index: int
    uuid: str
    process: subprocess.Popen[bytes]
    code: int | None = None
    runner: Spare | None = None  # the spare's runner it runs under: its last word
    exit_t: float | None = None  # the Unix time its exit was seen to begin (or its reap, if that came first)


@dataclass
class _Gpus:
    """What the launcher knows about each GPU it used: replacements due, GPUs left for a quarantine."""

    replace_at: dict[str, float] = field(default_factory=dict)  # uuid -> when a replacement may start
    left: dict[str, int] = field(default_factory=dict)  # exit 75: uuid -> its epoch when the worker started
    epoch_at_start: dict[str, int] = field(default_factory=dict)
    used: set[str] = field(default_factory=set)
    rank_of: dict[str, tuple[int, int]] = field(default_factory=dict)  # uuid -> (RANK, WORLD_SIZE) of its worker


class Supervisor:
    """One node's launcher of an in-place job (see the module docstring)."""

    def __init__(
        self,
        plan: InPlacePlan,
        gpu_list: GpuList,
        echo: Callable[[str], None] = print,
        python: str = sys.executable,
        spares: SparePool | None = None,
    ) -> None:
        self.plan = plan
        self.spares = spares  # warm standby workers that take a dead worker's place (gpuwatch.spares)
        self.gpu_list = gpu_list
        self.echo = echo
        self.python = python
        self.workers: list[_Worker] = []
        self.gpus = _Gpus()
        self.restarts = 0
        self.finished = False
        self._count = 0
        self._stop = threading.Event()
        self._received: int | None = None
        self._stop_called = False
        self._exits: queue.Queue[tuple[_Worker, int, bool]] = queue.Queue()  # (worker, code, its exit only began)
        self._dying: dict[str, int] = {}  # uuid -> pid of a worker taken for dead whose process is not reaped yet
        self._await_reap: set[str] = set()  # GPUs without room for a replacement until their dying worker is reaped
        self._daemon_down = False
        self._server: StoreServer | None = None
        self._relay: NodeRelay | None = None  # the node's one watcher of the job's store, for its ranks
        self._coordinator: threading.Thread | None = None
        self._join_watch: JoinWatch | None = None  # until a worker joins: made when the store is open
        self._exit_dates = ExitDates(plan.runtime_dir)  # a death's onset, for the daemon's incident

    def run(self) -> int:
        """Run the job until it finishes; 0 on success.

        Raises:
            InPlaceStopped: too few usable GPUs, no member left and no GPU to restart on, interrupted.
            GpuwatchError: the daemon could not be asked before the first start.
        """
        gpus = [g for g in self.gpu_list() if g.usable]
        want = len(gpus) if self.plan.nproc is None else min(self.plan.nproc, len(gpus))
        if want < self.plan.min_nproc:
            raise InPlaceStopped(
                EXIT_STOPPED, f"{len(gpus)} usable GPU(s) on this node, fewer than --min-nproc {self.plan.min_nproc}"
            )
        chosen = gpus[:want]
        made = None if self.plan.secret_file else new_secret_file()
        try:
            return self._run(chosen, want, str(made or self.plan.secret_file))
        finally:
            self._exit_dates.close()
            if self._relay is not None:
                self._relay.close()
            if self._server is not None:
                self._server.close()
            if made is not None:
                shutil.rmtree(made.parent, ignore_errors=True)

    def _run(self, chosen: list[GpuView], want: int, secret_file: str) -> int:
        self.secret_file = secret_file
        store, address, hosting = self._open_store(secret_file)
        self._own_store = store  # a Python store that only torch holds loses its methods
        self.address = address
        self._relay = node_relay(address, read_secret(secret_file), job_prefix(self.plan.job_id))
        self.store = dist.PrefixStore(job_prefix(self.plan.job_id), store)
        self.node = self.store.add("nodes", 1) - 1
        self.echo(
            f"gpuwatch launch: in place: job {self.plan.job_id}, node {self.node}, {want} rank(s) on GPU "
            + ",".join(str(g.index) for g in chosen)
            + ("" if hosting else f", store at {address}")
        )
        append_event(self.store, NODE, node=self.node, workers=want)
        self._join_watch = JoinWatch(self.store, self.plan.join_within_s)
        for rank, gpu in enumerate(chosen):
            self._start(gpu, rank=rank, world=want)
        if self.spares is not None:
            self.spares.env = _worker_env(os.environ)
            if self.spares.standby:
                self.spares.standby_for(self.plan.command, self._standby_env, STANDBY_HELD, self._dying.__contains__)
            self.spares.start([g.uuid for g in chosen])
        coordinator = None
        if hosting:
            coordinator = threading.Thread(
                target=self._coordinate, args=(store,), name="gpuwatch-inplace-coordinator", daemon=True
            )
            coordinator.start()
        self._coordinator = coordinator
        in_main = threading.current_thread() is threading.main_thread()  # a bench runs it on a thread of its own
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM) if in_main}
        try:
            return self._supervise()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._stop.set()
            if self.spares is not None:
                self.spares.close()
            if coordinator is not None:
                coordinator.join(timeout=2)

    # -- the store ------------------------------------------------------------------------------

    def _open_store(self, secret_file: str) -> tuple[dist.Store, str, bool]:
        """Host the job's store (on loopback, or at the endpoint when it is here and free), else connect to it.

        The host's own store is the data itself (no connection); the others prove the secret to reach it.
        """
        host, _, port = (self.plan.endpoint or "127.0.0.1:0").rpartition(":")
        if not host or not port.isdigit():
            raise InPlaceStopped(2, f"--rdzv-endpoint {self.plan.endpoint!r} is not HOST:PORT")
        try:
            secret = read_secret(secret_file)
        except SecretError as exc:
            raise InPlaceStopped(2, str(exc)) from None
        if self.plan.endpoint is None:
            self._server = StoreServer(host, 0, secret)
            return self._server.data, f"{host}:{self._server.port}", True
        try:
            self._server = StoreServer(host, int(port), secret)
            return self._server.data, self.plan.endpoint, True
        except OSError:  # another node's launcher hosts it
            pass
        try:
            return JobStore(host, int(port), secret, _STORE_TIMEOUT), self.plan.endpoint, False
        except OSError as exc:
            raise InPlaceStopped(EXIT_STOPPED, f"the job's store at {self.plan.endpoint}: {exc}") from None

    def _coordinate(self, store: dist.Store) -> None:
        """The host's thread: the job's coordinator loop (launcher.coordination); it ends only with the launcher."""
        coordinate(
            dist.PrefixStore(job_prefix(self.plan.job_id), store), _min_nodes(self.plan.nnodes), self._stop, self.echo
        )

    # -- workers --------------------------------------------------------------------------------

    def _start(self, gpu: GpuView, *, rank: int = 0, world: int = 1, replacement: bool = False) -> None:
        index, uuid = gpu.index, gpu.uuid
        self.gpus.epoch_at_start[uuid] = gpu.epoch
        self.gpus.rank_of[uuid] = (rank, world)
        member = f"n{self.node}.g{index}.{self._count}"
        self._count += 1
        env = self._rank_env(uuid)
        env.update(RANK=str(rank), WORLD_SIZE=str(world))
        env[MEMBER_ENV] = member
        if self._relay is not None:
            env[RELAY_ENV] = str(self._relay.path)
        dying = self._dying.get(uuid) if replacement else None
        if dying is not None and (held := held_by(uuid, dying)):
            env[FREEING_ENV] = f"{dying}:{held}"  # about to be freed: the rank's snapshot staging counts it free
        runner = None
        if self.spares is not None and self.spares.count:
            waiting = self.spares.describe() if replacement else ""
            runner = self.spares.hand_over(self.plan.command, env, uuid) if replacement else None
            if runner is not None:
                pid, how = runner.process.pid, _STAGES[runner.stage()]
                self.echo(
                    f"gpuwatch launch: in place: a spare (pid {pid}, {how}) takes {member}'s place on GPU {index}"
                    f" (waiting then: {waiting})"
                )
            else:
                runner = self.spares.run_now(self.plan.command, env)
        try:
            process = runner.process if runner is not None else subprocess.Popen(
                [self.python, *self.plan.command], env=env, start_new_session=True
            )  # fmt: skip
        except OSError as exc:
            raise InPlaceStopped(2, f"cannot start {self.python}: {exc.strerror or exc}") from None
        worker = _Worker(member, index, uuid, process, runner=runner)
        self.workers.append(worker)
        self.gpus.used.add(uuid)
        # A thread blocked in waitpid per worker: its exit is known the moment it happens, at no cost meanwhile.
        threading.Thread(target=self._wait, args=(worker,), daemon=True).start()
        if runner is not None:
            threading.Thread(target=self._watch_exit, args=(worker,), daemon=True).start()

    def _rank_env(self, uuid: str) -> dict[str, str]:
        """The environment of a rank on GPU `uuid`, without its own keys (RANK, WORLD_SIZE, member id)."""
        env = _worker_env(os.environ)
        env.update(CUDA_VISIBLE_DEVICES=uuid, LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        env[NODE_ENV] = str(self.node)
        env[RUNTIME_DIR_ENV] = self.plan.runtime_dir
        env[JOB_ENV] = self.plan.job_id
        env[STORE_ENV] = self.address
        env[SECRET_FILE_ENV] = self.secret_file
        if self.spares is not None and self.spares.count and self.spares.standby:
            env[STANDBY_BESIDE_ENV] = "1"  # its snapshots leave the next standby's room on the GPU
        return env

    def _standby_env(self, uuid: str) -> dict[str, str] | None:
        """A standby's environment on GPU `uuid` (the pool holds the rank's own keys back); None where the GPU
        has no room for a second copy of what its live rank holds (NVML's free memory; a CPU job always has)."""
        live = [w for w in self._live() if w.uuid == uuid]
        if self.spares is not None and live and not self.spares.room_for(uuid, live[0].process.pid):
            self.echo(
                f"gpuwatch launch: in place: GPU {live[0].index}: no room beside the rank for a standby of the job:"
                " a spare waits there without the job's set-up"
            )
            return None
        return self._rank_env(uuid)

    def _wait(self, worker: _Worker) -> None:
        code = worker.process.wait()
        worker.exit_t = worker.exit_t or time.time()
        self._exits.put((worker, code, False))

    def _watch_exit(self, worker: _Worker) -> None:
        """A worker under the spare's runner is taken for dead at once (its reap comes when its memory is
        freed): when its job said it failed (a code other than 0 and 75: only the interpreter's shutdown
        is left), or when its exit began without a word (killed)."""
        assert worker.runner is not None
        while worker.code is None and not self._stop.is_set():
            word = worker.runner.last_word()
            if word in (0, EXIT_RESUME):
                return  # it ended by itself: the reap says so
            began = exit_began(worker.process.pid)
            if began is None:
                return  # reaped meanwhile: the waiter has it
            if word is not None or began:
                worker.exit_t = time.time()
                self._exits.put((worker, _NO_WORD if word is None else word, True))
                return
            time.sleep(_EXIT_POLL_S)

    def _live(self) -> list[_Worker]:
        return [w for w in self.workers if w.code is None]

    def _supervise(self) -> int:
        next_daemon = time.monotonic() + self.plan.daemon_poll_s
        while True:
            with contextlib.suppress(queue.Empty):
                self._exited(*self._exits.get(timeout=_POLL_S))
                while True:  # others that ended at the same time
                    self._exited(*self._exits.get_nowait())
            if self._received is not None:
                return self._shut_down()
            if self.spares is not None:
                self.spares.tick()  # the spare behind a rank handed over starts once that rank stepped
            self._refuse_a_job_that_never_joins()
            if self._coordinator is not None and not self._coordinator.is_alive():
                self._terminate_workers()
                raise InPlaceStopped(EXIT_STOPPED, "the job's coordinator ended: the job stops (its ranks would wait)")
            if not self._live():
                if self.finished:
                    self.echo(f"gpuwatch launch: job {self.plan.job_id} finished after {self.restarts} restart(s)")
                    return 0
            due = [t for uuid, t in self.gpus.replace_at.items() if uuid not in self._await_reap]
            if self.spares is not None and due:  # a spare waits: do not wait for the next poll
                next_daemon = min(next_daemon, *due)
            if time.monotonic() >= next_daemon or (not self._live() and not self.finished):
                next_daemon = time.monotonic() + self.plan.daemon_poll_s
                self._grow()
                if not self._live() and not self.finished and not self._replacement_due() and self._job_has_no_member():
                    raise InPlaceStopped(EXIT_STOPPED, "no rank of the job is left and no usable GPU to restart on")

    def _refuse_a_job_that_never_joins(self) -> None:
        """Stop (exit 2) a job that is not an in-place job: it must not train as one-rank jobs, nor be replaced."""
        watch = self._join_watch
        why = None if self.finished or watch is None else watch.refusal(len(self._live()))
        if why is not None:
            self._terminate_workers()
            raise InPlaceStopped(2, why)

    def _exited(self, worker: _Worker, code: int, began: bool = False) -> None:
        """Publish the exit at once (the survivors wait for it), then decide about the GPU.

        `began`: the worker's exit only began (killed, its runner said no word); its reap follows later.
        """
        if worker.code is not None:  # the reap of a worker taken for dead when its exit began
            self._dying.pop(worker.uuid, None)
            self._await_reap.discard(worker.uuid)
            if worker.runner is not None:
                worker.runner.close()
            return
        if began:
            self._dying[worker.uuid] = worker.process.pid
        elif worker.runner is not None:
            worker.runner.close()
        worker.code = code
        try:
            append_event(self.store, GONE, member=worker.member, code=code, node=self.node)
        except Exception as exc:  # the launcher hosting the store is gone: nobody can decide the membership
            self._terminate_workers()
            raise InPlaceStopped(EXIT_STOPPED, f"the job's store at {self.address} is gone ({exc})") from None
        where = f"GPU {worker.index} ({worker.uuid})"
        if code == 0:
            self.finished = True
        elif code == EXIT_RESUME:
            self.gpus.left[worker.uuid] = self.gpus.epoch_at_start.get(worker.uuid, 0)
            self.echo(f"gpuwatch launch: in place: {worker.member} on {where} left (exit 75): the others go on")
        else:
            after = _SPARE_AFTER_S if self.spares is not None and self.spares.count else _REPLACE_AFTER_S
            self.gpus.replace_at[worker.uuid] = time.monotonic() + after
            how = _how(code) if not began else "killed" if code == _NO_WORD else f"ending with {code}"
            if worker.runner is not None:  # its exit was watched as it began: the incident's onset (exit_dates)
                self._exit_dates.exit_began(worker.process.pid, worker.exit_t or time.time())
            self.echo(f"gpuwatch launch: in place: {worker.member} on {where} {how}: the others go on")

    def _grow(self) -> None:
        """Start a worker on each usable GPU without one that may have one: a replacement, a released GPU."""
        if self.finished:
            return
        try:
            gpus = [g for g in self.gpu_list() if g.usable]
        except GpuwatchError as exc:
            if not self._daemon_down:
                self.echo(f"gpuwatch launch: in place: {exc}: no GPU joins until the daemon answers")
            self._daemon_down = True
            return
        self._daemon_down = False
        busy = {w.uuid for w in self._live()}
        room = len(gpus) if self.plan.nproc is None else self.plan.nproc - len(busy)
        if self.spares is not None:
            self._move_replacements(gpus, busy)
        # A lost rank's replacement comes first (a spare, its standby, waits for it there): a free GPU gets a
        # new worker only with room left beside the replacements still due.
        due = {g.uuid for g in gpus if g.uuid in self.gpus.replace_at and self.restarts < self.plan.max_restarts}
        for gpu in gpus:
            uuid = gpu.uuid
            if uuid in busy or room <= 0:
                continue
            if uuid in self.gpus.left:
                if gpu.epoch <= self.gpus.left[uuid]:
                    continue  # not quarantined and released since its worker left (a stop signal alone)
                del self.gpus.left[uuid]
                why = "released"
            elif uuid in self.gpus.replace_at:
                if time.monotonic() < self.gpus.replace_at[uuid] or self.restarts >= self.plan.max_restarts:
                    continue
                if uuid in self._await_reap or not self._room(uuid, gpu.index):
                    continue
                del self.gpus.replace_at[uuid]
                due.discard(uuid)
                self.restarts += 1
                why = f"replacement {self.restarts}/{self.plan.max_restarts}"
                self.echo(f"gpuwatch launch: in place: GPU {gpu.index} ({uuid}) {why}: a rank joins")
                rank, world = self.gpus.rank_of.get(uuid, (0, 1))
                self._start(gpu, rank=rank, world=world, replacement=True)
                room -= 1
                continue
            elif uuid in self.gpus.used:
                continue  # its worker finished
            elif room <= len(due):
                continue
            else:
                why = "usable"
            self.echo(f"gpuwatch launch: in place: GPU {gpu.index} ({uuid}) {why}: a rank joins")
            self._start(gpu)
            room -= 1

    def _room(self, uuid: str, index: int) -> bool:
        """Whether a replacement may start on the GPU now: its dying worker's memory leaves room for it."""
        pid = self._dying.get(uuid)
        if pid is None or self.spares is None or self.spares.room_for(uuid, pid):
            return True
        self._await_reap.add(uuid)
        self.echo(
            f"gpuwatch launch: in place: GPU {index}: no room beside the dead rank's memory: waiting until it is freed"
        )
        return False

    def _move_replacements(self, usable: list[GpuView], busy: set[str]) -> None:
        """A replacement due on a GPU the daemon no longer calls usable goes to a usable GPU that no worker had."""
        ok = {g.uuid for g in usable}
        free = [g.uuid for g in usable if g.uuid not in busy and g.uuid not in self.gpus.used]
        for uuid in [u for u in self.gpus.replace_at if u not in ok]:
            if not free:
                return
            target = free.pop(0)
            self.gpus.replace_at[target] = self.gpus.replace_at.pop(uuid)
            self.gpus.rank_of[target] = self.gpus.rank_of.get(uuid, (0, 1))
            self.gpus.used.add(target)
            self.echo(f"gpuwatch launch: in place: {uuid} is not usable: its rank moves to {target}")

    def _replacement_due(self) -> bool:
        return bool(self.gpus.replace_at) and self.restarts < self.plan.max_restarts

    def _job_has_no_member(self) -> bool:
        try:
            latest = latest_generation(self.store)
            return latest > 0 and not read_generation(self.store, latest).members
        except Exception:
            return True

    # -- stopping -------------------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._received = signum

    def stop(self) -> None:
        """End the job from another thread: the workers get SIGTERM, and run() returns 0 once they are gone."""
        self._stop_called = True
        self._received = signal.SIGTERM

    def _shut_down(self) -> int:
        signum = self._received
        assert signum is not None
        self._terminate_workers()
        if self._stop_called:
            return 0
        raise InPlaceStopped(128 + signum, f"stopped by {signal.Signals(signum).name}")

    def _terminate_workers(self) -> None:
        """SIGTERM to every live worker's session, SIGKILL after _STOP_GRACE_S."""
        for worker in self._live():
            try:
                os.killpg(worker.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + _STOP_GRACE_S
        for worker in self._live():
            try:
                worker.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()


def _worker_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment every worker (and spare) starts from: the launcher's, with the workers' defaults."""
    env = dict(environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    # NCCL: abort the communicator on an error but do not end the process (3, torch's default, ends it;
    # torchrun's 1 aborts and ends it): the survivor must live through its peer's death.
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    return env


def _min_nodes(nnodes: str | None) -> int:
    if not nnodes:
        return 1
    first = nnodes.split(":", 1)[0]
    return int(first) if first.isdigit() and int(first) > 0 else 1


def exit_began(pid: int) -> bool | None:
    """Whether the process's exit has begun: PF_EXITING in its flags, or its main thread is a zombie (a
    sandbox such as gVisor shows no flags); None when it is gone (reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return fields[0] in (b"Z", b"X") or (len(fields) > 6 and fields[6].isdigit() and int(fields[6]) & _PF_EXITING != 0)


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited {code}"
