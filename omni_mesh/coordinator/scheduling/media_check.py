"""Media parts checked at the front door, so a bad one is a 4xx at once, naming where it is.

Every media part of a request's messages (`inputs.messages` on `/v1/requests`, the inputs an
`openai.inputs` entry of source `messages` builds) gets omni_mesh.media's cheap checks: base64, the
sniffed format against the declared one, the header's dimensions, duration and frame count, truncation
(nothing decoded). They run in a small pool of worker threads, never on the event loop: a burst of
large media waits for the pool while other requests go on. A remote (http/https) URL is fetched here,
only from a domain the operator allows, within the size cap and timeout; its part then travels on as a
data URL, so no stage ever opens a URL. With remote media off no connection is attempted.
Parts of other types are left as they are: the entry stage says whether it can use them.
"""

from __future__ import annotations

import asyncio
import base64
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import httpx

from omni_mesh.coordinator.scheduling.failures import RequestFailed
from omni_mesh.media import MediaError, canonical, probe
from omni_mesh.media.limits import MediaLimits
from omni_mesh.media.parts import MEDIA_PARTS, checked, source

#: Threads that check media at once: decoding headers is quick, and this bounds the CPU a burst takes.
WORKERS = 2
_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="media-check")
    return _pool


async def check_media(inputs: dict[str, Any], names: dict[str, str], limits: MediaLimits) -> dict[str, Any]:
    """`inputs` with the messages under `names` (input name -> the field errors name) checked, remote
    parts fetched and inlined, or RequestFailed (422) naming the first bad part:
    `inputs.messages[1].content[0]: ...`."""
    todo = [
        (name, m_index, p_index, part)
        for name in names
        if isinstance(inputs.get(name), list)
        for m_index, message in enumerate(inputs[name])
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for p_index, part in enumerate(message["content"])
        if isinstance(part, dict) and part.get("type") in MEDIA_PARTS
    ]
    if not todo:
        return inputs
    loop = asyncio.get_running_loop()
    checks = [loop.run_in_executor(_executor(), _check_part, part, limits) for *_, part in todo]
    results = await asyncio.gather(*checks, return_exceptions=True)
    replaced: dict[tuple[str, int, int], dict[str, Any]] = {}
    for (name, m_index, p_index, _), result in zip(todo, results, strict=True):
        if isinstance(result, BaseException):
            if not isinstance(result, MediaError):  # RequestFailed (no PyAV here), or a bug: not the part's fault
                raise result
            where = f"{names[name]}[{m_index}].content[{p_index}]"
            raise RequestFailed(422, f"{where}: {result}", field=where)
        if result is not None:
            replaced[name, m_index, p_index] = result
    if not replaced:
        return inputs
    out = dict(inputs)
    for name in {key[0] for key in replaced}:
        out[name] = [dict(message) if isinstance(message, dict) else message for message in inputs[name]]
    for (name, m_index, p_index), part in replaced.items():
        message = out[name][m_index]
        message["content"] = list(message["content"])
        message["content"][p_index] = part
    return out


def _check_part(part: dict[str, Any], limits: MediaLimits) -> dict[str, Any] | None:
    """In a worker thread: None when `part` is good as it is, the part with its fetched bytes inlined
    for a remote one; MediaError when it is bad."""
    src = source(part)
    if src.url is None:
        item = canonical(part, limits)
        kind, data, fmt = item["type"], item["data"], item["format"]
    else:
        data = fetch(src.url, limits, f"{src.part_type}.url")
        kind, fmt = src.kind, checked(data, src.kind, None, f"{src.part_type}.url ({src.url})")
    try:
        probe(kind, data, fmt, limits)
    except ImportError as exc:  # PyAV or Pillow missing: the operator's to fix, not the client's
        raise RequestFailed(501, f"this coordinator cannot read media ({exc}); install omni-mesh[engines]") from None
    if src.url is None:
        return None
    url = f"data:{kind}/{fmt};base64,{base64.b64encode(data).decode()}"
    return {"type": src.part_type, src.part_type: {"url": url}}


def allowed(url: str, limits: MediaLimits) -> str | None:
    """None when `url` may be fetched, else why not (said before any connection is made)."""
    if not limits.remote:
        return (
            "remote media URLs are off on this coordinator (the operator allows domains with "
            "--allowed-media-domains); send the media inline as a data: URL"
        )
    host = (urlsplit(url).hostname or "").lower().rstrip(".")
    if not any(host == domain or host.endswith("." + domain) for domain in limits.allowed_domains):
        return f"the domain {host!r} is not one this coordinator fetches media from ({', '.join(limits.allowed_domains)})"
    return None


def fetch(url: str, limits: MediaLimits, what: str) -> bytes:
    """The body at `url` (an allowed domain; no redirects; at most max_bytes within fetch_timeout_s)."""
    refusal = allowed(url, limits)
    if refusal is not None:
        raise MediaError(f"{what}: {refusal}")
    deadline = time.monotonic() + limits.fetch_timeout_s
    try:
        client = httpx.Client(timeout=limits.fetch_timeout_s, follow_redirects=False, trust_env=False)
        with client, client.stream("GET", url) as answer:
            if answer.status_code != 200:
                raise MediaError(f"{what}: fetching {url} answered HTTP {answer.status_code}")
            body = bytearray()
            for piece in answer.iter_bytes():
                body += piece
                if len(body) > limits.max_bytes:
                    raise MediaError(f"{what}: {url} is larger than the limit of {limits.max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise MediaError(f"{what}: fetching {url} took longer than {limits.fetch_timeout_s:g} s")
            return bytes(body)
    except httpx.HTTPError as exc:
        raise MediaError(f"{what}: fetching {url} failed ({type(exc).__name__}: {exc})") from None
