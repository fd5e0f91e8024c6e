"""A KV-cache budget under a flood (`omni-mesh up`: one thinker replica of a tiny random Qwen2.5-Omni,
`max_batch: 8` and a budget of KV_TOKENS tokens, text only, one torch thread):

64 clients at once, REST and OpenAI's route: the replies that succeed are the ones generate() gives
each prompt alone; those beyond the stage's queue get 429 with Retry-After; the batch's KV cache never
held more than the budget (its own high-water mark) and the replica's peak memory (VmHWM of the replica
and of its engine core, the process that holds the model and the KV cache) stays within its memory before
the flood plus RSS_OVERHEAD; the replica and its core are the same processes afterwards (nothing was
killed), and nothing runs, waits or holds KV cache once the flood is over. The dashboard (real headless
Chromium) and `omni-mesh status` show the stage's running batch, its queue, its KV cache against the
budget and tokens/s.
"""

from __future__ import annotations

import concurrent.futures
import re
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from support.batch_requests import PROMPTS, REPLY_TOKENS, alone_texts, chat  # noqa: E402
from support.browser import rendered  # noqa: E402
from support.meshkit import OMNI_MESH, running_mesh, settled, wait_for  # noqa: E402

from omni_mesh.engines.tiny import build_tiny  # noqa: E402
from omni_mesh.procinfo import descendants  # noqa: E402

CLIENTS = 64
KV_TOKENS = 160  # the prompts here take 20-35 tokens and their replies 3-30: a few rows fit at once
MAX_TOKENS = 32  # the engine's default reply: 160 // 32 = 5 rows -> max_inflight 10 (kv_budget.rows_within_budget)
MAX_QUEUED = 6
#: What the replica's peak resident memory may grow by in the flood, beyond twice the budget's bytes
#: (a restack of the batch holds the old cache and the new one for a moment): requests' inputs and
#: outputs, torch's and the allocator's working memory for a batch of rows, 64 clients' sockets.
RSS_OVERHEAD = 96 * 2**20


def topology() -> dict:
    return {"name": "kvbudget", "stages": [{
        "stage_id": 0, "name": "thinker", "final_output": True, "max_queued": MAX_QUEUED,
        "engine": {"part": "thinker", "model": "${OMNI_MESH_MODEL}", "threads": 1, "max_batch": 8,
                   "kv_cache_tokens": KV_TOKENS, "max_tokens": MAX_TOKENS},
    }], "openai": {"model": "kv", "inputs": {"messages": "messages"},
                   "text_output": {"stage": "thinker", "field": "text"}}}


def params(i: int) -> dict:
    return {"temperature": 0, "max_tokens": REPLY_TOKENS[i % len(PROMPTS)], "seed": 1}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny("qwen2_5_omni", tmp_path_factory.mktemp("q25"))


@pytest.fixture(scope="module")
def mesh(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    with running_mesh(tmp_path_factory.mktemp("kv_mesh"), topology(),
                      env={"OMNI_MESH_MODEL": str(checkpoint)}) as running:
        yield running


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak) of a process, in KiB, from /proc/<pid>/status."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {line.split(":")[0]: int(line.split()[1]) for line in lines if line.startswith(("VmRSS", "VmHWM"))}


def with_core(pid: int) -> list[int]:
    """The replica's pid and its engine core's (omni_mesh.engines.core), its one child."""
    return [pid, *sorted(descendants(pid))]


def text_of(outputs: list[dict]) -> str:
    """The reply's text from a streaming final stage's chunks (a REST client that does not stream gets them all)."""
    return "".join(chunk.get("text") or "" for chunk in outputs)


def send(mesh: Any, i: int) -> tuple[int, str | None, str | None]:
    """Client i's request (every fourth through OpenAI's route): (status, Retry-After, reply text)."""
    k = i % len(PROMPTS)
    if i % 4 == 3:
        body = {"model": "kv", "messages": chat(PROMPTS[k])["messages"], **params(i)}
        response = mesh.client.post("/v1/chat/completions", json=body, timeout=150)
        text = response.json()["choices"][0]["message"]["content"] if response.status_code == 200 else None
    else:
        response = mesh.request(chat(PROMPTS[k]), params=params(i), timeout_s=120)
        text = text_of(response.json()["outputs"]) if response.status_code == 200 else None
    if response.status_code == 429:
        assert ("queue_full" in response.text) if i % 4 == 3 else ("max_queued" in response.text), response.text
    return response.status_code, response.headers.get("retry-after"), text


def test_a_flood_of_64_clients_queues_within_the_kv_budget_then_gets_429(mesh: Any, checkpoint: Path) -> None:
    texts = alone_texts(checkpoint, [params(i) for i in range(len(PROMPTS))])
    replica = mesh.replica("thinker")
    assert replica is not None
    pid = replica["pid"]
    assert replica["max_inflight"] == 2 * (KV_TOKENS // MAX_TOKENS)  # it follows from the budget
    for i in range(len(PROMPTS)):  # warm: torch's first passes allocate what every later one reuses
        assert text_of(mesh.ok(chat(PROMPTS[i]), params=params(i), timeout_s=60)["outputs"]) == texts[i]
    pids = with_core(pid)
    assert len(pids) == 2, f"the replica {pid} has no engine core, or more than one: {pids}"
    for each in pids:
        Path(f"/proc/{each}/clear_refs").write_text("5")  # VmHWM from now on: the flood's peak, not the load's
    before = sum(memory_kib(each)["VmRSS"] for each in pids) * 1024

    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(lambda i: send(mesh, i), range(CLIENTS)))

    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    served = [i for i, (status, _, _) in enumerate(results) if status == 200]
    refused = [i for i, (status, _, _) in enumerate(results) if status == 429]
    assert len(served) >= replica["max_inflight"] + MAX_QUEUED, statuses  # the first ones all got a place
    assert refused and any(i % 4 == 3 for i in refused) and any(i % 4 != 3 for i in refused), statuses
    assert all(results[i][1] is not None and int(results[i][1]) >= 1 for i in refused)
    assert [results[i][2] for i in served] == [texts[i % len(PROMPTS)] for i in served]

    counters = settled(lambda: mesh.replica("thinker")["counters"], 20, "the thinker's counters")
    assert counters["kv_cache_budget_tokens"] == KV_TOKENS
    assert 0 < counters["kv_cache_peak_used_tokens"] <= KV_TOKENS, counters
    assert (counters["batch_running"], counters["batch_queued"], counters["kv_cache_used_tokens"],
            counters["kv_cache_reserved_tokens"]) == (0, 0, 0, 0), counters
    peak = sum(memory_kib(each)["VmHWM"] for each in pids) * 1024
    bound = before + 2 * counters["kv_cache_budget_bytes"] + RSS_OVERHEAD
    assert peak <= bound, f"the replica's and its core's peak memory {peak / 2**20:.0f} MiB > {bound / 2**20:.0f} MiB"
    after = mesh.replica("thinker")
    assert (after["pid"], after["restarts"], after["inflight"]) == (pid, 0, 0), after
    assert with_core(pid) == pids  # the same core: nothing was killed
    stats = mesh.client.get("/v1/stats", timeout=10).json()["stages"]["thinker"]
    assert (stats["inflight"], stats["queued"]) == (0, 0), stats
    print(f"served {len(served)}, refused {len(refused)}, peak KV {counters['kv_cache_peak_used_tokens']} tokens, "
          f"RSS {before / 2**20:.0f} MiB before, peak {peak / 2**20:.0f} MiB")


def test_kv_gauges_in_metrics_and_a_request_larger_than_the_budget_is_a_4xx(mesh: Any) -> None:
    def scraped() -> str | None:  # the replica's gauges come with its heartbeats
        text = mesh.client.get("/metrics", timeout=10).text
        return text if "kv_cache_budget_tokens" in text else None

    metrics = wait_for(scraped, 20, "the thinker's KV gauges in /metrics")
    for name in ("kv_cache_used_tokens", "kv_cache_used_bytes", "kv_cache_budget_tokens", "kv_cache_budget_bytes",
                 "generated_tokens_per_second", "batch_running", "batch_queued"):
        assert f'omni_mesh_handler_{name}{{replica="' in metrics or f'omni_mesh_handler_{name}{{stage="' in metrics, name
    response = mesh.request(chat(PROMPTS[0]), params={"max_tokens": KV_TOKENS}, timeout_s=30)
    assert response.status_code == 422, response.text
    assert "KV cache" in response.text and "thinker" in response.text and str(KV_TOKENS) in response.text
    wait_for(lambda: mesh.replica("thinker")["inflight"] == 0, 10, "the refused request to leave")


def test_the_dashboard_and_status_show_the_batch_its_queue_kv_use_and_tokens_per_second(mesh: Any) -> None:
    def figures() -> dict | None:  # the replica's counters come with its heartbeats
        engine = mesh.client.get("/v1/stats", timeout=10).json()["stages"]["thinker"]["engine"]
        return engine if "batch_max" in engine else None

    figures = wait_for(figures, 20, "the thinker's figures in /v1/stats")
    assert (figures["batch_max"], figures["kv_cache_budget_tokens"]) == (8, KV_TOKENS), figures
    row = re.compile(r'<tr data-stage="thinker">.*?<td>(\d+) / 8</td><td>(\d+)</td>'
                     rf"<td>(\d+) / {KV_TOKENS} tok \((\d+)%\)</td><td>([\d.]+)</td></tr>")
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            mesh.request(chat(PROMPTS[3]), params=params(3), timeout_s=60)

    workers = [threading.Thread(target=load) for _ in range(3)]
    for worker in workers:
        worker.start()
    try:
        def busy() -> re.Match | None:  # a render while the thinker generates: its tokens/s above 0
            match = row.search(rendered(f"{mesh.url}/dashboard"))
            assert match is not None, "the thinker's row lacks the batch, KV and tokens/s cells"
            return match if float(match.group(5)) > 0 else None

        match = wait_for(busy, 60, "the dashboard to show the thinker generating")
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    running, queued, used, percent = (int(match.group(i)) for i in range(1, 5))
    # the page rounds as JavaScript's Math.round does: halves up (Python's round() takes them to even)
    assert running <= 8 and used <= KV_TOKENS and percent == int(100 * used / KV_TOKENS + 0.5), match.group(0)
    status = subprocess.run([str(OMNI_MESH), "status", mesh.url], capture_output=True, text=True, timeout=30)
    assert status.returncode == 0, status.stderr
    assert re.search(rf"^thinker +batch \d+/8, \d+ waiting to join, KV cache \d+ of {KV_TOKENS} tokens, "
                     r"[\d.]+ tokens/s$", status.stdout, re.M), status.stdout
