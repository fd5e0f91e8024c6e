"""OpenAI-compatible serving of the demo pipeline, driven by the real `openai` client.

One mesh (`omni-mesh up compose/omni-demo.yaml`, with an API key) serves every test: the demo's
topology maps chat requests onto it in its `openai:` section. Streaming tests pace the demo's talker
(`decode_delay_s`, passed as a pipeline param through `extra_body`) so that arrival times tell a
reply that streams from one that arrives in one piece.
"""

from __future__ import annotations

import base64
import io
import json
import re
import signal
import sys
import time
import wave
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import av
import numpy as np
import openai
import pytest
import torch
import yaml
from support.meshkit import Mesh, running_mesh, wait_for

from omni_mesh.coordinator.openai.audio import encode
from omni_mesh.coordinator.openai.reply import Reply, ReplyError
from omni_mesh.coordinator.openai.request import ChatRequest, ChatRequestError, chat_call
from omni_mesh.topology.openai_spec import AudioRef, OpenAISpec, OutputRef
from services.omni_demo.audio import GROUP_SAMPLES

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "compose" / "omni-demo.yaml"
MODEL = "qwen-omni-demo"
KEY = "test-openai-key"
PROMPT = "Hello, omni-mesh!"
RATE = 24_000
PACED = {"params": {"decode_delay_s": 0.01, "chunk_tokens": 4}}  # ~10 ms a token, 4 tokens a chunk


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    headers = {"authorization": f"Bearer {KEY}"}
    with running_mesh(tmp_path_factory.mktemp("openai"), DEMO, "--api-key", KEY, sig=signal.SIGINT, headers=headers) as mesh:
        yield mesh


@pytest.fixture(scope="module")
def client(demo: Mesh) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{demo.url}/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        yield client


def read_wav(data: bytes) -> tuple[tuple[int, int, int], np.ndarray]:
    """((rate, channels, sample width), samples) of a WAV file, read with the `wave` module."""
    with wave.open(io.BytesIO(data), "rb") as wav:
        shape = (wav.getframerate(), wav.getnchannels(), wav.getsampwidth())
        return shape, np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")


def audio_data(chunk: object, field: str = "data") -> str | None:
    """A streamed chunk's `delta.audio.data` (or another field of it: a model in newer clients, a
    plain dict in older ones)."""
    audio = chunk.choices[0].delta.audio if chunk.choices else None
    return audio.get(field) if isinstance(audio, dict) else getattr(audio, field, None)


def audio_chat(client: openai.OpenAI, fmt: str = "wav", **options: object) -> object:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}],
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": fmt},
        **options,
    )


def assert_progressive(audio_at: list[float], tokens: int) -> None:
    """Audio deltas that came as the talker made them (~10 ms a token, PACED), not in one burst:
    the last comes at least half the talker's time for the tokens after the first chunk later
    than the first. (Measured from the first delta: how long the request took to start varies
    with the machine's load, and says nothing about streaming.)"""
    spread = audio_at[-1] - audio_at[0]
    assert spread > 0.5 * (tokens - 4) * 0.01, f"audio deltas at {[round(t, 3) for t in audio_at]} s"


# ------------------------------------------------------------------ models


def test_models_list_the_topologys_model(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "omni-mesh"
    with pytest.raises(openai.NotFoundError, match="does not exist on this mesh; it serves 'qwen-omni-demo'"):
        client.models.retrieve("gpt-4o")


def test_the_routes_need_the_api_key(demo: Mesh) -> None:
    with openai.OpenAI(base_url=f"{demo.url}/v1", api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()
        with pytest.raises(openai.AuthenticationError):
            stranger.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])


# ------------------------------------------------------------------ one answer


def test_non_streaming_answer_has_text_and_a_wav_that_decodes(client: openai.OpenAI) -> None:
    completion = audio_chat(client)
    assert completion.object == "chat.completion" and completion.model == MODEL
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    assert choice.message.content is None  # as OpenAI answers: with audio, the text is its transcript
    audio = choice.message.audio
    text = audio.transcript
    assert text == f'You said: "{PROMPT}".'
    assert audio.id and audio.expires_at == completion.created + 3600  # an hour, as OpenAI's
    (rate, channels, width), samples = read_wav(base64.b64decode(audio.data))
    assert (rate, channels, width) == (RATE, 1, 2)
    tokens = len(text.encode())  # the demo's tokens are bytes: one tone of GROUP_SAMPLES each
    assert len(samples) == tokens * GROUP_SAMPLES
    assert np.abs(samples.astype(np.int32)).max() > 1000, "the WAV is silent"
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT.encode()), tokens)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_the_client_request_id_names_the_completion(client: openai.OpenAI) -> None:
    completion = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_headers={"x-request-id": "chat-42"}
    )
    assert completion.headers["x-request-id"] == "chat-42"
    assert completion.parse().id == "chatcmpl-chat-42"


def test_pcm16_is_the_wavs_samples_and_text_only_has_no_audio(client: openai.OpenAI) -> None:
    _, wav_samples = read_wav(base64.b64decode(audio_chat(client).choices[0].message.audio.data))
    pcm = base64.b64decode(audio_chat(client, "pcm16").choices[0].message.audio.data)
    assert np.array_equal(np.frombuffer(pcm, dtype="<i2"), wav_samples)
    text_only = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}])
    assert text_only.choices[0].message.content == f'You said: "{PROMPT}".'
    assert text_only.choices[0].message.audio is None


def test_sampling_fields_reach_the_stages(client: openai.OpenAI) -> None:
    completion = audio_chat(client, max_completion_tokens=5, temperature=0.2, top_p=0.9, seed=7, stop=["\n"])
    assert completion.choices[0].message.audio.transcript == "You s"  # the thinker read max_tokens
    assert completion.choices[0].finish_reason == "length"  # and says so, as OpenAI does
    _, samples = read_wav(base64.b64decode(completion.choices[0].message.audio.data))
    assert len(samples) == 5 * GROUP_SAMPLES


# ------------------------------------------------------------------ streaming


def test_streaming_sends_text_first_then_audio_progressively(client: openai.OpenAI) -> None:
    started = time.perf_counter()
    stream = audio_chat(client, "pcm16", stream=True, stream_options={"include_usage": True}, extra_body=PACED)
    text, text_at, audio, audio_at, finish, usage = "", [], bytearray(), [], None, None
    for chunk in stream:
        now = time.perf_counter() - started
        assert chunk.object == "chat.completion.chunk" and chunk.model == MODEL
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        assert not delta.content, delta  # with audio, the text comes as audio.transcript, as OpenAI's
        words = audio_data(chunk, "transcript")
        if words:
            text += words
            text_at.append(now)
        if expires := audio_data(chunk, "expires_at"):
            assert expires == chunk.created + 3600
        data = audio_data(chunk)
        if data:
            audio += base64.b64decode(data)
            audio_at.append(now)
    assert text == f'You said: "{PROMPT}".' and finish == "stop"
    tokens = len(text.encode())
    assert usage is not None and usage.completion_tokens == tokens
    assert len(audio) == 2 * tokens * GROUP_SAMPLES
    assert len(audio_at) == -(-tokens // 4), "one audio delta per talker chunk"
    assert text_at[0] < audio_at[0], "the text comes before the audio"
    assert_progressive(audio_at, tokens)


def test_streamed_wav_deltas_are_whole_files_of_the_same_audio(client: openai.OpenAI) -> None:
    _, whole = read_wav(base64.b64decode(audio_chat(client).choices[0].message.audio.data))
    pieces = []
    for chunk in audio_chat(client, "wav", stream=True):
        data = audio_data(chunk)
        if data:
            shape, samples = read_wav(base64.b64decode(data))
            assert shape == (RATE, 1, 2)
            pieces.append(samples)
    assert len(pieces) > 1 and np.array_equal(np.concatenate(pieces), whole)


def decoded(data: str) -> tuple[str, int, int, np.ndarray]:
    """(container, rate, channels, samples as floats in [-1, 1]) of a base64 audio file, decoded by
    FFmpeg (PyAV) with the demuxer it probes itself, as a player would."""
    with av.open(io.BytesIO(base64.b64decode(data))) as container:
        frames = list(container.decode(audio=0))
        layout = {(frame.sample_rate, frame.layout.nb_channels) for frame in frames}
        assert len(layout) == 1, layout
        samples = np.concatenate([frame.to_ndarray().reshape(-1) for frame in frames])
        if samples.dtype == np.int16:  # FLAC decodes to 16-bit integers, the lossy codecs to floats
            samples = samples / 32768.0
        return container.format.name, *layout.pop(), samples


#: format -> (the container FFmpeg finds, the rate it decodes at: Opus always plays at 48 kHz).
COMPRESSED = {"flac": ("flac", RATE), "mp3": ("mp3", RATE), "opus": ("ogg", 48_000)}


@pytest.mark.parametrize("fmt", sorted(COMPRESSED))
def test_compressed_audio_decodes_to_the_wavs_length_whole_and_streamed(client: openai.OpenAI, fmt: str) -> None:
    _, wav = read_wav(base64.b64decode(audio_chat(client).choices[0].message.audio.data))
    container, rate = COMPRESSED[fmt]
    whole = decoded(audio_chat(client, fmt).choices[0].message.audio.data)
    assert whole[:3] == (container, rate, 1)
    assert len(whole[3]) == len(wav) * rate // RATE  # encoders' priming and padding trimmed: the same duration
    assert np.abs(whole[3]).max() > 0.03, f"the {fmt} is silent"
    if fmt == "flac":  # lossless: the very samples
        assert np.array_equal(np.round(whole[3] * 32768).astype(np.int16), wav)
    pieces = [decoded(data) for chunk in audio_chat(client, fmt, stream=True) if (data := audio_data(chunk))]
    assert len(pieces) > 1 and {piece[:3] for piece in pieces} == {(container, rate, 1)}
    assert abs(sum(len(piece[3]) for piece in pieces) - len(whole[3])) <= len(pieces) * rate // 100  # each delta a whole file


def test_v1_requests_streams_the_demo_progressively(demo: Mesh) -> None:
    body = {"inputs": {"prompt": PROMPT}, "params": {"stream": True, **PACED["params"]}, "stream": True, "timeout_s": 30}
    started, arrivals = time.perf_counter(), []
    with demo.client.stream("POST", "/v1/requests", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                arrivals.append((time.perf_counter() - started, json.loads(line[len("data: ") :])))
    *chunks, (_, done) = arrivals
    outputs = [event["output"] for _, event in chunks]
    assert outputs[0]["text"] == f'You said: "{PROMPT}".' and not outputs[0]["audio_pcm16"]
    assert all(out["audio_pcm16"] and not out["text"] for out in outputs[1:])
    audio_at = [at for at, _ in chunks[1:]]
    assert chunks[0][0] < audio_at[0], "the text comes before the audio"
    assert_progressive(audio_at, len(outputs[0]["text"].encode()))
    # `done` closes the stream without repeating what the chunks carried (the audio came twice).
    assert "outputs" not in done and done["request_id"] and done["latency_s"] > 0 and "talker" in done["timings"], done


# ------------------------------------------------------------------ errors


def test_bad_requests_get_a_bad_request_error_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="audio.format: Input should be 'wav', 'pcm16', 'flac'") as bad:
        audio_chat(client, "aac")
    assert bad.value.body["param"] == "audio.format" and bad.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="no user message to reply to"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."}])
    with pytest.raises(openai.BadRequestError, match="only one choice per request"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
    with pytest.raises(openai.BadRequestError, match="unknown field") as unknown:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"promt": 1})
    assert unknown.value.body["param"] == "promt"
    with pytest.raises(openai.NotFoundError, match="the model 'gpt-4o' does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])


def test_a_param_a_stage_refuses_is_a_bad_request(client: openai.OpenAI, demo: Mesh) -> None:
    with pytest.raises(openai.BadRequestError, match="chunk_tokens"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"params": {"chunk_tokens": -1}}
        )
    response = demo.request({})  # no prompt
    assert response.status_code == 422 and "inputs.prompt" in response.json()["error"]


# ------------------------------------------------------------------ reading replies (in-process)


def spec(encoding: str = "pcm16", **audio: object) -> OpenAISpec:
    return OpenAISpec(
        model="m",
        inputs={"prompt": "last_user_message"},
        text_output=OutputRef("words", "text"),
        audio_output=AudioRef("voice", "audio", encoding, **audio),
        usage_output=OutputRef("words", "usage"),
    )


def test_reply_reads_each_final_stage_streamed_or_whole() -> None:
    reply = Reply(spec("float", sample_rate=16_000), ["words", "voice"])
    first = reply.chunk("voice", {"audio": torch.tensor([0.5, -0.5])})
    assert first is not None and np.frombuffer(first.pcm, "<i2").tolist() == [16384, -16384]
    assert reply.chunk("elsewhere", {"audio": 1}) is None  # a stage the section does not read
    words = reply.done({"words": {"text": "hi", "usage": {"prompt_tokens": 2, "completion_tokens": 3}}, "voice": []})
    assert [piece.text for piece in words] == ["hi"]
    assert reply.text == "hi" and reply.sample_rate == 16_000 and len(reply.pcm) == 4
    assert reply.usage == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


def test_reply_reads_wav_audio_with_its_own_rate() -> None:
    wav = encode(np.arange(4, dtype="<i2").tobytes(), 8_000, "wav")
    reply = Reply(spec("wav"), ["words", "voice"])
    reply.chunk("voice", {"audio": base64.b64encode(wav).decode()})
    assert reply.sample_rate == 8_000 and np.frombuffer(bytes(reply.pcm), "<i2").tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("stage", "output", "message"),
    [
        ("words", ["not", "a", "mapping"], "stage 'words' output is a list, not a mapping of fields"),
        ("words", {"text": 3}, "stage 'words' field 'text' must be a string, got int"),
        ("words", {"usage": {"prompt_tokens": -1}}, "field usage.prompt_tokens must be a count, got -1"),
        ("voice", {"audio": b"abc", "rate": 24_000}, "an odd count cannot be 16-bit samples"),
        ("voice", {"audio": "not base64!", "rate": 24_000}, "audio given as a string is not base64"),
        ("voice", {"audio": b"ab", "rate": "fast"}, "field 'rate' must be an integer (Hz), got str"),
    ],
)
def test_reply_names_the_stage_and_field_a_bad_output_breaks(stage: str, output: object, message: str) -> None:
    reply = Reply(spec(sample_rate_field="rate"), ["words", "voice"])
    with pytest.raises(ReplyError, match=re.escape(message)):
        reply.chunk(stage, output)


def test_reply_refuses_a_sample_rate_that_changes_mid_reply() -> None:
    reply = Reply(spec(sample_rate_field="rate"), ["words", "voice"])
    reply.chunk("voice", {"audio": b"ab", "rate": 24_000})
    with pytest.raises(ReplyError, match="changed its audio sample rate mid-reply"):
        reply.chunk("voice", {"audio": b"cd", "rate": 16_000})


def test_compressed_audio_without_pyav_is_refused_501_before_admission(monkeypatch: pytest.MonkeyPatch) -> None:
    def call(fmt: str) -> object:
        body = ChatRequest(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], modalities=["text", "audio"], audio={"format": fmt}
        )
        return chat_call(body, spec())

    monkeypatch.setitem(sys.modules, "av", None)  # as if PyAV were not installed: find_spec finds nothing
    with pytest.raises(ChatRequestError, match="audio format 'opus' needs PyAV") as refused:
        call("opus")
    assert (refused.value.status, refused.value.param) == (501, "audio.format")
    assert call("wav").audio_format == "wav" and call("pcm16").audio_format == "pcm16"


# ------------------------------------------------------------------ backpressure


def test_a_full_queue_is_openais_rate_limit_error_with_retry_after(tmp_path: Path) -> None:
    """The talker takes one request at a time and lets one wait: with one request in it (its stream
    under way) and one waiting, the next chat completion is refused at once with OpenAI's 429
    (`rate_limit_error`, code `queue_full`, naming the stage, with Retry-After), which the real client
    raises as RateLimitError; the two admitted ones finish, and the mesh serves again after them."""
    topology = yaml.safe_load(DEMO.read_text())
    talker = next(stage for stage in topology["stages"] if stage["name"] == "talker")
    talker.update(max_inflight=1, max_queued=1)
    slow = {"params": {"decode_delay_s": 0.05, "chunk_tokens": 4}}  # ~1 s for the prompt's tokens
    with running_mesh(tmp_path, topology) as mesh, openai.OpenAI(
        base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=60
    ) as client:
        first = audio_chat(client, "pcm16", stream=True, extra_body=slow)
        pieces = iter(first)
        next(pieces)  # its stream has begun: it holds the talker's one slot
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(audio_chat, client, "pcm16", extra_body=slow)
            stats = mesh.client.get
            wait_for(lambda: stats("/v1/stats").json()["stages"]["talker"]["queued"] == 1, 10, "one queued")
            started = time.monotonic()
            with pytest.raises(openai.RateLimitError) as refused:
                audio_chat(client, "pcm16")
            took = time.monotonic() - started
            assert took < 2.0, f"refused after {took:.1f} s, not at once"
            error = refused.value.body
            assert refused.value.status_code == 429 and refused.value.code == "queue_full", error
            assert error["type"] == "rate_limit_error" and "stage 'talker'" in error["message"], error
            assert int(refused.value.response.headers["retry-after"]) >= 1
            rest = list(pieces)
            assert rest and rest[-1].choices[0].finish_reason == "stop"
            assert waiting.result().choices[0].finish_reason == "stop"
        assert audio_chat(client, "pcm16").choices[0].finish_reason == "stop"
