"""Reading what a mesh answers: server-sent events as they arrive, and WAV or float audio as 16-bit
samples (what a client hears)."""

from __future__ import annotations

import base64
import io
import json
import wave
from collections.abc import Iterator
from typing import Any

import numpy as np


def sse_events(response: Any) -> Iterator[tuple[str, dict]]:
    """(event, data) of a streaming httpx response, each as it arrives."""
    kind = "message"
    for line in response.iter_lines():
        if line.startswith("event:"):
            kind = line.split(":", 1)[1].strip()
        elif line.startswith("data:"):
            yield kind, json.loads(line.split(":", 1)[1])
            kind = "message"


def streamed_outputs(client: Any, body: dict, timeout_s: float = 90) -> list[dict]:
    """The `output` of each event of a streamed POST /v1/requests, up to `done`; an error event fails."""
    outputs = []
    with client.stream("POST", "/v1/requests", json={**body, "stream": True}, timeout=timeout_s) as response:
        assert response.status_code == 200, response.read()
        for kind, event in sse_events(response):
            assert kind != "error", event
            if kind == "done":
                break
            outputs.append(event["output"])
    return outputs


def wav_samples(b64: str) -> np.ndarray:
    """The 16-bit samples of a base64 24 kHz mono WAV (int32, so differences do not wrap)."""
    with wave.open(io.BytesIO(base64.b64decode(b64))) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (24000, 1, 2)
        return np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2").astype(np.int32)


def pcm_samples(samples: np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1] as the 16-bit values a stage's WAV holds (int32)."""
    return np.round(np.clip(samples, -1, 1) * 32767).astype(np.int32)
