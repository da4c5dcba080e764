"""The composition root: Config → backend → Monitor → metrics and API → one uvicorn server.

Sampling runs on its own thread, the event thread waits in the backend, the drills' cron jobs
run in APScheduler, uvicorn serves on the main thread.
READY=1 goes to systemd after the first complete sample; WATCHDOG=1 after every one, so a
hung NVML call stops the pings and systemd restarts the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import uvicorn
from apscheduler.schedulers.background import BackgroundScheduler
from prometheus_client.registry import Collector

from gpuwatch import __version__, validation
from gpuwatch.backends import open_backend
from gpuwatch.backends.base import Backend, KernelLogAware, Scripted
from gpuwatch.backends.kmsg import KernelLog
from gpuwatch.base import systemd
from gpuwatch.cluster.fleet import FleetBreaker, FleetCollector
from gpuwatch.cluster.slurm import Drainer, SlurmCollector
from gpuwatch.config import Config, RulesConfig
from gpuwatch.control.access import Access
from gpuwatch.control.hosts import HostPolicy
from gpuwatch.drills.service import DrillService
from gpuwatch.errors import ConfigError, StoreError
from gpuwatch.health.state import Decision
from gpuwatch.model import GpuEvent, Snapshot
from gpuwatch.node.monitor import Monitor
from gpuwatch.node.runtime import RuntimeDir
from gpuwatch.node.statelock import StateDirLock
from gpuwatch.node.store import JOURNAL_NAME, Store
from gpuwatch.remediation import Remediation
from gpuwatch.serving import liveness
from gpuwatch.serving.api_token import ensure_token
from gpuwatch.serving.httpserver import (
    ACCEPT_BURST,
    AcceptErrorLog,
    ASGIApp,
    ServerLimits,
    front,
    lazy_app,
    limited_protocol,
    raise_fd_limit,
)
from gpuwatch.serving.listeners import open_listeners
from gpuwatch.serving.metrics import MetricsRenderer, SnapshotCollector
from gpuwatch.serving.remediation_metrics import RemediationCollector
from gpuwatch.serving.runtime_metrics import RuntimeCollector
from gpuwatch.snapshots.layout import snapshot_root
from gpuwatch.snapshots.prune import SquatWatch
from gpuwatch.snapshots.prune import prune as prune_snapshots

log = logging.getLogger("gpuwatch.daemon")


LIVE_BACKENDS = frozenset({"nvml", "dcgm"})
SNAPSHOT_PRUNE_EVERY_S = 60.0  # how often dead jobs' host snapshots are looked for (they go after their grace)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # APScheduler logs every job run at INFO: one line per sample is noise in the journal.
    logging.getLogger("apscheduler").setLevel(max(logging.WARNING, logging.getLogger().level))


def scenario_rules(backend: Backend, rules: RulesConfig) -> RulesConfig:
    """The sim demo may shorten rule windows so a newcomer sees faults within two minutes; say so."""
    if not isinstance(backend, Scripted) or not backend.scenario.rules_overrides:
        return rules
    scenario = backend.scenario
    overrides = dict(scenario.rules_overrides)
    log.warning(
        "sim scenario %r shortens rule windows for the demo: %s",
        scenario.name,
        ", ".join(f"{k}={v}" for k, v in sorted(overrides.items())),
    )
    return dataclasses.replace(rules, **overrides)


class _Server(uvicorn.Server):
    """uvicorn's server, minus re-raising SIGTERM after its graceful shutdown.

    uvicorn re-raises the captured signal once it has stopped serving, which kills the process
    before the daemon has stopped its scheduler, closed NVML and told systemd STOPPING=1. The
    daemon stops everything itself and exits 0 on SIGTERM, as systemd expects of a clean stop.
    """

    async def main_loop(self) -> None:
        """Wake once a second, not ten times: an idle uvicorn otherwise costs 0.25 % of a core.

        on_tick refreshes the Date header when its counter is a multiple of 10, so count in tenths.
        A stop request is then seen within a second.
        """
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864000
            await asyncio.sleep(1.0)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(AcceptErrorLog())
        await super().startup(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class Daemon:
    """Owns every long-lived part and their start and stop order."""

    def __init__(self, config: Config, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.started = False
        self.state_lock = StateDirLock.acquire(config.state_dir)  # a second daemon stops here, exit 2
        self.backend, statics = open_backend(config)
        self.rules = scenario_rules(self.backend, config.rules)
        first_start = not config.db_path.exists()
        self.runtime = RuntimeDir(config.runtime_dir)
        try:
            self.runtime.prepare()
        except OSError as exc:
            raise ConfigError(f"runtime_dir {config.runtime_dir}: cannot prepare it: {exc.strerror or exc}") from None
        # The journal of quarantine changes the database could not take also goes to the runtime dir: another
        # file system than a full state disk, and kept across restarts (RuntimeDirectoryPreserve=yes).
        self.store = Store(config.db_path, journal_copies=[self.runtime.path / JOURNAL_NAME])
        self.token = ensure_token(config.token_path, first_start=first_start)
        self.access = Access.for_daemon(config.api.admin_group)  # who may change state over the control socket
        # The Host names the TCP listener answers: this host's and the listen address's besides loopback and IPs.
        self.hosts = HostPolicy((socket.gethostname(), config.listen_host, *config.api.allowed_hosts))
        self.monitor = Monitor(
            self.backend, statics, config, store=self.store, runtime=self.runtime, rules=self.rules, clock=clock
        )
        self.scheduler = BackgroundScheduler(timezone="UTC")
        self.stop_event = threading.Event()
        self.remediation = Remediation(config, self.store, self.runtime, clock=clock)
        self.monitor.listeners.append(self.remediation.on_publish)
        # The drills' cron jobs and on-demand runs go into APScheduler; sampling has its own thread.
        self.drills = DrillService(
            config, self.monitor, self.store, scheduler=self.scheduler, clock=clock, stop=self.stop_event
        )
        self._last_prune = 0.0
        self._last_snapshot_prune = 0.0
        self.snapshot_squats = SquatWatch()
        self._sample_thread = threading.Thread(target=self._sample_every_interval, name="gpuwatch-sample", daemon=True)
        self._event_thread = threading.Thread(
            target=self.monitor.run_events, args=(self.stop_event,), name="gpuwatch-events", daemon=True
        )
        # The kernel log is a second XID source on real GPUs (sim and replay have no driver lines, unless
        # sim.kernel_log points the sim at a stand-in for /dev/kmsg).
        follow = self.backend.name in LIVE_BACKENDS or (self.backend.name == "sim" and config.sim.kernel_log)
        self.kernel_log = KernelLog(config.tools.kmsg, statics) if follow else None
        self._kernel_thread: threading.Thread | None = None
        if self.backend.name in LIVE_BACKENDS:  # the GPU test needs a real GPU
            self.monitor.validator = functools.partial(validation.validate, config=config)
        self.drills.add_jobs()
        self.fleet = FleetBreaker(config.fleet) if config.fleet.prometheus_url else None
        if self.fleet is not None:
            self.monitor.quarantine_gate = self.fleet.allow_quarantine
        self.drainer: Drainer | None = None
        if config.slurm.enabled:
            self.drainer = Drainer(config.slurm, gate=self.fleet.allow_drain if self.fleet is not None else None)
            self.monitor.listeners.append(self.drainer.on_publish)
        self.renderer = self._metrics_renderer()
        # Last listener: render /metrics in the sampling thread as soon as a Snapshot is out (while
        # scrapes read every Snapshot), so a scrape finds the bytes ready instead of rendering them
        # while the other scrapes queue behind it.
        self.monitor.listeners.append(self._prerender)
        log.info(
            "gpuwatch %s: backend %s, %d GPU(s), interval %.0f s, state %s, runtime %s",
            __version__,
            self.backend.name,
            len(statics),
            config.interval_s,
            config.state_dir,
            config.runtime_dir,
        )

    def _prerender(self, snapshot: Snapshot, decisions: list[Decision]) -> None:
        self.renderer.prerender()

    def _metrics_renderer(self) -> MetricsRenderer:
        """One Collector per concern, and a render-cache key that changes whenever any of them would."""
        collectors: list[Collector] = [
            SnapshotCollector(lambda: self.monitor.snapshot, self.config.expected_gpus),
            RemediationCollector(self.remediation),
            RuntimeCollector(self.runtime, self.snapshot_squats),
            self.drills.record,
        ]
        # The Snapshot itself, not its id(): a freed Snapshot's id can be reused by the next one.
        key_parts: list[Callable[[], object]] = [
            lambda: self.monitor.snapshot,
            self.remediation.version,
            self.runtime.version,
            lambda: (self.snapshot_squats.standing, self.snapshot_squats.removed),
            self.drills.record.key,
        ]
        if self.fleet is not None:
            collectors.append(FleetCollector(self.fleet.status))
            key_parts.append(self.fleet.status)
        if self.drainer is not None:
            collectors.append(SlurmCollector(self.drainer.status))
            key_parts.append(self.drainer.status)
        return MetricsRenderer(*collectors, key=lambda: tuple(part() for part in key_parts))

    def sample_once(self) -> None:
        """One scheduled sampling round, then the watchdog ping."""
        self.monitor.tick()
        self.prune_if_due()
        systemd.watchdog()

    def prune_if_due(self) -> None:
        """Old findings, decisions and incidents every hour; dead jobs' host snapshots every minute."""
        now = self.clock()
        if now - self._last_prune > 3600:
            self._last_prune = now
            try:
                self.store.prune(now - self.config.findings_retention_days * 86400)
            except StoreError as exc:  # a full disk must not skip the watchdog ping after it
                log.warning("cannot prune old findings: %s", exc)
        if now - self._last_snapshot_prune > SNAPSHOT_PRUNE_EVERY_S:
            self._last_snapshot_prune = now
            ranks, _ = self.remediation.ranks()
            live = {(r.uid, r.job) for r in ranks if r.uid is not None and r.job}
            for path in prune_snapshots(Path(snapshot_root()), live, time.time()):
                log.info("removed %s: host snapshot of a job with no live rank", path)
            self.snapshot_squats.look(Path(snapshot_root()))

    def app(self) -> ASGIApp:
        """The Host check, the body limit, /metrics and /healthz at once; the API behind them from its first
        request (lazy_app)."""
        api = self.config.api
        return front(lazy_app(self.api), self.renderer.render, self.healthz, api.max_body_bytes, self.hosts)

    def healthz(self) -> tuple[int, bytes]:
        return liveness.healthz_json(self.monitor.snapshot, self.clock(), self.config.interval_s)

    def api(self) -> ASGIApp:
        """The FastAPI app with every part's routes. Its imports (about 16 MiB) happen here, not at start."""
        from gpuwatch.serving import remediation_api
        from gpuwatch.serving.api import create_api

        return create_api(
            self.monitor,
            self.token,
            clock=self.clock,
            route_sets=(remediation_api.route_set(self.remediation, self.store), self.drills.routes),
            gpu_views=(functools.partial(remediation_api.gpu_view, self.remediation),),
            docs=self.config.api.docs,
            access=self.access,
        )

    def start(self) -> None:
        """First sample (so READY=1 means real data), then the sampling and event threads, READY=1.

        The fleet breaker asks Prometheus first (at most fleet.timeout_s), so that the first automatic
        quarantines (XIDs the kernel log replays after a fleet-wide driver roll-out) are judged on an answer.
        """
        self.started = True  # from here on the state dir holds a real run's state: a failure keeps it
        if self.fleet is not None:
            self.fleet.start()
        self.monitor.tick()
        self._sample_thread.start()
        self.scheduler.start()
        self._start_kernel_log()
        self._event_thread.start()
        if self.drainer is not None:
            self.drainer.start()
        systemd.ready()
        systemd.status(f"watching {len(self.monitor.statics)} GPU(s) with {self.backend.name}")

    def _sample_every_interval(self) -> None:
        """sample_once every interval_s on a steady phase; a round that overran skips the rounds it missed.

        A thread of its own rather than a scheduler job: waking a scheduler thread to hand each round
        to a pool thread cost more CPU at a 1 s interval than the round's own Python.
        """
        interval = self.config.interval_s
        due = time.monotonic() + interval
        while not self.stop_event.wait(max(0.0, due - time.monotonic())):
            try:
                self.sample_once()
            except Exception:  # a bug in one round must not end sampling
                log.exception("sampling round failed")
            due += interval
            late = time.monotonic() - due
            if late > 0:
                due += math.ceil(late / interval) * interval

    def _start_kernel_log(self) -> None:
        """Replay what the kernel buffer still holds (judged by kernel time), then follow it in a thread.

        The backend hears which GPUs the log covers, so its own event set can stand down on them.
        """
        kernel_log = self.kernel_log
        if kernel_log is None or not self.config.tools.kmsg:
            return
        kernel_log.open()
        self.monitor.kernel_log_readable = kernel_log.readable
        if not kernel_log.readable:
            return
        if isinstance(self.backend, KernelLogAware):  # before the event thread's first wait
            self.backend.kernel_log_covers(kernel_log.gpus)
        old = kernel_log.read_available()
        self.monitor.kernel_sxids_total = kernel_log.sxids_total
        if old:
            log.info("kernel log: %d XID(s) since boot: %s", len(old), "; ".join(e.detail for e in old[-5:]))
            self.monitor.handle_events(old)

        def handle(events: list[GpuEvent]) -> None:
            self.monitor.kernel_sxids_total = kernel_log.sxids_total
            self.monitor.handle_events(events)

        self._kernel_thread = threading.Thread(
            target=kernel_log.follow, args=(self.stop_event, handle), name="gpuwatch-kmsg", daemon=True
        )
        self._kernel_thread.start()

    def stop(self) -> None:
        systemd.stopping()
        self.stop_event.set()
        if self._sample_thread.is_alive():
            self._sample_thread.join()  # a round in flight ends before the backend closes under it
        if self.scheduler.running:
            self.scheduler.shutdown(wait=True)
        self.backend.close()
        self.remediation.close()
        self.runtime.close()
        if self._event_thread.is_alive():
            self._event_thread.join(timeout=5)
        if self._kernel_thread is not None:
            self._kernel_thread.join(timeout=5)
        if self.kernel_log is not None:
            self.kernel_log.close()
        if self.drainer is not None:
            self.drainer.stop()
        if self.fleet is not None:
            self.fleet.stop()
        unsaved = self.monitor.flush_store()
        if unsaved:
            log.error(
                "%d quarantine change(s) could not be written to %s: kept in its %s, applied at the next start",
                unsaved,
                self.store.path,
                JOURNAL_NAME,
            )
        self.store.close()
        self.state_lock.release()
        log.info("gpuwatch stopped")

    def serve(self) -> None:
        """Run until SIGTERM/SIGINT (uvicorn handles both), then stop everything."""
        listeners = open_listeners(self.config)
        api = self.config.api
        limits = ServerLimits(raise_fd_limit(api.max_connections), api.header_timeout_s, api.max_header_bytes)
        server = _Server(
            uvicorn.Config(
                self.app(),
                http=limited_protocol(limits),
                backlog=ACCEPT_BURST,
                loop="asyncio",
                log_level="warning",
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=5,
            )
        )
        self.start()
        log.info(
            "serving on http://%s/ (metrics at /metrics) and on the control socket %s",
            self.config.listen,
            listeners.control_path,
        )
        try:
            server.run(sockets=listeners.sockets)
        finally:
            listeners.close()
            self.stop()
