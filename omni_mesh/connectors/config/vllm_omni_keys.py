"""The config keys vllm-omni's connectors read, and what omni-mesh does with each.

vllm-omni's users bring their `extra:` mappings as they are, so every key a vllm-omni connector of
the same name reads (its `__init__`, its stage-config YAMLs, the keys its orchestrator injects into
every connector's config) is accepted here under that name. A key with the meaning of one of our fields
is that field's alias, declared on the field (`vllm_omni(...)` in config/classes.py); the others:

    honoured  a meaning we have without a field of that name (the note says how), accepted silently
    no effect accepted, with one warning per key and process that names it and says it does nothing

Sources: vllm_omni/distributed/omni_connectors/connectors/*.py (Dec 2025 - Aug 2026), the chunk
adapter and stage input processors (they read the `codec_*`/`connector_get_*` keys out of the
connector's extra), the model code that reads its settings from there (`_MODEL_CODE`), and the
stage-config and deploy YAMLs. docs/connectors.md shows these tables to users.
"""

from __future__ import annotations

import difflib
import functools
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "KEYS", "VLLM_OMNI_ONLY", "VllmKey", "did_you_mean", "lookup", "no_effect_messages", "warn_no_effect"
]

log = logging.getLogger("omni_mesh.connectors")

Kind = Literal["honoured", "no effect"]


@dataclass(frozen=True)
class VllmKey:
    kind: Kind
    #: What the key means in vllm-omni and why we do what we do.
    note: str = ""
    #: Values that ask for exactly what we do anyway (no warning for these); empty: any value.
    same_as_ours: tuple[Any, ...] = ()


_honoured = functools.partial(VllmKey, "honoured")  # (note, same_as_ours=())
_no_effect = functools.partial(VllmKey, "no effect")


# Keys vllm-omni's orchestrator and chunk adapter put into every connector's extra.
_EVERY_CONNECTOR: dict[str, VllmKey] = {
    "stage_id": _honoured("injected by vllm-omni's orchestrator; the connector's `stage_id` attribute"),
    "from_stage": _no_effect("the edge, injected by vllm-omni's orchestrator; our edges come from the topology"),
    "to_stage": _no_effect("the edge, injected by vllm-omni's orchestrator; our edges come from the topology"),
    "rank_mapping": _no_effect("vllm-omni's heterogeneous-TP rank mapping for KV transfer"),
    "recv_rank_mapping": _no_effect("vllm-omni's heterogeneous-TP rank mapping for KV transfer"),
    "send_rank_mapping": _no_effect("vllm-omni's heterogeneous-TP rank mapping for KV transfer"),
    "role": _honoured(
        "sender / receiver / dual / auto (its RDMA connector's): every omni-mesh connector instance both "
        "puts and gets (vllm-omni's dual), whatever the role",
        ("sender", "receiver", "dual", "auto"),
    ),
}
# Read out of the connector's extra by vllm-omni's chunk adapter and stage input processors, not by the
# connector; omni-mesh streams chunks through its stage runtime, so they change nothing here. A
# trailing "*" matches any key with that prefix.
_CHUNK_ADAPTER: dict[str, VllmKey] = {
    name: _no_effect("read by vllm-omni's chunk transfer adapter / code2wav stage, not by the connector")
    for name in (
        "codec_chunk_frames",
        "codec_left_context_frames",
        "codec_streaming",
        "codec_chunk_ramp",
        "codec_*",
        "initial_codec_chunk_frames",
        "decode_cudagraph_capture_sizes",
        "decode_*",
        "connector_get_*",
    )
}
# Model settings vllm-omni's files put into the edge connector's extra: vllm-omni keeps the whole
# dict, and its model code and stage input processors read them from there (source in the note).
# omni-mesh's stage handlers take their settings from their own code, so they change nothing here.
_MODEL_CODE: dict[str, VllmKey] = {
    name: _no_effect(f"a model setting read by vllm-omni's {model} code, not by the connector")
    for model, names in (
        ("GLM-TTS DiT", ("crossfade_sec",)),
        (
            "Qwen3-TTS code predictor and stage input processor",
            ("code_predictor_*", "ref_code_context_frames"),
        ),
        ("Audex code2wav", ("decoder_emit_chunk_frames", "audiocodec_token_offset", "audiocodec_vocab_size")),
        ("Fish Speech decoder", ("fish_speech_*",)),
        ("Ming-TTS", ("latent_chunk_size", "initial_latent_chunk_size", "latent_left_context")),
        (
            "MiniCPM-o 4.5 token2wav",
            ("enable_hift_graph", "enable_cfm_graph", "cfm_max_graphs", "token2wav_n_timesteps"),
        ),
        ("MiniCPM-o 4.5 token2wav (NPU)", ("npu_dit_*", "npu_cfm_*", "npu_single_request_cache_passthrough")),
        ("Audio8-TTS codec decoder", ("audio8_tts_codec_dtype",)),
    )
    for name in names
}
_SENDER = {
    "sender_host": _no_effect("the producer a receiver asks when get() has no metadata; put()'s metadata names it"),
    "sender_zmq_port": _no_effect("the producer's side-channel port for a get() without metadata; see sender_host"),
}
#: connector name -> {vllm-omni key: what we do}, beyond the keys that are our own fields by name.
KEYS: dict[str, dict[str, VllmKey]] = {
    "SharedMemoryConnector": {
        "raw_tensor_shm": _no_effect(
            "vllm-omni's raw-tensor segments; our codec lays every tensor out raw already"
        ),
        "shm_event_notifications": _no_effect(
            "vllm-omni's event notification of a put; our consumers learn of a put from its metadata on the "
            "control plane"
        ),
        "shm_notification_namespace": _no_effect(
            "the namespace of vllm-omni's put notifications; see shm_event_notifications"
        ),
    },
    "MooncakeStoreConnector": {},
    "MooncakeConnector": {},
    "MooncakeTransferEngineConnector": {
        **_SENDER,
        "memory_pool_device": _no_effect(
            "our pool is host memory; CUDA tensors go GPU to GPU outside it (device_transfer)", ("cpu",)
        ),
    },
    "MoriTransferEngineConnector": _SENDER,
    "YuanrongConnector": {},
    "YuanrongTransferEngineConnector": {
        **_SENDER,
        "transfer_engine_python_path": _no_effect("where vllm-omni imports transfer_engine from; we import yr.datasystem"),
    },
    "ZmqConnector": {},  # ours: vllm-omni has no connector of this name
}


#: vllm-omni's connectors omni-mesh has none of: a file whose edges use one still validates (the graph
#: is checked, with a warning saying what to use instead), but no stage can create it.
VLLM_OMNI_ONLY: dict[str, str] = {
    "PrisKVConnector": "MooncakeStoreConnector or YuanrongConnector (a shared KV store)",
    "NixlConnector": "MooncakeTransferEngineConnector (RDMA pulls between hosts)",
    "NixlKVConnector": "MooncakeTransferEngineConnector (RDMA pulls between hosts)",
    "CudaIPCConnector": "SharedMemoryConnector (it passes CUDA tensors by CUDA IPC handle on one host)",
}


def _table(owner: str) -> dict[str, VllmKey]:
    return {**_EVERY_CONNECTOR, **_CHUNK_ADAPTER, **_MODEL_CODE, **KEYS.get(owner, {})}


def lookup(owner: str, key: str) -> VllmKey | None:
    """What `owner` does with vllm-omni's `key` (None: vllm-omni does not know it either)."""
    table = _table(owner)
    if key in table:
        return table[key]
    for name, entry in table.items():
        if name.endswith("*") and key.startswith(name[:-1]):
            return entry
    return None


def summary(owner: str) -> str:
    """vllm-omni's keys for an error message: the named ones, and the prefixes for the rest."""
    table = _table(owner)
    prefixes = [name[:-1] for name in table if name.endswith("*")]
    named = [name for name in table if not name.endswith("*") and not name.startswith(tuple(prefixes))]
    return ", ".join(sorted(named) + sorted(name for name in table if name.endswith("*")))


_warned: set[tuple[str, str]] = set()


def no_effect_message(owner: str, key: str, value: Any, entry: VllmKey) -> str | None:
    """What to tell the user about a key that changes nothing here, or None."""
    if entry.kind != "no effect" or (entry.same_as_ours and value in entry.same_as_ours):
        return None
    return f"{owner}: config key {key!r} (vllm-omni's) has no effect in omni-mesh: {entry.note}"


def no_effect_messages(owner: str, raw: Mapping[str, Any], fields: Iterable[str]) -> list[str]:
    """For `omni-mesh validate`: the keys of `raw` that change nothing here, one message per reason."""
    ours = set(fields)
    by_note: dict[str, list[str]] = {}
    for key, value in raw.items():
        entry = None if key in ours else lookup(owner, key)
        if entry is not None and no_effect_message(owner, key, value, entry):
            by_note.setdefault(entry.note, []).append(key)
    messages = []
    for note, keys in by_note.items():
        names = ", ".join(map(repr, keys))
        verb = "has" if len(keys) == 1 else "have"
        messages.append(f"{owner}: config key{'s' if len(keys) > 1 else ''} {names} (vllm-omni's) {verb} no effect "
                        f"in omni-mesh: {note}")
    return messages


def warn_no_effect(owner: str, key: str, value: Any, entry: VllmKey) -> None:
    """Log no_effect_message once per owner and key in this process."""
    message = no_effect_message(owner, key, value, entry)
    if message is not None and (owner, key) not in _warned:
        _warned.add((owner, key))
        log.warning("%s", message)


def did_you_mean(key: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, [c for c in candidates if not c.endswith("*")], n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def table_rows(owner: str) -> Mapping[str, VllmKey]:
    """vllm-omni's keys `owner` accepts (prefix patterns end in "*"), sorted: the rows docs/connectors.md
    shows."""
    return dict(sorted(_table(owner).items()))
