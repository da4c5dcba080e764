"""SparePool: the launcher's warm spares, and the hand-over of a rank to one of them.

A spare (gpuwatch.spares.worker) is a process that imported torch and waits on a pipe. When a rank
must be replaced, `hand_over` writes it the rank's command and environment and returns the spare,
whose process from then on is the rank (the launcher waits on it like on any worker); a new spare is
started behind it at once. A spare that holds a CUDA context (cuda=True) was started for one GPU and
is only handed a rank of that GPU; one without a context takes a rank of any GPU. `run_now` starts a
job's first ranks under the same runner, without the wait.

With standby on (`standby_for`), each spare is started for one GPU and runs the job's own command at
once, up to the job's join (gpuwatch.trainer.standby): it says `1` on its ready pipe when warm and `j`
when it waits at the join, its set-up done (`a`: done without a CUDA context, so it may take a rank of
any GPU; the hand-over's CUDA_VISIBLE_DEVICES is read when the script first uses CUDA), and `s` once the
rank it became finished its first step: only then does the next standby start behind it (`tick`), so that
its set-up does not compete with the rank's restore, and only once the rank it replaced is gone from
that GPU (`freeing`): a room check made while that process still frees its memory finds none, and the
spare would wait without the job's set-up. A hand-over
takes the best that is ready: a standby at the join, then a warm spare, then one still starting. A
standby that ends before its join (the script failed, no room for a second copy of the model) turns
standby off for this pool, in one line.

A second pipe carries the rank's last word: the runner writes the job's exit code there (`exit N`) when
the job ends by itself, before the process begins to exit. So once a rank's exit has begun, `last_word`
tells a rank that ended (0, 75, an error) from one that was killed (no word): the launcher replaces a
killed rank then, not seconds later when the kernel and the driver have freed its memory (a process is
reaped only after that).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuwatch.trainer.contract import SPARE_STAGE_ENV
from gpuwatch.trainer.standby import AT_JOIN, AT_JOIN_ANY_GPU, HELD_ENV, READY_FD_ENV, STEPPED

STANDBY_ARGV_ENV = "GPUWATCH_SPARE_ARGV"  # a standby's command (JSON): run at once, up to the job's join
WORD_FD_ENV = "GPUWATCH_SPARE_WORD_FD"  # the runner writes the job's exit code there as the job ends by itself
NOW_ENV = "GPUWATCH_SPARE_NOW"  # "1": run the order at once, without the warm-up (a job's first ranks)
WORD = b"exit "  # the last word's prefix: b"exit N\n", N the job's exit code
CUDA_ENV = "GPUWATCH_SPARE_CUDA"  # "1": the spare creates its CUDA context on its one visible GPU
_CLOSE_GRACE_S = 2.0
_BEHIND_MAX_S = 60.0  # the next spare starts when the rank handed over stepped, ended, or took this long


@dataclass
class Spare:
    """One standby process; `gpu` is the GPU its CUDA context is on (None: no context, any GPU)."""

    process: subprocess.Popen[bytes]
    ready_fd: int  # the read end of its ready pipe
    word_fd: int  # the read end of its last-word pipe
    gpu: str | None
    started: float
    warm: bool = False
    standby: bool = False  # it runs the job's command up to the join
    at_join: bool = False  # a standby that waits at the job's join, its set-up done
    any_gpu: bool = False  # ... and made no CUDA context there: it takes a rank of any GPU
    stepped: bool = False  # handed over: the rank it became finished a step, or its pipe closed (it ended)
    heard: bytes = b""
    lock: threading.Lock = field(default_factory=threading.Lock)  # last_word on a watcher thread, close on another

    def is_warm(self) -> bool:
        """Whether it finished its warm-up (imported torch, created its context); never blocks."""
        self._read_ready()
        return self.warm

    def stage(self) -> str:
        """How far it is: `standby` (at the job's join), `warm` (torch imported), `starting`; never blocks."""
        self._read_ready()
        return "standby" if self.at_join else "warm" if self.warm else "starting"

    def _read_ready(self) -> None:
        with self.lock:  # handed over, the launcher's watcher may close it meanwhile
            self._read_ready_locked()

    def _read_ready_locked(self) -> None:
        while self.ready_fd >= 0 and select.select([self.ready_fd], [], [], 0)[0]:
            said = os.read(self.ready_fd, 16)
            self.warm = self.warm or bool(said)
            self.any_gpu = self.any_gpu or AT_JOIN_ANY_GPU in said
            self.at_join = self.at_join or self.any_gpu or AT_JOIN in said
            self.stepped = self.stepped or STEPPED in said or not said
            if self.stepped:
                self._close_ready()

    def has_stepped(self) -> bool:
        """A spare handed a rank: whether that rank finished a step or ended (its pipe closed); never blocks."""
        self._read_ready()
        return self.stepped or self.ready_fd < 0

    def last_word(self) -> int | None:
        """The job's exit code as its runner said it before the process began to exit; None: no word (yet).

        Read after the exit began, None means the job did not end by itself: a signal or a crash ended it.
        """
        with self.lock:  # never a read of the fd's number after close gave it to another file
            while self.word_fd >= 0 and select.select([self.word_fd], [], [], 0)[0]:
                data = os.read(self.word_fd, 256)
                if not data:
                    break
                self.heard = (self.heard + data)[-256:]
        _, found, rest = self.heard.rpartition(WORD)
        number = rest.partition(b"\n")[0]
        return int(number) if found and rest.endswith(b"\n") and number.lstrip(b"-").isdigit() else None

    def close(self) -> None:
        """Close the launcher's ends of its pipes (the rank was reaped, or the spare ended)."""
        with self.lock:
            self._close_ready()
            if self.word_fd >= 0:
                os.close(self.word_fd)
                self.word_fd = -1

    def _close_ready(self) -> None:
        if self.ready_fd >= 0:
            os.close(self.ready_fd)
            self.ready_fd = -1

    def rss_bytes(self) -> int | None:
        """Its resident memory (what a spare costs the host), from /proc; None when it cannot be read."""
        try:
            with open(f"/proc/{self.process.pid}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
        return None


class SparePool:
    """N warm spares on this node (see the module docstring).

    Args:
        count: how many spares to keep (0: none; hand_over then always returns None).
        env: the environment spares start with (the launcher's, as its workers get it, without a rank's own keys).
        cuda: whether each spare creates its CUDA context (on the GPU it is started for) while it waits.
        standby: whether the launcher may make its spares standbys of the job (standby_for).
        python: the interpreter (the job's).
        echo: one line per event worth saying (a spare that died while waiting).
    """

    def __init__(
        self,
        count: int,
        env: Mapping[str, str],
        *,
        cuda: bool = False,
        standby: bool = False,
        python: str = sys.executable,
        echo: Callable[[str], None] = print,
    ) -> None:
        if count < 0:
            raise ValueError(f"the number of spares must not be negative, not {count}")
        self.count, self.cuda, self.python, self.echo = count, cuda, python, echo
        self.standby = standby
        self.env = dict(env)
        self.spares: list[Spare] = []
        self.handed_over = 0
        self._behind: list[tuple[Spare, str, float]] = []  # (handed over, its GPU, when): the next spare is owed
        self._standby: tuple[list[str], Callable[[str], dict[str, str] | None], list[str]] | None = None
        self._freeing: Callable[[str], bool] = lambda _gpu: False

    def standby_for(
        self,
        command: Sequence[str],
        env_of: Callable[[str], dict[str, str] | None],
        held: Sequence[str],
        freeing: Callable[[str], bool] | None = None,
    ) -> None:
        """Make every spare from now on a standby of the job's `command`: `env_of(gpu)` is the environment a
        rank of that GPU gets without the `held` keys (None: no standby there), which only the hand-over gives.
        `freeing(gpu)`: whether a rank that left that GPU still frees its memory there (the next standby waits)."""
        self._standby = (list(command), env_of, list(held))
        if freeing is not None:
            self._freeing = freeing

    def start(self, gpus: Sequence[str]) -> None:
        """Start the spares; with cuda or standby, spread over `gpus` (uuids) in turn. NVML is set up here, not
        at the first fault (room_for)."""
        from gpuwatch.spares.room import prepare

        prepare()
        bound = self.cuda or self._standby is not None
        for i in range(self.count):
            self._add(self._spawn(gpus[i % len(gpus)] if bound and gpus else None))

    def hand_over(self, argv: Sequence[str], env: Mapping[str, str], gpu: str) -> Spare | None:
        """Give the rank (`python ARGV` with `env`, on GPU `gpu`) to a spare; the spare, or None when none fits.

        The best that is ready is taken: a standby at the job's join, then a warm spare, then one still
        warming up (which is still further along than a cold start); a spare bound to another GPU is
        left alone. A new spare starts behind it.
        The caller owns the spare from then on (its `last_word`, and `close` once it is reaped).
        """
        self.tick()
        self._drop_dead()
        fits = [s for s in self.spares if s.gpu in (None, gpu) or (s.stage() == "standby" and s.any_gpu)]
        if not fits:
            return None
        ready = {"standby": 2, "warm": 1, "starting": 0}
        spare = max(fits, key=lambda s: (ready[s.stage()], s.gpu == gpu, -s.started))
        self.spares.remove(spare)
        stage = spare.stage()
        if not _order(spare, argv, {**env, SPARE_STAGE_ENV: stage}):  # it died just now
            self.echo(
                f"gpuwatch launch: the spare chosen (pid {spare.process.pid}, {stage}) could not take the rank:"
                f" {_how_it_ended(spare.process)}; the next one is started for it"
            )
            spare.close()
            self._add(self._spawn(spare.gpu))
            return self.hand_over(argv, env, gpu)
        self.handed_over += 1
        self._behind.append((spare, gpu, time.monotonic()))  # a standby behind it, once it stepped (tick)
        return spare

    def describe(self) -> str:
        """The spares waiting now, `pid N (stage, GPU)` each: a launch log says what a hand-over chose among."""
        return ", ".join(f"pid {s.process.pid} ({s.stage()}, {s.gpu or 'any GPU'})" for s in self.spares) or "none"

    def tick(self) -> None:
        """Start the spare owed behind each rank handed over that has stepped since (or ended) on a GPU no
        leaving rank still frees memory on, or that took _BEHIND_MAX_S: not before, so that its set-up does
        not compete with that rank's restore for CPU and memory, and its room is judged on the memory left."""
        for owed in list(self._behind):
            spare, gpu, since = owed
            ready = spare.has_stepped() and not self._freeing(gpu)
            if ready or time.monotonic() - since > _BEHIND_MAX_S:
                self._behind.remove(owed)
                self._add(self._spawn(gpu))

    def run_now(self, argv: Sequence[str], env: Mapping[str, str]) -> Spare | None:
        """Start the rank under the spare's runner at once (no warm-up, no pool): a job's first ranks, whose
        last word then says how they ended like a handed-over rank's. None when it cannot be started."""
        spare = self._spawn(None, env={**env, NOW_ENV: "1"})
        if spare is not None and not _order(spare, argv, env):
            spare.close()
            return None
        return spare

    def room_for(self, gpu: str, pid: int) -> bool:
        """Whether GPU `gpu` has room for a replacement while process `pid` (the rank it replaces) still holds
        its memory there (gpuwatch.spares.room); a standby bound to that GPU brings what it already holds."""
        from gpuwatch.spares.room import room_beside

        standbys = [s for s in self.spares if s.gpu == gpu and s.process.poll() is None and s.stage() == "standby"]
        return room_beside(gpu, pid, taker=standbys[0].process.pid if standbys else None)

    def warm(self) -> int:
        """How many spares are warm now."""
        return sum(1 for s in self.spares if s.process.poll() is None and s.is_warm())

    def close(self) -> None:
        """End the waiting spares: an empty stdin ends each with 0; one still warming up is killed after a grace."""
        for spare in self.spares:
            with contextlib.suppress(OSError, ValueError):
                if spare.process.stdin is not None:
                    spare.process.stdin.close()
        deadline = time.monotonic() + _CLOSE_GRACE_S
        for spare in self.spares:
            try:
                spare.process.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                spare.process.kill()
                spare.process.wait()
            spare.close()
        self.spares, self._behind = [], []

    def _add(self, spare: Spare | None) -> None:
        if spare is not None:
            self.spares.append(spare)

    def _spawn(self, gpu: str | None, env: Mapping[str, str] | None = None) -> Spare | None:
        standby = self._standby_env(gpu) if env is None else None
        env = dict(standby or (self.env if env is None else env))
        if standby is None and not self.cuda:
            gpu = None  # a plain spare without a context takes a rank of any GPU
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
            if self.cuda:
                env[CUDA_ENV] = "1"
        (read_fd, write_fd), (word_fd, say_fd) = os.pipe(), os.pipe()
        env[READY_FD_ENV], env[WORD_FD_ENV] = str(write_fd), str(say_fd)
        try:
            process = subprocess.Popen(
                [self.python, "-m", "gpuwatch.spares.worker"],
                env=env,
                stdin=subprocess.PIPE,
                pass_fds=(write_fd, say_fd),
                start_new_session=True,  # as a worker: the launcher signals its session
            )
        except OSError as exc:
            os.close(read_fd)
            os.close(word_fd)
            self.echo(f"gpuwatch launch: cannot start a spare: {exc.strerror or exc}")
            return None
        finally:
            os.close(write_fd)
            os.close(say_fd)
        return Spare(process, read_fd, word_fd, gpu, time.monotonic(), standby=standby is not None)

    def _standby_env(self, gpu: str | None) -> dict[str, str] | None:
        """A standby's environment on `gpu`: the rank's without the held keys, and the job's command."""
        if self._standby is None or gpu is None:
            return None
        command, env_of, held = self._standby
        env = env_of(gpu)
        if env is None:
            return None
        env = {k: v for k, v in env.items() if k not in held}
        env[STANDBY_ARGV_ENV], env[HELD_ENV] = json.dumps(command), ",".join(held)
        return env

    def _drop_dead(self) -> None:
        for spare in [s for s in self.spares if s.process.poll() is not None]:
            code = spare.process.returncode
            if spare.standby and self._standby is not None:
                self._standby = None
                self.echo(
                    f"gpuwatch launch: a standby (pid {spare.process.pid}) ended before the job's join (exit {code}):"
                    " spares from now on wait without the job's set-up"
                )
            else:
                self.echo(f"gpuwatch launch: a spare (pid {spare.process.pid}) ended while waiting (exit {code})")
            spare.close()
            self.spares.remove(spare)
            self._add(self._spawn(spare.gpu))


def _how_it_ended(process: subprocess.Popen[bytes]) -> str:
    """`ended with 1`, `killed by SIGKILL`, or `its input was closed` (still running a moment later: it is of no
    use without its order, so it is killed and reaped)."""
    try:
        code = process.wait(timeout=0.2)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return "its input was closed"
    if code >= 0:
        return f"ended with {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _order(spare: Spare, argv: Sequence[str], env: Mapping[str, str]) -> bool:
    """Write the hand-over (the rank's command and environment) and close its stdin; False when it is gone."""
    order = json.dumps({"argv": list(argv), "env": dict(env)}).encode() + b"\n"
    try:
        assert spare.process.stdin is not None
        spare.process.stdin.write(order)
        spare.process.stdin.close()
    except (OSError, ValueError):
        return False
    return True
