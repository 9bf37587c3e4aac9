"""The serving instances behind the router: their health, and which of them a request goes to.

Each backend's GET /health (what `k3 serve` answers: 200 {"status": "ok"}, or 503 when its engine loop stopped) is
polled every `health_interval_s`. A backend is down after a refused connection (at once: nothing listens) or after
FALL_POLLS failed polls in a row (a timeout or an error status: a busy machine can be slow to answer once), and up
again after one good poll. A request that fails on a backend probes its health at once, so a killed instance is
down for every later request without waiting for the next poll.

Policies: "affinity" sends a session to the first healthy owner of its key on the consistent-hash ring
(k3.route.ring): its primary while that is up, else its secondary, and back to the primary once it is up again;
"round-robin" takes the healthy backends in turn (the baseline the affinity policy is measured against).
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import httpx

from k3.route.ring import DEFAULT_VNODES, HashRing

logger = logging.getLogger("k3.route")

POLICIES = ("affinity", "round-robin")
FALL_POLLS = 2  # failed polls in a row (other than a refused connection) that mark a backend down
HEALTH_TIMEOUT_S = 2.0


class Backend:
    """One instance: its URL, health and counters (rendered per backend by /metrics)."""

    def __init__(self, url: str):
        self.url = url
        self.healthy = True  # until the first poll says otherwise
        self.failed_polls = 0
        self.in_flight = 0
        self.requests = 0  # requests sent to it (attempts, retries included)
        self.errors = 0  # attempts that failed (connection lost, 502/503/504)
        self.affinity_hits = 0  # requests it answered as the session's primary
        self.failovers = 0  # requests of sessions whose primary it is, sent elsewhere because it was down
        self.retries = 0  # requests retried elsewhere after failing on it
        self.marked_down = 0  # times it went from up to down

    def set_health(self, ok: bool, refused: bool = False) -> None:
        if ok:
            if not self.healthy:
                logger.warning("backend %s is up", self.url)
            self.healthy, self.failed_polls = True, 0
            return
        self.failed_polls += 1
        if self.healthy and (refused or self.failed_polls >= FALL_POLLS):
            self.healthy = False
            self.marked_down += 1
            logger.warning("backend %s is down", self.url)


class Fleet:
    """The backends, the ring over them, and the health poller."""

    def __init__(self, urls: list[str], policy: str = "affinity", vnodes: int = DEFAULT_VNODES,
                 health_interval_s: float = 1.0):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not urls:
            raise ValueError("at least one backend is needed")
        if len(set(urls)) != len(urls):
            raise ValueError(f"a backend is given twice: {urls}")
        if not health_interval_s > 0:
            raise ValueError(f"health_interval_s must be positive, got {health_interval_s!r}")
        self.backends = {u: Backend(u) for u in urls}
        self.ring = HashRing(urls, vnodes)
        self.policy, self.health_interval_s = policy, float(health_interval_s)
        self._turn = itertools.count()

    def candidates(self, session_key: str) -> tuple[Backend, list[Backend]]:
        """(the session's ring primary, the healthy backends to try in order); the list is empty when none is up."""
        owners = [self.backends[u] for u in self.ring.owners(session_key)]
        if self.policy == "affinity":
            return owners[0], [b for b in owners if b.healthy]
        up = [b for b in self.backends.values() if b.healthy]
        if not up:
            return owners[0], []
        k = next(self._turn) % len(up)
        return owners[0], up[k:] + up[:k]

    # --- health ----------------------------------------------------------------------------------------------------
    async def check(self, client: httpx.AsyncClient, b: Backend) -> bool:
        try:
            r = await client.get(f"{b.url}/health", timeout=HEALTH_TIMEOUT_S)
            ok, refused = r.status_code == 200, False
        except httpx.ConnectError:
            ok, refused = False, True
        except httpx.HTTPError:
            ok, refused = False, False
        b.set_health(ok, refused)
        return ok

    async def check_all(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self.check(client, b) for b in self.backends.values()))

    async def poll(self, client: httpx.AsyncClient) -> None:
        """Check every backend each health_interval_s, until cancelled."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.check_all(client)
