"""The mesh end to end: `omni-mesh up` as a subprocess, real stage processes, ZeroMQ and HTTP.

Each test class runs one mesh (a class-scoped fixture, see tests/support/meshkit.py) and its tests share
it; the fixture stops the mesh with a signal and checks that no process and no shared-memory
segment of it is left. Test handlers live in tests/support/mesh_handlers.py, copied next to each topology.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import random
import signal
import subprocess
import time
import wave
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from support.meshkit import Mesh, running_mesh, up_command, wait_for, write_topology

from omni_mesh.ports import free_port
from omni_mesh.stage.overdue import OVERDUE_S

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "compose" / "omni-demo.yaml"
INLINE_MAX = 16 * 1024  # SharedMemoryConnector's default inline_max_bytes
SMALL_POOL = {"name": "SharedMemoryConnector", "extra": {"memory_pool_size": 8 * 1024 * 1024}}


def _stage(stage_id: int, name: str, handler: str, **more: object) -> dict:
    return {"stage_id": stage_id, "name": name, "handler": f"mesh_handlers:{handler}", **more}


CHAIN = {
    "name": "e2e-chain",
    "connectors": {"shm": SMALL_POOL},
    "stages": [
        _stage(0, "a", "step", output_connectors={"to_stage_1": "shm"}),
        _stage(
            1, "b", "step", input_connectors={"from_stage_0": "shm"}, output_connectors={"to_stage_2": "shm"}
        ),
        _stage(
            2, "c", "step", input_connectors={"from_stage_1": "shm"}, output_connectors={"to_stage_3": "shm"}
        ),
        _stage(3, "d", "step", input_connectors={"from_stage_2": "shm"}, final_output=True),
    ],
}

GRAPH = {
    "name": "e2e-graph",
    "connectors": {"shm": SMALL_POOL},
    "edges": [{"from": s, "to": d, "connector": "shm"} for s, d in [(0, 1), (0, 2), (1, 3), (2, 3), (2, 4)]],
    "stages": [
        _stage(0, "split", "split"),
        _stage(1, "left", "left"),
        _stage(2, "right", "right"),
        _stage(3, "join", "join", engine_input_source=[1, 2], final_output=True),
        _stage(4, "side", "side", engine_input_source=[2], final_output=True),
    ],
}

STREAM = {
    "name": "e2e-stream",
    "connectors": {"shm": SMALL_POOL},
    "stages": [
        _stage(0, "gen", "gen", output_connectors={"to_stage_1": "shm"}),
        _stage(1, "relay", "relay", engine_input_source=[0], final_output=True),
    ],
}


def chain_expected(n: int) -> dict:
    """x -> 2x+1 (a), 2x+2 (b), 2x+3 (c), 2x+4 (d) on arange(n): 16x + 26."""
    y = 16 * np.arange(n, dtype=np.float64) + 26
    return {
        "trail": ["a", "b", "c", "d"],
        "n": n,
        "head": y[:3].tolist(),
        "tail": y[-2:].tolist(),
        "sum": float(y.sum()),
    }


def shm_counters(mesh: Mesh, stage: str) -> dict:
    return mesh.connector_health(stage).get("shm", {})


def sse_events(response: httpx.Response) -> Iterator[tuple[str, dict]]:
    event = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line[len("event: ") :]
        elif line.startswith("data: "):
            assert event is not None, f"data line without an event: {line!r}"
            yield event, json.loads(line[len("data: ") :])
            event = None


# ================================================================== the demo pipeline


@pytest.fixture(scope="class")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("demo"), DEMO, sig=signal.SIGINT) as mesh:
        yield mesh


class TestDemo:
    def test_returns_text_and_a_playable_wav(self, demo: Mesh) -> None:
        body = demo.ok({"prompt": "Hello, omni-mesh!"}, params={"max_tokens": 48})
        out = body["outputs"]
        assert "Hello, omni-mesh!" in out["text"]
        assert out["sample_rate"] == 24_000
        with wave.open(io.BytesIO(base64.b64decode(out["audio_wav_base64"]))) as wav:
            assert (wav.getframerate(), wav.getsampwidth(), wav.getnchannels()) == (24_000, 2, 1)
            frames = wav.getnframes()
            samples = np.frombuffer(wav.readframes(frames), dtype="<i2")
        assert frames > 0 and len(samples) == frames
        assert frames / 24_000 == pytest.approx(out["duration_s"])
        assert np.abs(samples.astype(np.int32)).max() > 1000, "the WAV is silent"
        assert set(body["timings"]) == {"thinker", "talker", "code2wav"}

    def test_a_missing_prompt_is_422_naming_the_stage(self, demo: Mesh) -> None:
        response = demo.request({})
        assert response.status_code == 422, response.text
        body = response.json()
        assert body["stage"] == "thinker" and "prompt" in body["error"]

    def test_stream_true_delivers_text_then_audio_chunks(self, demo: Mesh) -> None:
        response = demo.request({"prompt": "Hello, streaming!"}, stream=True)
        assert response.status_code == 200, response.text
        events = [line.removeprefix("event: ") for line in response.text.splitlines() if line.startswith("event: ")]
        chunks = [json.loads(line.removeprefix("data: "))["output"] for line in response.text.splitlines()
                  if line.startswith("data: ") and '"output"' in line]
        assert events[-1] == "done" and events.count("chunk") >= 3, events
        assert "text" in chunks[0] and all("audio_pcm16" in c for c in chunks[1:]), [sorted(c) for c in chunks]

    def test_prompts_over_a_megabyte_answer_promptly_and_hold_no_slot(self, demo: Mesh) -> None:
        """Eight 1.2 MB prompts whose clients leave after a second, then a small probe and a 1.2 MB prompt
        that waits. The thinker's output carries the prompt: in the parts form its codec header (the
        strings) rode in the metadata, the output message outgrew the control plane's 1 MiB, the
        coordinator dropped it unread, and each request held a thinker slot to its deadline (all 8 of
        them: the probe waited behind). Now they answer at once and free their slots."""
        prompt = "".join(random.Random(12).choices("omni mesh ", k=1_200_000))
        timeout_s = 30.0

        def leaving(_: int) -> None:
            with contextlib.suppress(httpx.TimeoutException):
                httpx.post(f"{demo.url}/v1/requests", json={"inputs": {"prompt": prompt}, "timeout_s": timeout_s},
                           timeout=1.0)

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(leaving, range(8)))
        started = time.monotonic()
        demo.ok({"prompt": "a small probe"}, timeout_s=timeout_s)
        assert time.monotonic() - started < 10, f"the probe waited {time.monotonic() - started:.1f} s for a slot"
        started = time.monotonic()
        body = demo.ok({"prompt": prompt}, timeout_s=timeout_s)
        assert time.monotonic() - started < 10 and prompt[:40] in body["outputs"]["text"]
        wait_for(lambda: all(r["inflight"] == 0 for r in demo.stages()["thinker"]), 10, "the thinker's slots to free")

    def test_sigint_stops_everything(self, demo: Mesh) -> None:
        # The demo's producers hold shared-memory pools (thinker's hidden states go through it).
        assert demo.our_segments(), "expected the running demo to hold shared-memory pools"
        assert demo.stop(signal.SIGINT) == 0  # also checks: no process, no segment left
        assert "draining" in demo.log()


# ================================================================== a four-stage chain


@pytest.fixture(scope="class")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("chain"), CHAIN, sig=signal.SIGINT) as mesh:
        yield mesh


class TestChain:
    @pytest.mark.parametrize(("n", "pooled"), [(4, False), (8192, True)], ids=["inline", "shm-pool"])
    def test_every_stage_applies_in_order(self, chain: Mesh, n: int, pooled: bool) -> None:
        assert (n * 8 > INLINE_MAX) == pooled
        before = shm_counters(chain, "a")
        body = chain.ok({"n": n})
        assert body["outputs"] == chain_expected(n)
        assert list(body["timings"]) == ["a", "b", "c", "d"]
        # The a->b payload went inline in the metadata, or through a's shared-memory pool.
        after = wait_for(
            lambda: (c := shm_counters(chain, "a"))["puts"] > before["puts"] and c,
            5,
            "stage a's connector counters to show the put (next heartbeat)",
        )
        assert after["puts"] - before["puts"] == 1
        assert after["inline_puts"] - before["inline_puts"] == (0 if pooled else 1)

    def test_concurrent_requests_keep_their_own_data(self, chain: Mesh) -> None:
        sizes = [3, 5000, 7, 9000, 2, 6000, 11, 4096]
        with ThreadPoolExecutor(len(sizes)) as pool:
            bodies = list(pool.map(lambda n: chain.ok({"n": n}), sizes))
        assert [b["outputs"] for b in bodies] == [chain_expected(n) for n in sizes]
        assert len({b["request_id"] for b in bodies}) == len(sizes)

    # A handler's own TimeoutError is a failure of the stage (5xx), not the request's deadline (504).
    @pytest.mark.parametrize("error", ["RuntimeError", "TimeoutError"])
    def test_handler_error_is_a_5xx_naming_the_stage_and_the_mesh_keeps_serving(
        self, chain: Mesh, error: str
    ) -> None:
        response = chain.request({"n": 8192}, params={"fail": "c", "error": error})
        assert 500 <= response.status_code < 600 and response.status_code != 504, response.text
        body = response.json()
        assert body["stage"] == "c"
        assert "'c'" in body["error"] and f"{error}: injected failure in c" in body["error"]
        assert chain.ok({"n": 8192})["outputs"] == chain_expected(8192)

    def test_hang_is_a_504_naming_the_stage_and_payloads_are_reclaimed(self, chain: Mesh) -> None:
        timeout_s = 1.5
        started = time.monotonic()
        response = chain.request({"n": 8192}, params={"hang": "c"}, timeout_s=timeout_s)
        elapsed = time.monotonic() - started
        assert response.status_code == 504, response.text
        assert timeout_s - 0.1 <= elapsed <= timeout_s + 1.0
        body = response.json()
        assert body["stage"] == "c" and "'c'" in body["error"] and "deadline" in body["error"]
        # b's payload for c (through b's pool) was taken by the hung handler; once the request is
        # aborted, b must get the slot back without another put.
        wait_for(
            lambda: (h := shm_counters(chain, "b")) and h["live_payloads"] == 0 and h["pool_in_use"] == 0,
            5,
            "stage b's SharedMemoryConnector to reclaim the aborted request's payload",
        )
        assert chain.replica("c")["inflight"] == 0
        assert chain.ok({"n": 8192})["outputs"] == chain_expected(8192)

    def test_a_request_stuck_past_its_deadline_is_cancelled_again_and_frees_its_slot(self, chain: Mesh) -> None:
        response = chain.request({"n": 64}, params={"stuck": "c"}, timeout_s=1.0)
        assert response.status_code == 504, response.text
        # Cancelled at its deadline, the handler goes on waiting: the replica still works on it, and
        # says so. OVERDUE_S later the runner cancels it again, and logs where it was stuck.
        wait_for(
            lambda: (r := chain.replica("c")) and r["inflight"] == 0 and r["stopping"] == 0,
            OVERDUE_S + 8,
            "stage c to let go of the stuck request",
        )
        assert "past its deadline; cancelling it again" in chain.log()
        assert "_misbehave" in chain.log()  # where it waited
        assert chain.ok({"n": 8192})["outputs"] == chain_expected(8192)

    @pytest.mark.parametrize(
        ("body", "field"),
        [
            ({"inputs": [1, 2]}, "inputs"),
            ({"inputs": "text"}, "inputs"),
            ({"inputs": {}, "params": [1]}, "params"),
            ({"inputs": {}, "bogus": 1}, "bogus"),
            ({"inputs": {}, "timeout_s": 0}, "timeout_s"),
            ({"inputs": {}, "timeout_s": -3}, "timeout_s"),
            ({"inputs": {}, "timeout_s": 10**9}, "timeout_s"),
            ({"inputs": {}, "stream": "maybe"}, "stream"),
        ],
    )
    def test_bad_request_body_is_422(self, chain: Mesh, body: dict, field: str) -> None:
        response = chain.client.post("/v1/requests", json=body)
        assert response.status_code == 422, response.text
        assert field in response.text

    def test_malformed_json_is_422(self, chain: Mesh) -> None:
        response = chain.client.post(
            "/v1/requests", content=b'{"inputs": {', headers={"content-type": "application/json"}
        )
        assert response.status_code == 422, response.text

    @pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
    def test_oversized_body_is_413(self, chain: Mesh, chunked: bool) -> None:
        blob = b'{"inputs": {"n": 4, "blob": "' + b"x" * (16 * 1024 * 1024) + b'"}}'
        step = 1 << 20
        content = (blob[i : i + step] for i in range(0, len(blob), step)) if chunked else blob
        response = chain.client.post(
            "/v1/requests", content=content, headers={"content-type": "application/json"}
        )
        assert response.status_code == 413, response.text[:500]
        assert "exceeds" in response.json()["error"]
        assert chain.ok({"n": 4})["outputs"] == chain_expected(4)

    def test_health_ready_stages_and_docs(self, chain: Mesh) -> None:
        assert chain.client.get("/health").status_code == 200
        ready = chain.ready()
        assert ready.status_code == 200 and ready.json()["ready"] is True and ready.json()["missing"] == []
        stages = chain.stages()
        assert list(stages) == ["a", "b", "c", "d"]
        for name, replicas in stages.items():
            assert [r["id"] for r in replicas] == [f"{name}-0"]
            assert replicas[0]["health"] == "healthy" and replicas[0]["pid"] in chain.processes
        assert chain.client.get("/docs").status_code == 200
        schema = chain.client.get("/openapi.json").json()
        assert {"/v1/requests", "/health", "/ready", "/v1/topology", "/v1/stages"} <= set(schema["paths"])

    def test_killed_stage_fails_fast_restarts_and_serves_again(self, chain: Mesh) -> None:
        victim = chain.replica("c")

        def send() -> tuple[httpx.Response, float]:
            response = chain.request({"n": 4}, params={"sleep": {"c": 30}}, timeout_s=30)
            return response, time.monotonic()

        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(send)
            wait_for(lambda: chain.replica("c")["inflight"] == 1, 10, "the request to reach stage c")
            os.kill(victim["pid"], signal.SIGKILL)
            killed = time.monotonic()
            # The launcher restarts c only after a back-off and a fresh interpreter's start-up (well
            # over half a second), so /ready polled right away sees the gap.
            not_ready = wait_for(
                lambda: (r := chain.ready()).status_code == 503 and r.json(),
                5,
                "/ready to report stage c missing",
            )
            response, answered = pending.result(timeout=20)
        assert any("'c'" in problem for problem in not_ready["missing"]), not_ready
        assert answered - killed < 3.0, (
            f"in-flight request failed only {answered - killed:.1f} s after the kill"
        )
        assert 500 <= response.status_code < 600, response.text
        body = response.json()
        assert body["stage"] == "c" and "'c'" in body["error"] and "died" in body["error"]

        chain.wait_ready(30)
        restarted = chain.replica("c")
        assert restarted["pid"] != victim["pid"] and restarted["restarts"] == victim["restarts"] + 1
        log = chain.log()
        assert "c-0 was killed by SIGKILL" in log
        assert (
            f"replica c-0 of stage c registered from {restarted['host']} pid {restarted['pid']} (restart #"
            in log
        )
        assert chain.ok({"n": 8192})["outputs"] == chain_expected(8192)

    def test_sigint_lets_in_flight_requests_finish_then_stops_everything(self, chain: Mesh) -> None:
        def send() -> httpx.Response:
            with httpx.Client(base_url=chain.url, timeout=30) as client:  # stop() closes chain.client
                body = {"inputs": {"n": 8192}, "params": {"sleep": {"c": 1.0}}, "timeout_s": 20}
                return client.post("/v1/requests", json=body)

        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(send)
            wait_for(lambda: chain.replica("c")["inflight"] == 1, 10, "the request to reach stage c")
            assert chain.stop(signal.SIGINT) == 0  # also checks: no process, no segment left
            response = pending.result(timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["outputs"] == chain_expected(8192)


# ================================================================== fan-out, fan-in, several finals


def test_a_replica_with_a_wedged_thread_still_exits_when_stopped(tmp_path: Path) -> None:
    """A thread stuck in a call (a transfer blocked in native code) must not keep a drained replica
    alive: Python would wait for it at exit, and `up` would have to kill the replica."""
    with running_mesh(tmp_path, CHAIN, sig=signal.SIGTERM) as mesh:
        assert mesh.ok({"n": 8}, params={"wedge": "c"})["outputs"] == chain_expected(8)
        stopping = time.monotonic()
        mesh.stop(signal.SIGTERM)
        took = time.monotonic() - stopping
    log = mesh.log()
    assert "did not stop within" not in log, log[-3000:]
    assert "1 thread(s) still stuck" in log and "'wedged'" in log, log[-3000:]
    assert took < 20, f"the mesh took {took:.1f} s to stop"


@pytest.fixture(scope="class")
def graph(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("graph"), GRAPH, sig=signal.SIGTERM) as mesh:
        yield mesh


class TestGraph:
    def test_fan_out_fan_in_and_several_final_stages(self, graph: Mesh) -> None:
        outputs = graph.ok({"v": [1, 2, 3, 4]})["outputs"]
        assert outputs == {
            "join": {"left": [10, 20, 30, 40], "right": [101, 102, 103, 104], "order": [0, 1, 2, 3]},
            "side": {"seen": [0, 1, 2, 3], "stage": "side"},
        }

    def test_topology_lists_stages_edges_and_connectors(self, graph: Mesh) -> None:
        topology = graph.client.get("/v1/topology").json()
        assert topology["name"] == "e2e-graph"
        assert [(s["id"], s["name"], s["entry"], s["final"]) for s in topology["stages"]] == [
            (0, "split", True, False),
            (1, "left", False, False),
            (2, "right", False, False),
            (3, "join", False, True),
            (4, "side", False, True),
        ]
        edges = {(e["from"], e["to"]): (e["connector"], e["connector_name"]) for e in topology["edges"]}
        assert edges == {
            edge: ("shm", "SharedMemoryConnector") for edge in [(0, 1), (0, 2), (1, 3), (2, 3), (2, 4)]
        }
        assert topology["connectors"]["shm"]["name"] == "SharedMemoryConnector"

    def test_sigterm_stops_everything(self, graph: Mesh) -> None:
        assert graph.stop(signal.SIGTERM) == 0


# ================================================================== streaming


@pytest.fixture(scope="class")
def stream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("stream"), STREAM, sig=signal.SIGINT) as mesh:
        yield mesh


class TestStreaming:
    @pytest.mark.parametrize("size", [4, 8192], ids=["inline", "shm-pool"])
    def test_downstream_sees_every_chunk_in_order(self, stream: Mesh, size: int) -> None:
        count = 12
        outputs = stream.ok({"count": count, "size": size})["outputs"]
        assert outputs == [{"seq": i, "size": size, "sum": float(i * size)} for i in range(count)]

    def test_streaming_final_stage_gives_server_sent_events_in_order(self, stream: Mesh) -> None:
        count, size = 6, 8192
        body = {"inputs": {"count": count, "size": size}, "timeout_s": 20, "stream": True}
        with stream.client.stream("POST", "/v1/requests", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = list(sse_events(response))
        kinds = [kind for kind, _ in events]
        assert kinds == ["chunk"] * count + ["done"], kinds
        expected = [{"seq": i, "size": size, "sum": float(i * size)} for i in range(count)]
        assert [data["output"] for _, data in events[:-1]] == expected
        assert {data["stage"] for _, data in events[:-1]} == {"relay"}
        rids = {data["request_id"] for _, data in events}
        assert len(rids) == 1
        done = events[-1][1]
        # `done` does not repeat what the chunks carried: only the request's id, timings and latency.
        assert set(done) == {"request_id", "timings", "latency_s"} and "relay" in done["timings"], done

    def test_streaming_request_that_fails_ends_with_an_error_event(self, stream: Mesh) -> None:
        body = {"inputs": {"count": 3}, "timeout_s": 20, "stream": True}  # no "size": gen raises
        with stream.client.stream("POST", "/v1/requests", json=body) as response:
            events = list(sse_events(response))
        assert [kind for kind, _ in events] == ["error"]
        assert events[0][1]["stage"] == "gen" and "KeyError" in events[0][1]["error"]
        assert stream.ok({"count": 2, "size": 4})["outputs"][1] == {"seq": 1, "size": 4, "sum": 4.0}


# ================================================================== refusing to start


def test_up_refuses_a_topology_missing_a_handler(tmp_path: Path) -> None:
    topology = {
        "name": "no-handler",
        "stages": [
            _stage(0, "first", "step"),
            {"stage_id": 1, "name": "second", "engine_input_source": [0]},
        ],
    }
    path = write_topology(tmp_path, topology)
    result = subprocess.run(
        up_command(path, free_port()), cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "'second'" in result.stderr and "no handler" in result.stderr, result.stderr
    assert "'first'" not in result.stderr
