"""Simulated ranks of one in-place job against its real store: small clients that speak the store's wire.

The store and its coordinator run as the hosting launcher runs them (gpuwatch.bench.scale_host, a
process of its own, so its CPU is its own); the ranks are coroutines of this process, eight to a
simulated node, each on one connection, doing what a rank does with the job's membership:

* `push` (gpuwatch.inplace.membership): a long poll on `gen` that the store answers at a change with
  the generation's delta; the members' meeting is one counter (`ready/<g>`) waited on in one request;
* `relay` (gpuwatch.inplace.relay): the same, but one long poll per node, its launcher's, handing
  each generation to the node's ranks;
* `poll` (what job.py's watcher did before): a `check` and a `get` of `gen` every 20 ms, the whole
  record read at each change, and a `ready/<g>/<member>` key per member checked every 5 ms.

The run: form the job, leave it idle (the store's CPU and requests, a request's round trip), kill a
rank (its launcher says `gone`: until every survivor has seen the new generation, and until all met
in it), and add one (`join`: the same). Figures the run could not reach in its time are None.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import resource
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuwatch.inplace.jobstore import ADD, CHECK, GE, GET, NE, READ, SET, WATCH, encoded
from gpuwatch.inplace.protocol import DELTA, DONE, GEN, Generation, from_delta, job_prefix

PER_NODE = 8
POLL_S, MEET_POLL_S = 0.02, 0.005  # the old watcher's and rendezvous' periods
LONG_POLL_MS = b"300000"
_HEADER = struct.Struct("!I")
_PREFIX = job_prefix("scale") + "/"


@dataclass
class Job:
    """What the simulated ranks share: the store's address, and when each member saw and met each generation."""

    port: int
    secret: bytes
    mode: str  # push or poll
    requests: int = 0
    seen: dict[str, dict[int, float]] = field(default_factory=dict)
    met: dict[str, dict[int, float]] = field(default_factory=dict)
    records: dict[int, tuple[Generation, frozenset[str]]] = field(default_factory=dict)
    counts: dict[tuple[str, int], int] = field(default_factory=dict)  # ("seen" or "met", generation) -> ranks
    relayed: dict[str, asyncio.Queue[tuple[bytes | None, bytes | None]]] = field(default_factory=dict)
    parsed: dict[bytes, Generation] = field(default_factory=dict)
    rtts: list[float] = field(default_factory=list)

    def mark(self, table: str, member: str, number: int) -> None:
        """`member` saw (or met in) generation `number` now: kept, and counted (the run's checks are O(1))."""
        where = self.seen if table == "seen" else self.met
        if number not in where.setdefault(member, {}):
            where[member][number] = time.monotonic()
            self.counts[table, number] = self.counts.get((table, number), 0) + 1

    def keep(self, generation: Generation) -> None:
        """A generation and its member set, made once for all the simulated ranks (not once each)."""
        self.records.setdefault(generation.number, (generation, frozenset(generation.members)))


class Client:
    """One connection to the job's store, with either handshake (GWIS1: the client proves first; GWIS2: the server)."""

    def __init__(self, job: Job, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.job, self.reader, self.writer = job, reader, writer

    async def ask(self, op: int, fields: list[bytes]) -> list[bytes]:
        body = bytes([op]) + b"".join(_HEADER.pack(len(f)) + f for f in fields)
        self.writer.write(_HEADER.pack(len(body)) + body)
        self.job.requests += 1
        (size,) = _HEADER.unpack(await self.reader.readexactly(4))
        reply = await self.reader.readexactly(size)
        if reply[0] != 0:
            raise ConnectionError(f"the store answered {reply[0]}: {reply[1:80]!r}")
        out, at = [], 1
        while at < size:
            (n,) = _HEADER.unpack_from(reply, at)
            out.append(reply[at + 4 : at + 4 + n])
            at += 4 + n
        return out

    async def get(self, key: str) -> bytes:
        return (await self.ask(GET, [(_PREFIX + key).encode(), b"600000"]))[0]

    async def watch(self, conditions: list[tuple[str, bytes, bytes]], millis: bytes) -> list[bytes | None]:
        fields = [millis]
        for key, cond, arg in conditions:
            fields += [(_PREFIX + key).encode(), cond, arg]
        return [v[1:] if v else None for v in await self.ask(WATCH, fields)]

    async def append(self, event: dict[str, Any]) -> None:
        index = int((await self.ask(ADD, [(_PREFIX + "events").encode(), b"1"]))[0]) - 1
        await self.ask(SET, [f"{_PREFIX}event/{index}".encode(), json.dumps(event).encode()])

    def close(self) -> None:
        self.writer.close()


def _mac(secret: bytes, who: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, who + first + second, hashlib.sha256).digest()


async def connect(job: Job, old_wire: bool, tries: int = 400) -> Client:
    """A proved connection (tried again while the store turns strangers away: too many handshakes at once)."""
    for _ in range(tries):
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", job.port)
            mine = os.urandom(32)
            if old_wire:
                theirs = (await reader.readexactly(37))[5:]
                writer.write(mine + _mac(job.secret, b"client", theirs, mine))
                await reader.readexactly(32)
            else:
                writer.write(b"GWIS2" + mine)
                theirs = (await reader.readexactly(69))[5:37]
                writer.write(_mac(job.secret, b"client", theirs, mine))
                await reader.readexactly(1)
            return Client(job, reader, writer)
        except (OSError, asyncio.IncompleteReadError):
            await asyncio.sleep(0.05)
    raise ConnectionError("the store turned this simulated rank away 400 times")


# -- a rank, as membership.py has it ----------------------------------------------------------------


async def push_rank(job: Job, client: Client, member: str) -> None:
    """Long-poll the generations (or take them from the node's relay); meet in each that has this member;
    end when one drops it."""
    known, met = b"", job.met.setdefault(member, {})
    relayed = job.relayed.get(member)
    while True:
        if relayed is not None:
            gen, delta = await relayed.get()
        else:
            gen, delta, _ = await client.watch([(GEN, NE, known), (DELTA, READ, b""), (DONE, NE, b"")], LONG_POLL_MS)
        if gen is None:
            continue
        known, number = encoded(gen), int(gen)
        job.mark("seen", member, number)
        while True:
            if number not in job.records:
                made = _from_delta(job, number, delta) or Generation.from_json(await client.get(f"gen/{number}"))
                job.keep(made)
            generation, members = job.records[number]
            if member not in members:
                if met:
                    return  # dropped
                break  # not taken in yet: wait for the next
            if await _meet(client, number, len(generation.members)):
                job.mark("met", member, number)
                break
            newest = int(await client.get(GEN))
            number, delta, known = newest, None, encoded(str(newest).encode())
            job.mark("seen", member, number)


def _from_delta(job: Job, number: int, delta: bytes | None) -> Generation | None:
    """The generation from its delta and the one before (parsed once for all the simulated ranks)."""
    if delta is None:
        return None
    made = job.parsed.get(delta)
    if made is None:
        previous = job.records.get(number - 1)
        made = from_delta(delta, previous[0] if previous else None)
        if made is not None:
            job.parsed[delta] = made
    return made if made is not None and made.number == number else None


async def _relay(client: Client, ranks: list[asyncio.Queue[tuple[bytes | None, bytes | None]]]) -> None:
    """The node's launcher (gpuwatch.inplace.relay): one long poll, each answer handed to the node's ranks."""
    known = b""
    while True:
        gen, delta, _ = await client.watch([(GEN, NE, known), (DELTA, READ, b""), (DONE, NE, b"")], LONG_POLL_MS)
        known = encoded(gen)
        for queue in ranks:
            queue.put_nowait((gen, delta))


async def _meet(client: Client, number: int, members: int) -> bool:
    if int((await client.ask(ADD, [f"{_PREFIX}ready/{number}".encode(), b"1"]))[0]) >= members:
        return True
    values = await client.watch(
        [(f"ready/{number}", GE, str(members).encode()), (GEN, NE, encoded(str(number).encode()))], LONG_POLL_MS
    )
    return values[0] is not None and int(values[0]) >= members


# -- a rank, as job.py had it -----------------------------------------------------------------------


async def poll_rank(job: Job, client: Client, member: str) -> None:
    """Poll `gen` every 20 ms; at a change read the record, set a ready key and check every member's."""
    latest, met = 0, job.met.setdefault(member, {})
    while True:
        await asyncio.sleep(POLL_S)
        started = time.monotonic()
        number = await _latest(client)
        job.rtts.append(time.monotonic() - started)
        if number <= latest:
            continue
        latest = number
        job.mark("seen", member, number)
        while True:
            raw = await client.get(f"gen/{number}")  # every rank reads the whole record
            if number not in job.records:
                job.keep(Generation.from_json(raw))
            generation, members = job.records[number]
            if member not in members:
                if met:
                    return  # dropped
                break  # not taken in yet: wait for the next
            await client.ask(SET, [f"{_PREFIX}ready/{number}/{member}".encode(), b"1"])
            keys = [f"{_PREFIX}ready/{number}/{m}".encode() for m in generation.members]
            while (newest := await _latest(client)) <= number:
                if (await client.ask(CHECK, keys))[0] == b"1":
                    break
                await asyncio.sleep(MEET_POLL_S)
            if newest <= number:
                job.mark("met", member, number)
                break
            number = latest = newest
            job.mark("seen", member, number)


async def _latest(client: Client) -> int:
    if (await client.ask(CHECK, [(_PREFIX + GEN).encode()]))[0] != b"1":
        return 0
    return int(await client.get(GEN))


# -- the run -----------------------------------------------------------------------------------------


def raise_descriptor_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def simulate(
    job: Job,
    ranks: int,
    host_stats: Callable[[], tuple[float, int]],
    *,
    form_s: float = 120.0,
    idle_s: float = 3.0,
    change_s: float = 30.0,
) -> dict[str, Any]:
    """Form a job of `ranks` simulated ranks, measure it idle, kill one, add one; the figures.

    host_stats: the store process's (CPU seconds, requests answered or -1).
    """
    raise_descriptor_limit()
    old = job.mode == "poll"
    rank = poll_rank if old else push_rank
    relays: dict[int, list[asyncio.Queue[tuple[bytes | None, bytes | None]]]] = {}
    nodes = (ranks + PER_NODE - 1) // PER_NODE
    launcher = await connect(job, old)
    for node in range(nodes):
        await launcher.append({"kind": "node", "node": node, "workers": min(PER_NODE, ranks - node * PER_NODE)})
    members = [f"n{i // PER_NODE}.g{i % PER_NODE}.{i}" for i in range(ranks)]
    clients: dict[str, Client] = {}
    tasks: dict[str, asyncio.Task[None]] = {}
    started = time.monotonic()
    gate = asyncio.Semaphore(256)

    async def start(member: str) -> None:
        async with gate:
            client = await connect(job, old)
        clients[member] = client
        node = int(member[1:].split(".")[0])
        if job.mode == "relay":
            if node not in relays:
                relays[node] = []
                tasks[f"relay{node}"] = asyncio.ensure_future(_relay(await connect(job, old), relays[node]))
            job.relayed[member] = asyncio.Queue()
            relays[node].append(job.relayed[member])
        await client.append({"kind": "join", "member": member, "node": int(member[1:].split(".")[0])})
        tasks[member] = asyncio.ensure_future(rank(job, client, member))

    figures: dict[str, Any] = {"ranks": ranks, "mode": job.mode}
    formed = await _until(
        lambda: job.counts.get(("met", 1), 0) >= len(members),
        form_s,
        asyncio.gather(*(start(m) for m in members)),
    )
    figures["form_s"] = round(time.monotonic() - started, 3) if formed else None

    await asyncio.sleep(1.0)
    requests0, t0 = job.requests, time.monotonic()
    cpu0, served0 = host_stats()  # its CPU is read at once, at t0
    job.rtts.clear()
    probe = await connect(job, old)
    probes = []
    while time.monotonic() - t0 < idle_s:
        begun = time.monotonic()
        await probe.get(GEN)
        probes.append(time.monotonic() - begun)
        await asyncio.sleep(0.05)
    window, requests1 = time.monotonic() - t0, job.requests
    cpu1, served1 = host_stats()
    figures["idle_store_cpu_pct"] = round(100 * (cpu1 - cpu0) / window, 1)
    figures["idle_requests_per_s"] = round((requests1 - requests0 - len(probes)) / window, 1)
    figures["idle_served_per_s"] = round((served1 - served0) / window, 1) if served0 >= 0 else None
    figures["request_p50_ms"], figures["request_p99_ms"] = _p50_p99(probes)
    figures["poll_p50_ms"], figures["poll_p99_ms"] = _p50_p99(job.rtts) if job.rtts else (None, None)
    if not formed:
        return figures

    victim = members[-1]
    tasks[victim].cancel()
    clients[victim].close()
    survivors = members[:-1]
    cpu0, _ = host_stats()
    killed = time.monotonic()
    await launcher.append({"kind": "gone", "member": victim, "code": -9, "node": int(victim[1:].split(".")[0])})
    figures["kill_seen_s"], figures["kill_met_s"] = await _change(job, survivors, 2, killed, change_s)
    figures["kill_store_cpu_s"] = round(host_stats()[0] - cpu0, 3)  # what the change cost the store itself

    joiner = f"n0.g{PER_NODE}.{ranks}"
    cpu0, _ = host_stats()
    joined = time.monotonic()
    await start(joiner)
    figures["join_seen_s"], figures["join_met_s"] = await _change(job, [*survivors, joiner], 3, joined, change_s)
    figures["join_store_cpu_s"] = round(host_stats()[0] - cpu0, 3)
    for task in tasks.values():
        task.cancel()
    for client in [*clients.values(), launcher, probe]:
        client.close()
    return figures


async def _change(job: Job, who: list[str], number: int, since: float, limit_s: float) -> tuple[float | None, ...]:
    """Seconds until every one of `who` has seen generation `number`, and until all met in it."""
    out: list[float | None] = []
    for name, table in (("seen", job.seen), ("met", job.met)):

        def everyone(key: tuple[str, int] = (name, number)) -> bool:
            return job.counts.get(key, 0) >= len(who)

        done = await _until(everyone, limit_s)
        out.append(round(max(table[m][number] for m in who) - since, 3) if done else None)
    return tuple(out)


async def _until(check: Callable[[], bool], limit_s: float, alongside: Any = None) -> bool:
    deadline = time.monotonic() + limit_s
    side = asyncio.ensure_future(alongside) if alongside is not None else None
    try:
        while time.monotonic() < deadline:
            if check():
                return True
            await asyncio.sleep(0.005)
        return False
    finally:
        if side is not None and not side.done():
            side.cancel()


def _p50_p99(samples: list[float]) -> tuple[float | None, float | None]:
    if not samples:
        return None, None
    ordered = sorted(samples)
    return (
        round(1000 * ordered[len(ordered) // 2], 2),
        round(1000 * ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 2),
    )
