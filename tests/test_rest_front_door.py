"""The REST front door: bad input, slow clients, full queues, the API key and TLS.

The mesh tests run real `omni-mesh up` meshes (tests/support/meshkit.py) over real HTTP: one plain mesh with
short read timeouts and a stage that queues at most 2 requests, and one that requires an API key and
serves HTTPS. The rest are fast checks of the pieces: the body model and the msgpack check, the
error envelope, the API key middleware and the read deadlines, each behind a real uvicorn socket.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import selectors
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgpack
import pytest
import uvicorn
from fastapi import FastAPI, Request
from pydantic import ValidationError
from support.browser import rendered
from support.meshkit import Mesh, running_mesh

from omni_mesh import cli
from omni_mesh.coordinator.http import envelope
from omni_mesh.coordinator.http.auth import ApiKey
from omni_mesh.coordinator.http.hosts import is_loopback
from omni_mesh.coordinator.http.limits import (
    BODY_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    MAX_HEAD_BYTES,
    MAX_URL_BYTES,
    read_deadlines,
)
from omni_mesh.coordinator.http.request_body import RequestBody
from omni_mesh.coordinator.scheduling.packable import field_path, unpackable
from omni_mesh.ports import free_port
from omni_mesh.procinfo import descendants

SMALL_POOL = {"name": "SharedMemoryConnector", "extra": {"memory_pool_size": 8 * 1024 * 1024}}
READ_TIMEOUT_S = 2.0  # the plain mesh's header and body timeouts


def front_topology(**stage_a: object) -> dict:
    """a -> d with the chain handlers of tests/support/mesh_handlers.py: x -> 2x+1 -> 2(2x+1)+4 = 4x+6."""
    return {
        "name": "front-door",
        "connectors": {"shm": SMALL_POOL},
        "stages": [
            {"stage_id": 0, "name": "a", "handler": "mesh_handlers:step", "output_connectors": {"to_stage_1": "shm"},
             **stage_a},
            {"stage_id": 1, "name": "d", "handler": "mesh_handlers:step", "input_connectors": {"from_stage_0": "shm"},
             "final_output": True},
        ],
    }


def expected(n: int) -> dict:
    y = [4.0 * i + 6 for i in range(n)]
    return {"trail": ["a", "d"], "n": n, "head": y[:3], "tail": y[-2:], "sum": sum(y)}


def assert_envelope(response: httpx.Response, status: int, **fields: object) -> dict:
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    assert set(body) == {"error", "stage", "request_id", "field"}, body
    assert isinstance(body["error"], str) and body["error"]
    for name, value in fields.items():
        assert body[name] == value, (name, body)
    return body


# ================================================================== pieces, no mesh


class TestRequestBody:
    @pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -1, 0, 0.0, True, False, "5", [5]])
    def test_timeout_must_be_a_finite_positive_number(self, value: object) -> None:
        with pytest.raises(ValidationError) as info:
            RequestBody.model_validate({"timeout_s": value})
        (error,) = info.value.errors()
        assert error["loc"] == ("timeout_s",) and "finite number of seconds > 0" in error["msg"]

    @pytest.mark.parametrize("value", [5, 0.25, 3600, None])
    def test_timeout_accepts_numbers(self, value: object) -> None:
        assert RequestBody.model_validate({"timeout_s": value}).timeout_s == value

    @pytest.mark.parametrize("value", ["yes", 1, "true"])
    def test_stream_must_be_a_boolean(self, value: object) -> None:
        with pytest.raises(ValidationError):
            RequestBody.model_validate({"stream": value})


class TestUnpackable:
    def test_values_msgpack_carries_pass(self) -> None:
        edges = {"top": 2**64 - 1, "bottom": -(2**63), "text": "h\u00e9llo \U0001f600", "f": float("nan")}
        assert unpackable({"p": [edges, {"deep": [[[1]]]}]}, {"x": None, "y": True}) is None

    @pytest.mark.parametrize(
        ("inputs", "params", "field", "reason"),
        [
            ({"p": "\ud800"}, {}, "inputs.p", "lone surrogate (\\ud800) at character 0"),
            ({"ok": 1, "p": "ab\udfff"}, {}, "inputs.p", "at character 2"),
            ({"big": 2**64}, {}, "inputs.big", "integer out of range"),
            ({"small": -(2**63) - 1}, {}, "inputs.small", "integer out of range"),
            ({}, {"a": [0, 1, 2, {"b": 2**70}]}, "params.a[3].b", "integer out of range"),
            ({"\ud800": 1}, {}, 'inputs["\\ud800"]', "the name of this field"),
            ({"a b": [2**64]}, {}, 'inputs["a b"][0]', "integer out of range"),
            # msgpack's order: the first culprit is named, inputs before params.
            ({"x": [1, 2**64, "\ud800"]}, {"y": 2**64}, "inputs.x[1]", "integer out of range"),
        ],
    )
    def test_names_the_first_field_that_cannot_pack(
        self, inputs: dict, params: dict, field: str, reason: str
    ) -> None:
        found = unpackable(inputs, params)
        assert found is not None and found[0] == field, found
        assert reason in found[1], found
        json.dumps(found, ensure_ascii=False).encode()  # the answer itself always serialises

    @staticmethod
    def nest(depth: int, leaf: object) -> object:
        for _ in range(depth):
            leaf = [leaf]
        return leaf

    @pytest.mark.parametrize("depth", [1021, 1022, 1023, 1024])
    def test_nesting_limit_is_msgpacks(self, depth: int) -> None:
        value = self.nest(depth, 1)
        try:
            msgpack.packb({"inputs": {"p": value}, "params": {}}, use_bin_type=True)
            packs = True
        except ValueError:
            packs = False
        found = unpackable({"p": value}, {})
        assert (found is None) == packs, (depth, found)
        if found is not None:
            assert found[0] == "inputs.p" + "[0]" * 1022 and "nested more than 1024 levels" in found[1]

    def test_a_deep_value_is_walked_once_without_recursion(self) -> None:
        # Deeper than Python's recursion limit; a large string beside the culprit at the bottom, which
        # a walk that packed each subtree on its way down would pack at every level.
        start = time.monotonic()
        field, reason = unpackable({"p": self.nest(900, ["x" * (1 << 20), "\ud800"])}, {})
        assert field == "inputs.p" + "[0]" * 900 + "[1]" and "lone surrogate" in reason
        assert time.monotonic() - start < 1.0


def test_field_path_quotes_odd_names_and_keeps_them_short() -> None:
    assert field_path(("inputs", "a", 3, "b")) == "inputs.a[3].b"
    assert field_path(("inputs", "\ud800", "x-y")) == 'inputs["\\ud800"]["x-y"]'
    assert len(field_path(("inputs", "k" * 10_000))) < 100


# ------------------------------------------------------------------ a real uvicorn, a small app


def small_app(api_key: str | None = None) -> FastAPI:
    app = FastAPI()
    envelope.install(app)

    @app.post("/echo")
    async def echo(body: RequestBody) -> dict:
        return {"timeout_s": body.timeout_s}

    @app.get("/ping")
    async def ping() -> dict:
        return {"pong": True}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/raw")
    async def raw(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    if api_key:
        app.add_middleware(ApiKey, key=api_key)
    return app


@contextlib.contextmanager
def serving(app: FastAPI, header_timeout_s: float = 1.0, body_timeout_s: float = 1.0) -> Iterator[str]:
    """`app` behind uvicorn with our read deadlines, on a real socket, in a thread."""
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", lifespan="off", ws="none",
        http=read_deadlines(header_timeout_s, body_timeout_s),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed it."""
    sock.settimeout(timeout_s)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data, time.monotonic()


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a content-length from a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _content_length(data):
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-response: {data!r}"
        data += chunk
    return data


def _content_length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


class TestEnvelope:
    @pytest.mark.parametrize(
        ("raw", "field", "fragment"),
        [
            (b'{"timeout_s": NaN}', "timeout_s", "finite number"),
            (b'{"timeout_s": Infinity}', "timeout_s", "finite number"),
            (b'{"timeout_s": true}', "timeout_s", "finite number"),
            (b'{"stream": "maybe"}', "stream", "boolean"),
            (b'{"inputs": [1]}', "inputs", "dictionary"),
            (b'{"bogus": 1}', "bogus", "unknown field"),
            (b'{"\\ud800": 1}', None, "Unicode"),
            (b'{"inputs": {', None, "not valid JSON at character 12"),
            (b'{"inputs": {"n": ' + b"9" * 5000 + b"}}", None, "could not be parsed"),
            (b"[" * 100_000, None, "could not be parsed"),
            (b"null", None, "must be a JSON object"),
        ],
    )
    def test_bad_bodies_get_422_in_our_envelope(self, raw: bytes, field: str | None, fragment: str) -> None:
        with serving(small_app()) as url:
            response = httpx.post(f"{url}/echo", content=raw, headers={"content-type": "application/json"})
        body = assert_envelope(response, 422, field=field)
        assert fragment in body["error"], body

    def test_unknown_route_and_method(self) -> None:
        with serving(small_app()) as url:
            assert_envelope(httpx.get(f"{url}/nowhere"), 404)
            response = httpx.delete(f"{url}/echo")
        assert_envelope(response, 405)
        assert "POST" in response.headers["allow"]


class TestApiKey:
    KEY = "s3cret-key"

    @pytest.mark.parametrize(
        "authorization", [None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x", KEY, "Bearer"]
    )
    def test_without_the_key_every_route_but_health_is_401(self, authorization: str | None) -> None:
        headers = {"authorization": authorization} if authorization else {}
        with serving(small_app(self.KEY)) as url:
            for method, path in (("GET", "/ping"), ("POST", "/echo"), ("GET", "/docs"), ("GET", "/openapi.json")):
                response = httpx.request(method, f"{url}{path}", headers=headers, json={})
                assert_envelope(response, 401)
                assert response.headers["www-authenticate"] == "Bearer"
            assert httpx.get(f"{url}/health").status_code == 200

    @pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
    def test_the_key_admits(self, scheme: str) -> None:
        with serving(small_app(self.KEY)) as url:
            response = httpx.post(f"{url}/echo", json={"timeout_s": 3}, headers={"authorization": f"{scheme} {self.KEY}"})
        assert response.status_code == 200 and response.json() == {"timeout_s": 3}

    def test_an_empty_key_is_refused(self) -> None:
        with pytest.raises(ValueError, match="empty API key"):
            ApiKey(small_app(), key="")


class TestReadDeadlines:
    def test_a_half_sent_header_is_answered_408_and_closed(self) -> None:
        with serving(small_app(), header_timeout_s=0.5) as url:
            with socket.create_connection(("127.0.0.1", _port(url))) as sock:
                start = time.monotonic()
                sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Slow")
                data, closed = read_until_closed(sock, 10)
            assert httpx.get(f"{url}/ping").status_code == 200
        assert data.startswith(b"HTTP/1.1 408 ") and b"connection: close" in data, data
        assert b"the request headers did not arrive within 0.5 s" in data
        assert 0.4 < closed - start < 2.0

    def test_a_silent_connection_is_closed(self) -> None:
        with serving(small_app(), header_timeout_s=0.5) as url, socket.create_connection(("127.0.0.1", _port(url))) as sock:
            start = time.monotonic()
            data, closed = read_until_closed(sock, 10)
        assert data.startswith(b"HTTP/1.1 408 ") and closed - start < 2.0

    @pytest.mark.parametrize("path", ["/raw", "/ping"], ids=["app-reads-body", "app-ignores-body"])
    def test_a_trickling_body_is_cut_off(self, path: str) -> None:
        method = b"POST" if path == "/raw" else b"GET"
        with serving(small_app(), body_timeout_s=0.5) as url:
            with socket.create_connection(("127.0.0.1", _port(url))) as sock:
                sock.sendall(method + b" " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
                start = time.monotonic()
                sock.settimeout(0.1)
                data, closed = b"", None
                while closed is None and time.monotonic() - start < 10:
                    with contextlib.suppress(OSError):
                        sock.sendall(b"x")  # one byte every 0.1 s: never done in time
                    try:
                        chunk = sock.recv(65536)
                    except TimeoutError:
                        continue
                    except ConnectionResetError:
                        chunk = b""
                    data += chunk
                    closed = time.monotonic() if not chunk else None
            assert httpx.get(f"{url}/ping").status_code == 200
        assert closed is not None and closed - start < 2.0, data
        if path == "/raw":  # the app was still waiting for the body: 408, and nothing from the app
            assert data.startswith(b"HTTP/1.1 408 ") and data.count(b"HTTP/1.1") == 1, data
        else:  # the app answered at once; the rest of the body still had to arrive in time
            assert data.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 408" not in data, data

    def test_kept_alive_connections_get_a_deadline_per_request(self) -> None:
        with serving(small_app(), header_timeout_s=0.5) as url, socket.create_connection(("127.0.0.1", _port(url))) as sock:
            for _ in range(3):  # each request well inside its own deadline, 1.2 s in all
                time.sleep(0.4)
                sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
                assert read_response(sock).startswith(b"HTTP/1.1 200 ")
            sock.sendall(b"GET /ping HTTP/1.1\r\nHo")
            start = time.monotonic()
            data, closed = read_until_closed(sock, 10)
        assert data.startswith(b"HTTP/1.1 408 ") and closed - start < 2.0

    def test_timeouts_must_be_positive(self) -> None:
        with pytest.raises(ValueError, match="must be > 0"):
            read_deadlines(0, 1)


# ------------------------------------------------------------------ the CLI's flags


class TestFlags:
    def parse(self, *argv: str) -> argparse.Namespace:
        return cli._build_parser().parse_args(list(argv))

    def test_defaults_agree_with_the_server(self) -> None:
        args = self.parse("coordinator", "t.yaml")
        assert (args.header_timeout_s, args.body_timeout_s) == (HEADER_TIMEOUT_S, BODY_TIMEOUT_S)

    def test_coordinator_binds_loopback_unless_told(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv("OMNI_MESH_HOST", raising=False)
        assert self.parse("coordinator", "t.yaml").host == "127.0.0.1"
        monkeypatch.setenv("OMNI_MESH_HOST", "0.0.0.0")
        assert self.parse("coordinator", "t.yaml").host == "0.0.0.0"

    def test_api_key_from_flag_or_environment(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("OMNI_MESH_API_KEY", "from-env")
        assert cli._rest_settings(self.parse("up", "t.yaml"))["api_key"] == "from-env"
        assert cli._rest_settings(self.parse("up", "t.yaml", "--api-key", "flag"))["api_key"] == "flag"
        assert cli._rest_settings(self.parse("up", "t.yaml", "--api-key", ""))["api_key"] is None
        monkeypatch.delenv("OMNI_MESH_API_KEY")
        assert cli._rest_settings(self.parse("coordinator", "t.yaml"))["api_key"] is None

    def test_help_shows_defaults_but_never_the_key(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
    ) -> None:
        monkeypatch.setenv("OMNI_MESH_API_KEY", "do-not-print-me")
        for command in ("coordinator", "up"):
            with pytest.raises(SystemExit):
                self.parse(command, "--help")
            out = capsys.readouterr().out
            assert "do-not-print-me" not in out
            assert "(default: 5.0)" in out and "(default: 10.0)" in out and "$OMNI_MESH_API_KEY" in out

    @pytest.mark.parametrize(
        ("argv", "fragment"),
        [
            (["--ssl-certfile", __file__], "needs both --ssl-certfile and --ssl-keyfile"),
            (["--ssl-certfile", __file__, "--ssl-keyfile", "/nonexistent.pem"], "--ssl-keyfile /nonexistent.pem"),
            (["--header-timeout-s", "0"], "--header-timeout-s must be > 0"),
            (["--body-timeout-s", "-1"], "--body-timeout-s must be > 0"),
        ],
    )
    def test_bad_rest_flags_say_what_to_fix(self, argv: list[str], fragment: str) -> None:
        with pytest.raises(cli.CliError) as info:
            cli._rest_settings(self.parse("coordinator", "t.yaml", *argv))
        assert fragment in str(info.value)


# ================================================================== a plain mesh


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(
        tmp_path_factory.mktemp("front"),
        front_topology(max_inflight=1, max_queued=2),
        "--header-timeout-s", str(READ_TIMEOUT_S), "--body-timeout-s", str(READ_TIMEOUT_S),
        sig=signal.SIGINT,
    ) as mesh:
        yield mesh


def post_raw(mesh: Mesh, raw: bytes) -> httpx.Response:
    return mesh.client.post("/v1/requests", content=raw, headers={"content-type": "application/json"})


BAD_BODIES = [
    (b'{"inputs": {"n": 4, "p": "\\ud800"}}', "inputs.p"),
    (b'{"inputs": {"n": 4, "big": 18446744073709551616}}', "inputs.big"),
    (b'{"inputs": {"n": 4, "small": -9223372036854775809}}', "inputs.small"),
    (b'{"inputs": {"n": 4}, "params": {"a": [0, 1, 2, {"b": 18446744073709551616}]}}', "params.a[3].b"),
    (b'{"inputs": {"n": 4}, "timeout_s": NaN}', "timeout_s"),
    (b'{"inputs": {"n": 4}, "timeout_s": Infinity}', "timeout_s"),
    (b'{"inputs": {"n": 4}, "timeout_s": -Infinity}', "timeout_s"),
    (b'{"inputs": {"n": 4}, "timeout_s": -1}', "timeout_s"),
    (b'{"inputs": {"n": 4}, "timeout_s": 0}', "timeout_s"),
    (b'{"inputs": {"n": 4}, "timeout_s": true}', "timeout_s"),
    (b'{"inputs": {"n": 4}, "timeout_s": "5"}', "timeout_s"),
    (b'{"inputs": {"n": 4}, "timeout_s": 1e9}', "timeout_s"),
]


class TestBadInput:
    @pytest.mark.parametrize(("raw", "field"), BAD_BODIES, ids=[field for _, field in BAD_BODIES])
    def test_is_422_naming_the_field_and_leaks_no_slot(self, front: Mesh, raw: bytes, field: str) -> None:
        # Stage a has one slot (1 replica x max_inflight 1): a bad request that took it, or a queue
        # place, would show in the good requests after, which must all pass one after another.
        for _ in range(2 + 1):
            body = assert_envelope(post_raw(front, raw), 422, field=field, stage=None, request_id=None)
            assert body["error"].startswith(f"{field}: "), body
        for n in (1, 5):
            assert front.ok({"n": n}, timeout_s=10)["outputs"] == expected(n)

    def test_params_over_the_limit_are_413_naming_params(self, front: Mesh) -> None:
        body = assert_envelope(front.request({"n": 2}, params={"blob": "p" * (300 * 1024)}), 413, field="params")
        assert "exceed 262144" in body["error"] and "put large data in inputs" in body["error"], body

    def test_nothing_is_held_after_a_burst_of_bad_requests(self, front: Mesh) -> None:
        raws = [raw for raw, _ in BAD_BODIES] * 4
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(lambda raw: post_raw(front, raw).status_code, raws))
        assert statuses == [422] * len(raws)
        with ThreadPoolExecutor(3) as pool:
            outputs = list(pool.map(lambda n: front.ok({"n": n}, timeout_s=20)["outputs"], [3, 4, 5]))
        assert outputs == [expected(3), expected(4), expected(5)]
        stages = front.client.get("/v1/stages").json()["stages"]
        assert [(s["queued"], [r["inflight"] for r in s["replicas"]]) for s in stages] == [(0, [0]), (0, [0])]

    def test_every_error_status_is_documented_with_the_envelope(self, front: Mesh) -> None:
        doc = front.client.get("/openapi.json").json()
        model = {"$ref": "#/components/schemas/ErrorBody"}
        submit = doc["paths"]["/v1/requests"]["post"]["responses"]
        for status in ("401", "413", "422", "429", "500", "502", "504"):
            assert submit[status]["content"]["application/json"]["schema"] == model, status
        ready = doc["paths"]["/ready"]["get"]["responses"]
        assert ready["503"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ReadyBody"}
        assert set(doc["components"]["schemas"]["ReadyBody"]["properties"]) >= {"error", "stage", "request_id"}
        assert "HTTPValidationError" not in doc["components"]["schemas"]

    def test_other_errors_use_the_envelope_too(self, front: Mesh) -> None:
        assert_envelope(front.client.get("/v1/nowhere"), 404)
        assert_envelope(front.client.put("/v1/requests"), 405)
        failed = front.request({"n": 2}, params={"fail": "a"})
        assert_envelope(failed, 500, stage="a")
        assert failed.json()["request_id"]


class TestFullQueue:
    def test_the_surplus_gets_429_at_once_and_the_admitted_succeed(self, front: Mesh) -> None:
        # Stage a: one slot, two queue places. Eight at once: one runs, two wait, five are refused.
        barrier = threading.Barrier(8)

        def one(n: int) -> tuple[httpx.Response, float]:
            barrier.wait()
            start = time.monotonic()
            response = front.request({"n": n}, params={"sleep": {"a": 1.5}}, timeout_s=30)
            return response, time.monotonic() - start

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(1, 9)))
        admitted = [(r, t) for r, t in results if r.status_code == 200]
        refused = [(r, t) for r, t in results if r.status_code == 429]
        assert (len(admitted), len(refused)) == (3, 5), [(r.status_code, r.text[:200]) for r, _ in results]
        for response, took in refused:
            assert_envelope(response, 429, stage="a", request_id=None, field=None)
            assert "max_queued" in response.json()["error"]
            assert int(response.headers["retry-after"]) >= 1
            assert took < 1.0, took  # refused at once, not after a wait
        for response, _ in admitted:
            n = response.json()["outputs"]["n"]
            assert response.json()["outputs"] == expected(n)
        assert front.ok({"n": 2}, timeout_s=10)["outputs"] == expected(2)  # and the queue is free again


class TestHeadLimits:
    """A request's URL is capped at 8 KiB (414) and its head at 64 KiB (431), in the protocol layer:
    a client sending megabytes of headers is cut off at the limit, and others are served meanwhile."""

    @staticmethod
    def send(mesh: Mesh, raw: bytes) -> tuple[bytes, float]:
        with socket.create_connection(("127.0.0.1", _port(mesh.url)), timeout=10) as sock:
            started = time.monotonic()
            sock.sendall(raw)
            data, closed = read_until_closed(sock, 10)
        return data, closed - started

    def test_a_long_url_is_414(self, front: Mesh) -> None:
        data, took = self.send(front, b"GET /v1/stages?q=" + b"a" * (MAX_URL_BYTES + 1) + b" HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        assert data.startswith(b"HTTP/1.1 414 ") and b"URL exceeds 8192 bytes" in data, data[:300]
        assert took < 1.0, took

    def test_large_headers_are_431(self, front: Mesh) -> None:
        big = b"x-big: " + b"a" * (MAX_HEAD_BYTES + 1024) + b"\r\n"
        data, took = self.send(front, b"GET /v1/stages HTTP/1.1\r\nhost: 127.0.0.1\r\n" + big + b"\r\n")
        assert data.startswith(b"HTTP/1.1 431 ") and b"headers exceed 65536 bytes" in data, data[:300]
        assert took < 1.0, took
        many = b"".join(b"x-h%d: %s\r\n" % (i, b"b" * 1000) for i in range(70))  # 70 headers of 1 KB
        data, _ = self.send(front, b"GET /v1/stages HTTP/1.1\r\nhost: 127.0.0.1\r\n" + many + b"\r\n")
        assert data.startswith(b"HTTP/1.1 431 "), data[:300]

    def test_heads_under_the_limit_are_served_on_a_kept_alive_connection(self, front: Mesh) -> None:
        head = b"GET /v1/stages HTTP/1.1\r\nhost: 127.0.0.1\r\nx-big: " + b"c" * 40_000 + b"\r\n\r\n"
        with socket.create_connection(("127.0.0.1", _port(front.url)), timeout=10) as sock:
            for _ in range(5):  # 200 KB of heads in all: each is counted on its own
                sock.sendall(head)
                assert read_response(sock).startswith(b"HTTP/1.1 200 ")

    def test_a_kept_alive_connection_serves_again_after_a_7_s_pause(self, front: Mesh) -> None:
        """The coordinator keeps an idle connection longer than clients do (KEEP_ALIVE_S): a client
        that pauses 7 s between two requests finds it open (uvicorn's 5 s closed it under the client,
        a reset when the close and the next request cross)."""
        head = b"GET /v1/stages HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
        with socket.create_connection(("127.0.0.1", _port(front.url)), timeout=10) as sock:
            sock.sendall(head)
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
            time.sleep(7.0)
            sock.sendall(head)
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")

    def test_clients_sending_megabytes_of_headers_are_cut_off_and_others_served(self, front: Mesh) -> None:
        def flood() -> tuple[float, bytes]:
            """Send up to 50 MB of one header; (seconds until the server closed, what it answered)."""
            with socket.create_connection(("127.0.0.1", _port(front.url)), timeout=10) as sock:
                started = time.monotonic()
                sock.sendall(b"GET /v1/stages HTTP/1.1\r\nhost: 127.0.0.1\r\nx-big: ")
                block = b"a" * 65536
                try:
                    for _ in range(50 * 1024 * 1024 // len(block)):
                        sock.sendall(block)
                except OSError:  # the server closed the connection
                    pass
                data, closed = read_until_closed(sock, 10)
                return closed - started, data

        with ThreadPoolExecutor(4) as pool:
            floods = [pool.submit(flood) for _ in range(4)]
            slowest = 0.0
            while not all(f.done() for f in floods):
                started = time.monotonic()
                assert front.client.get("/v1/stages", timeout=10).status_code == 200
                slowest = max(slowest, time.monotonic() - started)
            results = [f.result() for f in floods]
        for took, data in results:
            assert took < 1.0, results  # cut off at the limit, not at the header deadline (2 s here)
            assert data == b"" or data.startswith(b"HTTP/1.1 431 "), data[:200]  # a reset may lose the answer
        assert slowest < 0.5, slowest


class TestLoopbackHost:
    """The coordinator listens on 127.0.0.1 here: a request whose Host is another name (a DNS
    rebinding page's) gets 421, one for a loopback name is served."""

    @pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1.evil.example", "10.0.0.1",
                                      "localhost.evil.example:{port}", "[::2]:{port}"])
    def test_another_name_is_421(self, front: Mesh, host: str) -> None:
        headers = {"host": host.format(port=_port(front.url))}
        for method, path in (("GET", "/v1/stages"), ("POST", "/v1/requests"), ("GET", "/dashboard")):
            response = httpx.request(method, f"{front.url}{path}", headers=headers, json={"inputs": {"n": 2}})
            body = assert_envelope(response, 421)
            assert "DNS rebinding" in body["error"] and headers["host"][:30] in body["error"], body

    @pytest.mark.parametrize("host", ["localhost", "LOCALHOST:{port}", "127.0.0.1", "127.0.0.1:{port}", "[::1]",
                                      "[::1]:{port}"])
    def test_a_loopback_name_is_served(self, front: Mesh, host: str) -> None:
        response = httpx.get(f"{front.url}/v1/stages", headers={"host": host.format(port=_port(front.url))})
        assert response.status_code == 200, response.text

    @pytest.mark.parametrize(("listen", "guarded"), [("127.0.0.1", True), ("127.8.9.10", True), ("::1", True),
                                                     ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                                     ("::", False), ("10.1.2.3", False), ("mesh.internal", False)])
    def test_only_a_loopback_listener_is_guarded(self, listen: str, guarded: bool) -> None:
        assert is_loopback(listen) is guarded


class TestSlowClients:
    PARTIAL = 500  # send half a header, then nothing
    TRICKLING = 100  # send the headers, then a body byte now and then

    def test_600_slow_clients_are_closed_and_others_served_meanwhile(self, front: Mesh) -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < 4096:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
        port = _port(front.url)
        stop = threading.Event()
        served: list[int] = []
        failures: list[str] = []

        def normal_client() -> None:
            with httpx.Client(base_url=front.url, timeout=10) as client:
                while not stop.is_set():
                    try:
                        response = client.post("/v1/requests", json={"inputs": {"n": 3}, "timeout_s": 10})
                        if response.status_code == 200 and response.json()["outputs"] == expected(3):
                            served.append(1)
                        else:
                            failures.append(f"{response.status_code} {response.text[:200]}")
                    except httpx.HTTPError as exc:
                        failures.append(repr(exc))
                    time.sleep(0.05)

        slow: list[tuple[socket.socket, float]] = []
        headers = b"POST /v1/requests HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        worker = threading.Thread(target=normal_client, daemon=True)
        worker.start()
        trickler: threading.Thread | None = None
        try:
            for index in range(self.PARTIAL + self.TRICKLING):
                sock = socket.create_connection(("127.0.0.1", port))
                if index < self.PARTIAL:
                    sock.sendall(headers + b"x-slo")
                else:
                    sock.sendall(headers + b"content-length: 1000\r\n\r\n{")
                slow.append((sock, time.monotonic()))
            trickler = threading.Thread(target=self._trickle, args=([s for s, _ in slow[self.PARTIAL :]], stop))
            trickler.start()
            closed = self._wait_closed(slow, READ_TIMEOUT_S + 10)
        finally:
            stop.set()
            worker.join(15)
            if trickler is not None:
                trickler.join(15)  # before the sockets close: it must not write to a reused fd
            for sock, _ in slow:
                sock.close()
        late = [took for took in closed.values() if took > READ_TIMEOUT_S + 3]
        assert len(closed) == len(slow), f"{len(slow) - len(closed)} slow clients still open"
        assert not late, f"{len(late)} slow clients closed more than 3 s after the timeout: {max(late):.1f} s"
        assert min(closed.values()) > READ_TIMEOUT_S - 0.5  # and none before it
        assert not failures, failures[:5]
        assert len(served) >= 5, "normal requests should keep being served while the slow clients wait"

    @staticmethod
    def _trickle(socks: list[socket.socket], stop: threading.Event) -> None:
        while not stop.wait(0.3):
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.send(b" ")

    @staticmethod
    def _wait_closed(slow: list[tuple[socket.socket, float]], timeout_s: float) -> dict[int, float]:
        """{index: seconds from its start until the server closed it}; each must have answered 408."""
        selector = selectors.DefaultSelector()
        for index, (sock, _) in enumerate(slow):
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, index)
        answers: dict[int, bytes] = {}
        closed: dict[int, float] = {}
        deadline = time.monotonic() + timeout_s
        while len(closed) < len(slow) and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.5):
                index = key.data
                try:
                    chunk = key.fileobj.recv(65536)
                except BlockingIOError:
                    continue
                except ConnectionResetError:
                    chunk = b""
                if chunk:
                    answers[index] = answers.get(index, b"") + chunk
                    continue
                closed[index] = time.monotonic() - slow[index][1]
                selector.unregister(key.fileobj)
        selector.close()
        not_408 = [i for i in closed if not answers.get(i, b"").startswith(b"HTTP/1.1 408 ")]
        assert not not_408, f"{len(not_408)} closed without a 408, e.g. {answers.get(not_408[0])!r}"
        return closed


# ================================================================== API key and TLS


KEY = "front-door-test-key"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("openssl is not installed: run `make test` (it installs it) or `apt-get install openssl`")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return cert, key


def trusting(certificate: tuple[Path, Path]) -> ssl.SSLContext:
    """A client context that trusts the test certificate, and checks the host name as usual."""
    return ssl.create_default_context(cafile=str(certificate[0]))


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory, certificate: tuple[Path, Path]) -> Iterator[Mesh]:
    cert, key = certificate
    with running_mesh(
        tmp_path_factory.mktemp("guarded"),
        front_topology(),
        "--api-key", KEY, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
        headers={"authorization": f"Bearer {KEY}"},
        verify=trusting(certificate),
        scheme="https",
    ) as mesh:
        yield mesh


class TestKeyAndTls:
    @pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", f"Basic {KEY}"])
    def test_without_the_key_is_401(
        self, guarded: Mesh, certificate: tuple[Path, Path], authorization: str | None
    ) -> None:
        headers = {"authorization": authorization} if authorization else {}
        with httpx.Client(base_url=guarded.url, verify=trusting(certificate)) as client:
            for method, path in (("POST", "/v1/requests"), ("GET", "/ready"), ("GET", "/v1/stages"),
                                 ("GET", "/v1/topology")):
                body = {"inputs": {"n": 2}} if method == "POST" else None
                response = client.request(method, path, json=body, headers=headers)
                assert_envelope(response, 401, stage=None, request_id=None)
                assert response.headers["www-authenticate"] == "Bearer"
            assert client.get("/health").json() == {"status": "ok"}  # no key needed, and nothing else in it
            assert_envelope(client.get("/v1/stats", headers=headers), 401)

    def test_the_counters_are_behind_the_key(self, guarded: Mesh) -> None:
        stats = guarded.client.get("/v1/stats").json()
        assert set(stats["control"]) == {
            "malformed_messages", "refused_connections", "connections_over_cap", "forged_messages"
        }, stats
        assert stats["requests"]["inflight"] == 0 and "ingress" in stats

    def test_the_dashboard_loads_without_the_key_and_reads_with_the_one_in_its_fragment(self, guarded: Mesh) -> None:
        with httpx.Client(base_url=guarded.url, verify=False) as stranger:  # noqa: S501 (the test's own certificate)
            for path in ("/dashboard", "/dashboard.js", "/dashboard.css"):
                assert stranger.get(path).status_code == 200, path  # they hold no data
        keyed = rendered(f"{guarded.url}/dashboard#key={KEY}", "--ignore-certificate-errors")
        assert 'data-replica="a-0"' in keyed and 'data-replica="d-0"' in keyed, keyed[-2000:]
        keyless = rendered(f"{guarded.url}/dashboard", "--ignore-certificate-errors")
        assert "data-replica" not in keyless and "HTTP 401" in keyless, keyless[-2000:]
        assert '<form id="keyform">' in keyless, keyless[-2000:]  # shown: it asks for the key

    def test_the_key_works_over_https(self, guarded: Mesh) -> None:
        assert guarded.url.startswith("https://")
        assert guarded.ok({"n": 6})["outputs"] == expected(6)
        assert guarded.ready().json()["ready"] is True
        assert [s["name"] for s in guarded.client.get("/v1/topology").json()["stages"]] == ["a", "d"]

    def test_plain_http_gets_no_answer(self, guarded: Mesh) -> None:
        with pytest.raises(httpx.HTTPError):
            httpx.get(guarded.url.replace("https://", "http://") + "/health", timeout=5)

    def test_the_key_is_on_no_child_process_command_line(self, guarded: Mesh) -> None:
        children = descendants(guarded.process.pid)
        assert children
        for pid in children:
            with contextlib.suppress(OSError):
                assert KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
        # ... while the coordinator has it, from its environment.
        environments = []
        for pid in children:
            with contextlib.suppress(OSError):
                if b"coordinator" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    environments.append(Path(f"/proc/{pid}/environ").read_bytes())
        assert any(f"OMNI_MESH_API_KEY={KEY}".encode() in env for env in environments)

