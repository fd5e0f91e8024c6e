"""The processor a tiny checkpoint ships, as a real Qwen-Omni checkpoint does: a tokenizer that names
the multimodal special tokens, a chat template that emits them for `audio` / `image` / `video` content
parts, Whisper's log-mel feature extractor (128 bins, 16 kHz) and the Qwen2-VL image and video
processors (the architecture's patch size). `AutoProcessor.from_pretrained(directory)` reads it back;
the engines never re-derive placeholder counts: the processor expands them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Qwen's chat template with content parts: the checkpoint's own knows `audio`, `image` and `video`
#: parts (OpenAI's `input_audio` / `image_url` / `video_url` are mapped to them before templating).
#: The tokens are the tokenizer's (`audio_bos_token`...). A text-only message renders as before.
MEDIA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' %}{{ AUDIO }}"
    "{% elif part['type'] == 'image' %}{{ IMAGE }}"
    "{% elif part['type'] == 'video' %}{{ VIDEO }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: The multimodal token names each architecture's processor reads from its tokenizer.
TOKEN_NAMES = {
    "qwen2_5_omni": {
        "audio_token": "<|AUDIO|>", "image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>",
        "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
        "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
    },
    "qwen3_omni_moe": {
        "audio_token": "<|audio_pad|>", "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
        "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
        "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
    },
}
#: The vision towers' patch: 14 pixels for Qwen2.5-Omni, 16 for Qwen3-Omni (2x2 patches merge into a token).
PATCH_SIZE = {"qwen2_5_omni": 14, "qwen3_omni_moe": 16}
PROCESSOR_CLASS = {"qwen2_5_omni": "Qwen2_5OmniProcessor", "qwen3_omni_moe": "Qwen3OmniMoeProcessor"}


def chat_template(arch: str) -> str:
    names = TOKEN_NAMES[arch]
    return (
        MEDIA_CHAT_TEMPLATE.replace("{{ AUDIO }}", names["audio_bos_token"] + names["audio_token"] + names["audio_eos_token"])
        .replace("{{ IMAGE }}", names["vision_bos_token"] + names["image_token"] + names["vision_eos_token"])
        .replace("{{ VIDEO }}", names["vision_bos_token"] + names["video_token"] + names["vision_eos_token"])
    )


def tokenizer_options(arch: str) -> dict[str, Any]:
    """What `save_tiny_tokenizer` needs for a tokenizer this architecture's processor can take."""
    return {"named_tokens": dict(TOKEN_NAMES[arch]), "chat_template": chat_template(arch)}


def save_tiny_processor(directory: Path, tokenizer: Any, arch: str) -> None:
    """Write the processor files of `arch` next to the checkpoint; `tokenizer` was saved with
    `TOKEN_NAMES[arch]` and `chat_template(arch)` (`tokenizer_options`)."""
    import transformers
    from transformers import AutoProcessor, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    template = chat_template(arch)
    patch = PATCH_SIZE[arch]
    processor = getattr(transformers, PROCESSOR_CLASS[arch])(
        image_processor=Qwen2VLImageProcessor(patch_size=patch),
        video_processor=Qwen2VLVideoProcessor(patch_size=patch),
        feature_extractor=WhisperFeatureExtractor(feature_size=128),
        tokenizer=tokenizer,
        chat_template=template,
    )
    processor.save_pretrained(str(directory))
    AutoProcessor.from_pretrained(str(directory))  # what an engine will read: fail here, not in a stage


#: Gains on the tiny audio towers' layers (by name; Qwen2.5-Omni has conv1/conv2, Qwen3-Omni
#: conv2d1-3 and proj2). At random init their positional embedding drowns the convolved mel features
#: (two different clips gave the same reply) and Qwen3's embeddings come out ~20x smaller than a text
#: token's: scaled, what the tower hears changes the reply. Powers of two: exact in any float format.
AUDIO_GAINS = {"conv1": 16.0, "conv2": 4.0, "conv2d1": 16.0, "conv2d2": 16.0, "conv2d3": 16.0, "proj2": 16.0}


def make_towers_matter(thinker: Any) -> None:
    """Scale the tiny audio tower's layers by `AUDIO_GAINS` (its vision tower already matters)."""
    import torch

    tower = thinker.model.audio_tower
    with torch.no_grad():
        for name, gain in AUDIO_GAINS.items():
            layer = getattr(tower, name, None)
            if layer is None:
                continue
            layer.weight.mul_(gain)
            if layer.bias is not None:
                layer.bias.mul_(gain)
