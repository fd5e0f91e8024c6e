"""Dead peers are noticed in about a second: a ZmqConnector get whose producer was SIGKILLed fails with
the clear error long before its 30 s deadline, whether the producer dies while the get waits on a live
connection or before the get connects. Real producer processes, real sockets."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from support.meshkit import wait_until

from omni_mesh.connectors import create_connector
from omni_mesh.connectors.errors import ConnectorError

DEADLINE_S = 30.0
FAST_S = 3.0

PRODUCER = r"""
import json, sys, time, torch
from omni_mesh.connectors import create_connector
connector = create_connector("ZmqConnector", {"host": "127.0.0.1"})
metadata = [connector.put("a", "b", f"r/{i}", {"x": torch.full((1 << 18,), float(i))})[2] for i in range(2)]
print(json.dumps(metadata), flush=True)
time.sleep(600)
"""


@pytest.fixture
def producer():
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, f"the producer exited ({proc.poll()}) before putting"
        yield proc, json.loads(line)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        proc.stdout.close()


@pytest.fixture
def consumer():
    connector = create_connector("ZmqConnector", {"host": "127.0.0.1", "get_timeout_s": DEADLINE_S})
    yield connector
    connector.close()


def _wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Until the process shows as stopped (state T in /proc/PID/stat)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {timeout_s:g}s of SIGSTOP")


def _get(consumer, key: str, metadata: dict) -> tuple:
    """The stage runtime's get: blocking, with a DEADLINE_S deadline."""
    return consumer.get_with_deadline("a", "b", key, metadata, deadline=time.monotonic() + DEADLINE_S)


def _failing_get(consumer, key: str, metadata: dict) -> tuple[float, str]:
    started = time.monotonic()
    with pytest.raises(ConnectorError) as caught:
        _get(consumer, key, metadata)
    return time.monotonic() - started, str(caught.value)


# Five times: the get is asked again on a fresh socket right after its connection broke, and a socket
# made just after another one with a monitor closed saw no connection event at all in 1 of 2-16 tries
# (a 30 s wait) until the closed one's monitor was stopped first (served/dealers.py).
@pytest.mark.parametrize("attempt", range(5))
def test_get_fails_fast_when_the_producer_is_killed_mid_wait(producer, consumer, attempt: int) -> None:
    proc, metadata = producer
    obj, _ = _get(consumer, "r/0", metadata[0])
    assert torch.equal(obj["x"], torch.zeros(1 << 18))
    # r/0's confirmation (DONE) goes off the get's path: answered before the producer stops.
    assert wait_until(lambda: consumer.health()["confirms_pending"] == 0, timeout_s=10), "r/0 never confirmed"
    os.kill(proc.pid, signal.SIGSTOP)  # it can no longer answer: the next get waits on a live connection
    _wait_stopped(proc.pid)  # the signal takes effect asynchronously: a loaded VM may let it answer first
    outcome: dict = {}

    def get() -> None:
        try:
            _get(consumer, "r/1", metadata[1])
            outcome["error"] = None
        except ConnectorError as exc:
            outcome["error"] = str(exc)
        outcome["at"] = time.monotonic()

    waiter = threading.Thread(target=get)
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive(), f"the get ended before the producer was killed: {outcome}"
    killed = time.monotonic()
    proc.kill()
    waiter.join(DEADLINE_S + 5)
    assert not waiter.is_alive()
    assert outcome["error"] is not None, "a get from a killed producer succeeded"
    print(f"killed mid-wait: the get failed {outcome['at'] - killed:.2f}s after the kill")
    assert outcome["at"] - killed < FAST_S, f"noticed {outcome['at'] - killed:.1f}s after the kill"
    message = outcome["error"]
    assert metadata[1]["endpoint"] in message and "'r/1'" in message and "a->b" in message, message
    assert "broke" in message or "gone" in message, message
    assert consumer.health()["errors"] == 1


def test_get_fails_fast_when_the_producer_was_killed_before_it(producer, consumer) -> None:
    proc, metadata = producer
    proc.kill()
    proc.wait(10)
    elapsed, message = _failing_get(consumer, "r/0", metadata[0])
    print(f"killed before the get: it failed after {elapsed:.2f}s")
    assert elapsed < FAST_S, f"took {elapsed:.1f}s with a {DEADLINE_S:g}s deadline: {message}"
    assert metadata[0]["endpoint"] in message and "refuses connections" in message, message


def test_a_live_slow_reply_is_still_waited_for(consumer) -> None:
    """Heartbeats and connection events keep a connection whose peer is alive: a get of 64 MiB after
    the connection sat idle for a while still works."""
    producer = create_connector("ZmqConnector", {"host": "127.0.0.1"})
    try:
        _, _, first = producer.put("a", "b", "s/0", {"x": torch.ones(16)})
        _get(consumer, "s/0", first)
        time.sleep(2.5)  # idle for several heartbeats: the connection must stay up
        _, _, big = producer.put("a", "b", "s/1", {"x": torch.ones(16 << 20)})
        obj, _ = _get(consumer, "s/1", big)
        assert torch.equal(obj["x"], torch.ones(16 << 20))
        assert consumer.health()["errors"] == 0
    finally:
        producer.close()


def test_a_poll_that_gives_up_before_the_answer_does_not_lose_the_payload(producer, consumer) -> None:
    # vllm-omni polls `get` (about a second each). A producer that answers later than that (stopped for
    # 2 s here; a large payload on a slow link alike) hands the payload over when it does answer: the
    # poll's request stays waiting and a later poll receives it, instead of asking again and hearing it
    # was handed over already.
    proc, metadata = producer
    obj, _ = consumer.get("a", "b", "r/0", metadata[0])
    assert torch.equal(obj["x"], torch.zeros(1 << 18))
    os.kill(proc.pid, signal.SIGSTOP)
    _wait_stopped(proc.pid)
    started = time.monotonic()
    assert consumer.get("a", "b", "r/1", metadata[1]) is None
    assert time.monotonic() - started < 2.5  # a poll: about a second, not the 30 s deadline
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGCONT)
    got, deadline = None, time.monotonic() + 10
    while got is None and time.monotonic() < deadline:
        got = consumer.get("a", "b", "r/1", metadata[1])
    assert got is not None, "the payload was lost with the poll that gave up"
    assert torch.equal(got[0]["x"], torch.full((1 << 18,), 1.0))
    assert wait_until(lambda: consumer.get("a", "b", "r/1", metadata[1]) is None, timeout_s=5)  # handed over once


@contextlib.contextmanager
def _dropped(port: int, *, replies: bool = False) -> Iterator[Callable[[], None]]:
    """Packets to 127.0.0.1:`port` (`replies`: from it) dropped (a network fault: nothing is refused,
    nothing arrives) until the yielded function is called, or the block ends."""
    where = ["-s", "127.0.0.1", "--sport"] if replies else ["-d", "127.0.0.1", "--dport"]
    rule = ["OUTPUT", "-p", "tcp", *where, str(port), "-j", "DROP"]
    added = subprocess.run(["iptables", "-w", "-I", *rule], capture_output=True, text=True)
    if added.returncode != 0:
        pytest.fail(f"needs iptables as root to drop packets (make test installs it): {added.stderr.strip()[:200]}")
    removed = False

    def restore() -> None:
        nonlocal removed
        if not removed:
            subprocess.run(["iptables", "-w", "-D", *rule], capture_output=True, check=True)
            removed = True

    try:
        yield restore
    finally:
        restore()


# Unacknowledged bytes that only the 1 MiB answer can make (a heartbeat is a few bytes); a send buffer
# the kernel never grew (every packet dropped) holds 16 KiB or more of it.
ANSWER_PART = 8192


def _unacknowledged(port: int) -> int:
    """Bytes the producer's sockets (local port `port`) hold sent but not acknowledged (ss's Send-Q)."""
    listing = subprocess.run(
        ["ss", "-tnH", "state", "established", f"( sport = :{port} )"], capture_output=True, text=True
    ).stdout
    return max((int(line.split()[1]) for line in listing.splitlines() if line.split()), default=0)


def _get_across_a_cut(producer, consumer, *, replies: bool) -> dict:
    """Get payload r/1 while packets to the producer (`replies`: from it) are dropped, then reset the
    connection (`ss -K`) and let the network back, as a flaky network does: {"x": tensor} or {"error"}."""
    proc, metadata = producer
    obj, _ = _get(consumer, "r/0", metadata[0])
    assert torch.equal(obj["x"], torch.zeros(1 << 18))
    # r/0's confirmation (DONE) goes off the get's path: once answered, the consumer's socket is
    # connected and idle. A confirmation still in flight when the packets stop would time out and
    # take the connection down with it, and the get of r/1 would wait for a new one (seen under load:
    # "no answer queued", or no answer within the deadline).
    assert wait_until(lambda: consumer.health()["confirms_pending"] == 0, timeout_s=10), "r/0 never confirmed"
    port = int(metadata[1]["endpoint"].rsplit(":", 1)[1])
    outcome: dict = {}

    def get() -> None:
        try:
            outcome["x"] = _get(consumer, "r/1", metadata[1])[0]["x"]
        except ConnectorError as exc:
            outcome["error"] = str(exc)

    with _dropped(port, replies=replies) as restore:
        waiter = threading.Thread(target=get)
        waiter.start()
        if replies:  # part of the answer sits unacknowledged in the producer's socket: it heard the GET
            assert wait_until(lambda: _unacknowledged(port) >= ANSWER_PART, timeout_s=10), "no answer queued"
        else:  # the GET is small (a heartbeat's size): give it the time to leave
            time.sleep(0.5)
        assert waiter.is_alive(), f"the get ended while no answer could arrive: {outcome}"
        cut = subprocess.run(["ss", "-K", "dst", f"127.0.0.1:{port}"], capture_output=True, text=True)
        if cut.returncode != 0:
            pytest.skip(f"ss -K cannot destroy sockets here: {cut.stderr.strip()[:200]}")
        time.sleep(0.3)
        restore()  # the network is back: the new connection's SYN gets through at its next retry
        waiter.join(DEADLINE_S + 5)
    assert not waiter.is_alive()
    return outcome


def test_a_get_whose_connection_breaks_before_the_producer_heard_it_is_asked_again(producer, consumer) -> None:
    """The consumer's GET is lost on the way (packets dropped), then its connection is reset (`ss -K`),
    as a flaky network does: the producer never heard it and still holds the payload. The get asks
    again on a new connection and brings the payload, instead of failing the request with "no answer
    will come"."""
    outcome = _get_across_a_cut(producer, consumer, replies=False)
    assert "error" not in outcome, outcome["error"]
    assert torch.equal(outcome["x"], torch.full((1 << 18,), 1.0))
    health = consumer.health()
    assert health["asked_again"] == 1 and health["errors"] == 0, health


def test_a_get_whose_answer_is_lost_with_its_connection_is_served_again(producer, consumer) -> None:
    """The producer hears the GET and answers, but the answer is lost on the way (packets from it
    dropped) and the connection is reset (`ss -K`): the producer kept the payload it served until the
    consumer confirms, so the get asked again on a new connection brings it. Confirmed, it is gone."""
    outcome = _get_across_a_cut(producer, consumer, replies=True)
    assert "error" not in outcome, outcome["error"]
    assert torch.equal(outcome["x"], torch.full((1 << 18,), 1.0))
    assert consumer.health()["asked_again"] == 1
    metadata = producer[1][1]
    assert wait_until(lambda: consumer.get("a", "b", "r/1", metadata) is None, timeout_s=5), "never confirmed"
