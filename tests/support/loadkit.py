"""Closed-loop load for autoscaling tests: N client threads, each sending one request after another
until told to stop, and a sampler of /v1/stages (each stage's current and target replicas over time)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Done:
    end: float  # time.monotonic() when the answer came
    status: int
    latency_s: float
    body: str = ""


@dataclass
class Load:
    """`clients` threads posting `body` to `url`/v1/requests while running."""

    url: str
    body: dict
    clients: int
    headers: dict[str, str] = field(default_factory=dict)
    done: list[Done] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        for _ in range(self.clients):
            thread = threading.Thread(target=self._client, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)

    def _client(self) -> None:
        timeout = float(self.body.get("timeout_s", 30)) + 30
        with httpx.Client(base_url=self.url, timeout=timeout, headers=self.headers) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                try:
                    response = client.post("/v1/requests", json=self.body)
                    status, text = response.status_code, "" if response.status_code == 200 else response.text
                except httpx.HTTPError as exc:
                    status, text = 0, repr(exc)
                now = time.monotonic()
                self.done.append(Done(now, status, now - start, text))

    def failed(self) -> list[Done]:
        return [d for d in self.done if d.status != 200]

    def rate(self, start: float, end: float) -> float:
        """Successful answers per second between two monotonic times."""
        return sum(1 for d in self.done if start <= d.end < end and d.status == 200) / (end - start)


@dataclass
class Sampler:
    """(time, {stage: (current, target, registered)}) every `every_s`, from /v1/stages."""

    url: str
    every_s: float = 0.2
    samples: list[tuple[float, dict[str, tuple[int, int, int]]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=5) as client:
            while not self._stop.wait(self.every_s):
                try:
                    stages = client.get("/v1/stages").json()["stages"]
                except (httpx.HTTPError, ValueError, KeyError):
                    continue
                now = time.monotonic()
                self.samples.append(
                    (now, {s["name"]: (s["current_replicas"], s["target_replicas"], len(s["replicas"])) for s in stages})
                )

    def first(self, stage: str, predicate, since: float = 0.0) -> float | None:  # noqa: ANN001
        """The time of the first sample at or after `since` where predicate(current, target, registered)."""
        for at, stages in list(self.samples):
            if at >= since and stage in stages and predicate(*stages[stage]):
                return at
        return None
