"""`omni-mesh status URL`: the dashboard's figures in the terminal (stages, replicas, edges, rates)."""

from __future__ import annotations

import os
import time
from typing import Any

import httpx


def snapshot(client: httpx.Client) -> tuple[dict[str, Any], dict[str, Any], float]:
    topology = client.get("/v1/topology")
    stats = client.get("/v1/stats")
    for response in (topology, stats):
        if response.status_code != 200:
            raise RuntimeError(f"{response.request.url}: HTTP {response.status_code}: {response.text[:200]}")
    return topology.json(), stats.json(), time.monotonic()


def _rate(now: float, before: float | None, seconds: float) -> float:
    return 0.0 if before is None or seconds <= 0 else max(0.0, (now - before) / seconds)


def _bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return ""


def render(topology: dict, stats: dict, previous: dict | None, seconds: float) -> str:
    """A plain-text table; rates come from the difference with `previous` over `seconds`."""
    old = previous or {"stages": {}, "edges": {}, "requests": {}}
    requests = stats["requests"]
    done = requests["completed"] + requests["failed"]
    done_before = (old["requests"].get("completed", 0) + old["requests"].get("failed", 0)) if previous else None
    lines = [
        f"mesh {topology['name']!r}: {_rate(done, done_before, seconds):.1f} req/s, "
        f"{requests['completed']} completed, {requests['failed']} failed, {requests['inflight']} in flight",
        "",
        f"{'stage':<16}{'healthy':>9}{'target':>8}{'in flight':>11}{'queued':>8}{'req/s':>9}{'latency':>11}{'errors':>8}"
        "  replicas",
    ]
    for stage in topology["stages"]:
        now = stats["stages"][stage["name"]]
        before = old["stages"].get(stage["name"], {})
        healthy = sum(r["health"] == "healthy" for r in now["replicas"])
        count = now["service_count"] - before.get("service_count", 0)
        latency = (now["service_seconds"] - before.get("service_seconds", 0)) / count if count > 0 else now["mean_service_s"]
        replicas = ", ".join(f"{r['id']} ({r['health']})" for r in now["replicas"]) or "none"
        health = f"{healthy}/{len(now['replicas'])}"
        shown = "-" if latency is None else f"{latency * 1000:.1f} ms"
        # The autoscaler's target (the starting count for a stage without autoscale:).
        target = f"{now.get('target_replicas', '-')}{'*' if stage.get('autoscale') else ''}"
        lines.append(
            f"{stage['name']:<16}{health:>9}{target:>8}{now['inflight']:>11}{now['queued']:>8}"
            f"{_rate(now['processed'], before.get('processed'), seconds):>9.1f}{shown:>11}{now['errors']:>8}  {replicas}"
        )
    lines += _engine_lines(topology, stats)
    if any(stage.get("autoscale") for stage in topology["stages"]):
        lines.append("(* autoscaled: the coordinator's target; `omni-mesh up` starts or drains replicas to it)")
    lines += ["", f"{'edge':<28}{'connector':<34}{'bytes/s':>14}{'total':>14}"]
    names = {s["id"]: s["name"] for s in topology["stages"]}
    for edge in topology["edges"]:
        label = f"{names[edge['from']]}->{names[edge['to']]}"
        now_bytes = stats["edges"].get(label, {}).get("bytes", 0)
        before_bytes = old["edges"].get(label, {}).get("bytes") if previous else None
        lines.append(
            f"{label:<28}{edge['connector_name']:<34}{_bytes(_rate(now_bytes, before_bytes, seconds)) + '/s':>14}"
            f"{_bytes(now_bytes):>14}"
        )
    return "\n".join(lines)


def _engine_lines(topology: dict, stats: dict) -> list[str]:
    """Per model stage: its running batch, the requests waiting to join it, its KV cache against the
    budget and tokens (codes) per second (`engine` in /v1/stats; none for a stage of handlers)."""
    lines = []
    for stage in topology["stages"]:
        f = stats["stages"][stage["name"]].get("engine") or {}
        if not f:
            continue
        parts = []
        if "batch_running" in f:
            parts.append(f"batch {f['batch_running']:.0f}/{f['batch_max']:.0f}, {f['batch_queued']:.0f} waiting to join")
        if "kv_cache_used_tokens" in f:
            budget = f" of {f['kv_cache_budget_tokens']:.0f}" if "kv_cache_budget_tokens" in f else ""
            parts.append(f"KV cache {f['kv_cache_used_tokens']:.0f}{budget} tokens")
        for unit in ("tokens", "codes"):
            if f"generated_{unit}_per_second" in f:
                parts.append(f"{f[f'generated_{unit}_per_second']:.1f} {unit}/s")
        lines.append(f"{stage['name']:<16}{', '.join(parts)}")
    return ["", "engines:", *lines] if lines else []


def run(url: str, *, api_key: str | None, watch: bool, interval_s: float = 1.0) -> None:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=5.0) as client:
        _, previous, then = snapshot(client)
        while True:
            time.sleep(interval_s)
            topology, stats, now = snapshot(client)
            text = render(topology, stats, previous, now - then)
            if watch and os.isatty(1):
                print("\033[2J\033[H", end="")
            print(text, flush=True)
            if not watch:
                return
            previous, then = stats, now
