"""What a user sees of a running mesh: request ids in every log line, `/metrics` scraped by a real
Prometheus server, `/dashboard` rendered by real headless Chromium, `omni-mesh status`.

Prometheus and Chromium are Debian's packages (`make test` installs them); a missing one fails here
with the command that installs it, rather than skipping.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.browser import rendered, tool
from support.meshkit import OMNI_MESH, Mesh, running_mesh, wait_for

from omni_mesh.ports import free_port


def _stage(stage_id: int, name: str, **more: object) -> dict:
    return {"stage_id": stage_id, "name": name, "handler": "mesh_handlers:step", **more}


GRAFANA = Path(__file__).resolve().parents[1] / "compose" / "observability" / "grafana-dashboard.json"
TOPOLOGY = {
    "name": "observed",
    "stages": [_stage(0, "a", replicas=2), _stage(1, "d", engine_input_source=[0], final_output=True)],
}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("observed"), TOPOLOGY, "--log-level", "debug") as mesh:
        yield mesh


def test_a_clients_request_id_is_echoed_and_follows_the_request_into_every_stage(mesh: Mesh) -> None:
    response = mesh.client.post("/v1/requests", json={"inputs": {"n": 10}}, headers={"X-Request-Id": "abc-123"})
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == "abc-123" and response.json()["request_id"] == "abc-123"
    generated = mesh.client.get("/health").headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)

    def lines() -> list[str]:
        return [line for line in mesh.log().splitlines() if "request_id=abc-123" in line]

    wait_for(lambda: len(lines()) >= 3, 5, "the log lines of request abc-123")
    services = {line.split()[2] for line in lines()}
    assert "coordinator" in services, lines()
    assert any(s.startswith("a-") for s in services) and "d-0" in services, services
    access = [line for line in lines() if "POST /v1/requests 200" in line]
    assert access, lines()


def test_a_failed_request_is_logged_naming_the_stage(mesh: Mesh) -> None:
    response = mesh.client.post(
        "/v1/requests", json={"inputs": {"n": 3}, "params": {"fail": "d"}}, headers={"X-Request-Id": "boom-1"}
    )
    assert response.status_code == 500
    wait_for(lambda: "request boom-1 failed with 500 at stage 'd'" in mesh.log(), 5, "the failure's log line")


def test_prometheus_scrapes_the_request_counter_and_histogram(mesh: Mesh, tmp_path: Path) -> None:
    prometheus = tool("prometheus")
    port = free_port()
    target = mesh.url.removeprefix("http://")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs: [{{job_name: omni-mesh, static_configs: [{{targets: ['{target}']}}]}}]\n"
    )
    server = subprocess.Popen(
        [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5)

    def query(expression: str) -> float | None:
        # Until its storage is ready, Prometheus answers 503 with a plain-text body: not an answer yet.
        with contextlib.suppress(httpx.HTTPError):
            response = api.get("/api/v1/query", params={"query": expression})
            if response.status_code != 200:
                return None
            result = response.json()["data"]["result"]
            return float(result[0]["value"][1]) if result else 0.0
        return None

    counter = 'sum(omni_mesh_http_requests_total{route="/v1/requests",status="200"})'
    histogram = 'sum(omni_mesh_http_request_duration_seconds_count{route="/v1/requests",status="200"})'
    try:
        wait_for(lambda: query("up") == 1.0, 30, "Prometheus to scrape the coordinator")
        before = query(counter)
        sent = 7
        for _ in range(sent):
            mesh.ok({"n": 5})
        wait_for(lambda: query(counter) == before + sent, 15, f"Prometheus to see {sent} more requests")
        assert query(histogram) == before + sent
        assert query('sum(omni_mesh_stage_replicas{stage="a",health="healthy"})') == 2.0
        assert query('sum(omni_mesh_edge_bytes_total{edge="a->d"})') > 0
        # The Grafana dashboard we ship asks only for series this coordinator exports, in valid PromQL.
        exported = mesh.client.get("/metrics").text
        for panel in json.loads(GRAFANA.read_text())["panels"]:
            for target in panel["targets"]:
                answer = api.get("/api/v1/query", params={"query": target["expr"]}).json()
                assert answer["status"] == "success", (panel["title"], answer)
                for name in re.findall(r"omni_mesh_\w+", target["expr"]):
                    assert f"\n{name}" in exported or f"\n{name}{{" in exported, (panel["title"], name)
    finally:
        api.close()
        server.terminate()
        server.wait(10)


def _families(text: str) -> dict[str, tuple[str, list[str]]]:
    """{family: (type, [sample lines])} of a Prometheus text page."""
    families: dict[str, tuple[str, list[str]]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            families[name] = (kind, [])
        elif line and not line.startswith("#"):
            name = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
            owner = max((f for f in families if name.startswith(f)), key=len)
            families[owner][1].append(line)
    return families


def test_metrics_follow_prometheus_naming_and_promtool_finds_nothing(mesh: Mesh) -> None:
    promtool = tool("promtool")
    mesh.ok({"n": 5})
    for path in ("/openapi.json", "/docs", "/redoc", "/docs-assets/swagger-ui.css", "/no-such-page"):
        mesh.client.get(path)

    def scraped() -> str:
        return mesh.client.get("/metrics").text

    def routes_of(text: str) -> list[tuple[str, str]]:
        return re.findall(r'omni_mesh_http_requests_total\{method="GET",route="([^"]*)",status="(\d+)"\}', text)

    def complete(text: str) -> bool:
        # The stages' connector counters arrive with their next heartbeat; a request is counted once its
        # middleware finishes, which may be a moment after its client has the whole answer.
        served = routes_of(text)
        return bool(re.search(r"^omni_mesh_connector_put_bytes_total\{.*\} [1-9]", text, re.M)) and all(
            (route, "200") in served for route in ("/openapi.json", "/docs", "/redoc", "/docs-assets")
        )

    last = [""]

    def ready() -> str | None:
        last[0] = scraped()
        return last[0] if complete(last[0]) else None

    try:
        text = wait_for(ready, 10, "the connectors' put bytes and every route's request in /metrics")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; routes counted: {routes_of(last[0])}") from None
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert lint.returncode == 0 and not (lint.stdout + lint.stderr).strip(), lint.stdout + lint.stderr
    assert "_created" not in text
    families = _families(text)
    for name, (kind, samples) in families.items():
        assert name.startswith("omni_mesh_"), name
        if kind == "counter":  # counters end in _total; units come before it
            assert name.endswith("_total") and all(s.startswith(f"{name}{{") or s.startswith(f"{name} ")
                                                   for s in samples), (name, samples[:3])
        assert not re.search(r'\b(counter|gauge)="', "".join(samples)), f"{name}: one metric, several things"
    # Counts and bytes are separate counters; what only grows is a counter, not a gauge.
    for name in ("omni_mesh_connector_puts_total", "omni_mesh_connector_put_bytes_total",
                 "omni_mesh_connector_stale_gets_total", "omni_mesh_edge_bytes_total",
                 "omni_mesh_edge_put_seconds_total", "omni_mesh_http_requests_total"):
        assert families[name][0] == "counter", name
    assert families["omni_mesh_connector_pool_size_bytes"][0] == "gauge"
    # One label scheme for connectors: the topology's ref everywhere, its class in _info.
    connectors = set(re.findall(r'connector="([^"]*)"', text))
    assert connectors == {"auto_shm_0_1"}, connectors
    assert 'omni_mesh_connector_info{connector="auto_shm_0_1",type="SharedMemoryConnector"} 1.0' in text
    # Every route FastAPI serves is labelled by its template; only unknown paths are `unmatched`.
    routes = routes_of(text)
    assert {status for route, status in routes if route == "unmatched"} == {"404"}, routes


def _dom(url: str) -> str:
    chromium = tool("chromium")
    result = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=3000", "--dump-dom", url],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_the_dashboard_shows_the_graph_and_live_numbers(mesh: Mesh, tmp_path: Path) -> None:
    chromium = tool("chromium")
    screenshot = tmp_path / "dashboard.png"
    subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1100,700",
         "--virtual-time-budget=3000", f"--screenshot={screenshot}", f"{mesh.url}/dashboard"],
        capture_output=True, timeout=60, check=True,
    )
    assert screenshot.stat().st_size > 10_000  # a rendered page, not a blank one
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            mesh.ok({"n": 100})

    worker = threading.Thread(target=load)
    worker.start()
    try:
        first = rendered(f"{mesh.url}/dashboard")
        time.sleep(1.0)
        second = rendered(f"{mesh.url}/dashboard")
    finally:
        stop.set()
        worker.join()
    for dom in (first, second):
        for name in ("a", "d"):
            assert f'data-stage="{name}"' in dom
        assert 'data-replica="a-0"' in dom and 'data-replica="a-1"' in dom and 'data-replica="d-0"' in dom
        assert 'data-edge="a-&gt;d"' in dom or 'data-edge="a->d"' in dom
    completed = [int(re.search(r'id="completed">(\d+)<', dom).group(1)) for dom in (first, second)]
    assert completed[1] > completed[0] > 0, completed


def test_status_prints_the_same_figures(mesh: Mesh) -> None:
    mesh.ok({"n": 5})
    result = subprocess.run([str(OMNI_MESH), "status", mesh.url], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "mesh 'observed'" in out and "a-0 (healthy)" in out and "a-1 (healthy)" in out and "d-0 (healthy)" in out
    assert re.search(r"^a->d\s+SharedMemoryConnector", out, re.M), out


def test_status_takes_host_and_port_without_a_scheme(mesh: Mesh) -> None:
    port = mesh.url.rsplit(":", 1)[1]
    for where in (f"127.0.0.1:{port}", f"localhost:{port}"):
        result = subprocess.run([str(OMNI_MESH), "status", where], capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, (where, result.stderr)
        assert "mesh 'observed'" in result.stdout and "d-0 (healthy)" in result.stdout, result.stdout
def test_every_connector_counter_is_exported_as_a_counter() -> None:
    """The names connectors count with (`Counters(...)`, their `counter_names` and `_COUNTERS` tuples)
    are all in /metrics' counter list: a new one would otherwise be exported as a gauge."""
    import ast

    from omni_mesh.coordinator.scheduling.metrics import _CONNECTOR_COUNTERS

    def strings(node: ast.AST) -> set[str]:
        return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}

    counted: set[str] = set()
    for path in (Path(__file__).resolve().parents[1] / "omni_mesh" / "connectors").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "Counters":
                counted |= strings(node)
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(getattr(t, "id", getattr(t, "attr", "")) in ("_COUNTERS", "counter_names") for t in targets):
                    counted |= strings(node.value)
    assert {"puts", "bytes_put", "zero_copy_leaves", "oneoff"} <= counted, counted  # the scan finds them
    assert counted <= set(_CONNECTOR_COUNTERS), sorted(counted - set(_CONNECTOR_COUNTERS))
