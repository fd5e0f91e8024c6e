"""The figures of `omni-mesh bench connector`: one size's medians and ratios, and the printed table."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Any


@dataclass
class SizeResult:
    size: int
    repeats: int
    put_get_s: float
    put_s: float
    get_s: float
    e2e_s: float
    gbps: float
    memcpy_gbps: float
    ratio_memcpy: float
    raw_gbps: float | None = None
    ratio_raw: float | None = None
    put_ratio_memcpy: float | None = None  # median put time / median memcpy time
    pool_grown: int = 0  # segments the producer's pool grew by during this size
    fallbacks: int = 0  # one-off buffers taken during this size
    fallbacks_after_first: int = 0  # ... after the first put of this size
    encryption: str | None = None  # what sealed the payload bytes (ZmqConnector's health), if reported


def summarize(
    size: int,
    put_s: list[float],
    get_s: list[float],
    e2e_s: list[float],
    raw_s: list[float] | None,
    memcpy_s: list[float],
) -> SizeResult:
    put_get = statistics.median([p + g for p, g in zip(put_s, get_s, strict=True)])
    memcpy = statistics.median(memcpy_s)
    result = SizeResult(
        put_ratio_memcpy=statistics.median(put_s) / memcpy,
        size=size,
        repeats=len(put_s),
        put_get_s=put_get,
        put_s=statistics.median(put_s),
        get_s=statistics.median(get_s),
        e2e_s=statistics.median(e2e_s),
        gbps=size / put_get / 1e9,
        memcpy_gbps=size / memcpy / 1e9,
        ratio_memcpy=memcpy / put_get,
    )
    if raw_s:
        raw = statistics.median(raw_s)
        result.raw_gbps = size / raw / 1e9
        result.ratio_raw = raw / put_get
    return result


def _fmt_size(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def _fmt_time(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def report(result: dict[str, Any]) -> str:
    lines = [
        f"connector {result['connector']}  config {json.dumps(result['config'])}  payload on {result['device']}"
        f"  mesh keys {'set (CURVE side channels)' if result.get('mesh_keys') else 'none'}"
        + "".join(sorted({f"  payload bytes sealed: {s['encryption']}" for s in result["sizes"] if s.get("encryption")})),
        "medians; put->get = producer put + consumer get; e2e adds the metadata hop between the processes"
        + ("; payloads allocated by connector.empty() (--zero-copy)" if result.get("zero_copy") else ""),
        "put/memcpy: the put alone against a memcpy of the same bytes; grown: segments the producer's pool "
        "grew by; fallbacks: one-off buffers (all / after the first put of the size)",
        f"{'size':>9} {'reps':>5} {'put->get':>10} {'GB/s':>7} {'memcpy GB/s':>12} {'x memcpy':>9} {'e2e':>10}"
        f" {'raw GB/s':>9} {'x raw':>6} {'put/memcpy':>10} {'grown':>5} {'fallbacks':>9}",
    ]
    for r in result["sizes"]:
        raw = f"{r['raw_gbps']:9.2f} {r['ratio_raw']:6.2f}" if r["raw_gbps"] else f"{'-':>9} {'-':>6}"
        fallbacks = f"{r['fallbacks']}/{r['fallbacks_after_first']}"
        lines.append(
            f"{_fmt_size(r['size']):>9} {r['repeats']:5d} {_fmt_time(r['put_get_s']):>10} {r['gbps']:7.2f}"
            f" {r['memcpy_gbps']:12.2f} {r['ratio_memcpy']:9.2f} {_fmt_time(r['e2e_s']):>10} {raw}"
            f" {r['put_ratio_memcpy']:10.3f} {r['pool_grown']:5d} {fallbacks:>9}"
        )
    lines.append(f"in-process 4 KiB put + get: {_fmt_time(result['inproc_4k_s'])} (median)")
    return "\n".join(lines)
