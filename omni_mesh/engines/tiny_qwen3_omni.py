"""A tiny random Qwen3-Omni (`Qwen3OmniMoeForConditionalGeneration`: MoE thinker with audio and vision
towers, MoE talker with its code predictor, code2wav) of the real architecture: seeded, offline, a few
MB, written in a couple of seconds. It speaks noise; the point is the real code path.

The ids the config refers to are the tokenizer's: the chat roles (`user`, `assistant`, `system`) are one
token each, as Qwen's are, because generate() finds the user turns and the assistant turn by those ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: The tokenizer's special tokens (Qwen3-Omni's names), in id order after its BPE vocabulary.
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
    "<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>",
)
#: The chat roles, added after the special tokens as whole words (generate() looks for them by id).
ROLE_TOKENS = ("system", "user", "assistant")

THINKER_HIDDEN = 64
TALKER_HIDDEN = 32
#: Codes per frame: the talker makes the first, its code predictor the others (the real model: 16).
CODE_GROUPS = 4
#: Codec ids per group (the real model: 2048). The talker's own vocabulary is the codebook, its
#: control ids, then padding up to CODEBOOK + 1024: generate() suppresses the top 1024 ids (except
#: codec eos), so only speech codes and eos can be drawn, and every drawn code is one code2wav embeds.
CODEBOOK = 64
TALKER_VOCAB = CODEBOOK + 1024
CODEC_PAD, CODEC_BOS, CODEC_EOS = CODEBOOK + 4, CODEBOOK + 5, CODEBOOK + 6
CODEC_NOTHINK, CODEC_THINK_BOS, CODEC_THINK_EOS = CODEBOOK + 11, CODEBOOK + 12, CODEBOOK + 13
SPEAKERS = {"ethan": CODEBOOK + 20, "chelsie": CODEBOOK + 21, "aiden": CODEBOOK + 22}
#: The thinker's hidden layer the talker reads for audio/image/video positions (the real model: 24 of 48).
ACCEPT_HIDDEN_LAYER = 1


def build_tiny_qwen3_omni(directory: Path, seed: int = 0) -> None:
    """Write config.json, model.safetensors, generation_config.json and the tokenizer into `directory`;
    `Qwen3OmniMoeForConditionalGeneration.from_pretrained(directory)` loads it and its generate() runs."""
    import torch
    from tokenizers import AddedToken
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    from omni_mesh.engines.tiny_processor import make_towers_matter, save_tiny_processor, tokenizer_options
    from omni_mesh.engines.tiny_tokenizer import save_tiny_tokenizer

    directory = Path(directory)
    tokenizer = save_tiny_tokenizer(directory, SPECIAL_TOKENS, **tokenizer_options("qwen3_omni_moe"))
    # single_word: "user" is one token as a role, never inside "username"
    tokenizer.add_tokens([AddedToken(role, single_word=True, normalized=False) for role in ROLE_TOKENS])
    tokenizer.save_pretrained(str(directory))
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS + ROLE_TOKENS}

    config = Qwen3OmniMoeConfig(**_config_dict(ids, len(tokenizer)))
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    _init_talker_experts(model, seed)
    _make_audible(model)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    make_towers_matter(model.thinker)
    model.save_pretrained(str(directory))
    save_tiny_processor(directory, tokenizer, "qwen3_omni_moe")


def _config_dict(ids: dict[str, int], vocab_size: int) -> dict[str, Any]:
    media = {
        "audio_token_id": ids["<|audio_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "audio_start_token_id": ids["<|audio_start|>"],
        "vision_start_token_id": ids["<|vision_start|>"],  # read by the rope index, not declared
    }
    head_dim = 16
    # mrope splits head_dim / 2 rotary frequencies over (time, height, width), as [24, 20, 20] does for 128
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
    thinker_text = {
        "vocab_size": vocab_size, "hidden_size": THINKER_HIDDEN, "intermediate_size": 2 * THINKER_HIDDEN,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": head_dim,
        "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "rope_parameters": rope,
        "max_position_embeddings": 4096, "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
    }
    talker_text = {
        "vocab_size": TALKER_VOCAB, "hidden_size": TALKER_HIDDEN, "intermediate_size": 2 * TALKER_HIDDEN,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": head_dim,
        "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "rope_parameters": rope,
        "max_position_embeddings": 4096,
        "shared_expert_intermediate_size": 32,  # the talker's MoE has a shared expert its config does not declare
    }
    code_predictor = {
        "vocab_size": CODEBOOK, "hidden_size": TALKER_HIDDEN, "intermediate_size": 2 * TALKER_HIDDEN,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": head_dim,
        "num_code_groups": CODE_GROUPS, "max_position_embeddings": 64,
    }
    return {
        "thinker_config": {
            "text_config": thinker_text,
            "audio_config": {
                # the real mel bins and windows: the checkpoint's processor makes real features
                "num_mel_bins": 128, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 32,
                "d_model": 16, "output_dim": THINKER_HIDDEN, "downsample_hidden_size": 8, "n_window": 50,
                "n_window_infer": 800, "max_source_positions": 1500,
            },
            "vision_config": {
                "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 16,
                "out_hidden_size": THINKER_HIDDEN, "num_position_embeddings": 64, "deepstack_visual_indexes": [0],
            },
            "user_token_id": ids["user"],
            **media,
        },
        "talker_config": {
            "text_config": talker_text,
            "code_predictor_config": code_predictor,
            "num_code_groups": CODE_GROUPS,
            "thinker_hidden_size": THINKER_HIDDEN,
            "accept_hidden_layer": ACCEPT_HIDDEN_LAYER,
            "codec_eos_token_id": CODEC_EOS, "codec_pad_id": CODEC_PAD, "codec_bos_id": CODEC_BOS,
            "codec_nothink_id": CODEC_NOTHINK, "codec_think_bos_id": CODEC_THINK_BOS,
            "codec_think_eos_id": CODEC_THINK_EOS,
            "speaker_id": dict(SPEAKERS),
            "spatial_merge_size": 2,  # read by the talker's rope index, not declared
            **media,
        },
        "code2wav_config": {
            "codebook_size": CODEBOOK, "num_quantizers": CODE_GROUPS, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "sliding_window": 8,
            "max_position_embeddings": 8000,
            # the real upsampling (2*2 then 8*5*4*3: 1920 samples per frame, 12.5 frames per second at 24 kHz)
            "upsampling_ratios": [2, 2], "upsample_rates": [8, 5, 4, 3], "decoder_dim": 32,
        },
        "im_start_token_id": ids["<|im_start|>"],
        "im_end_token_id": ids["<|im_end|>"],
        "tts_pad_token_id": ids["<|tts_pad|>"],
        "tts_bos_token_id": ids["<|tts_bos|>"],
        "tts_eos_token_id": ids["<|tts_eos|>"],
        "system_token_id": ids["system"],
        "user_token_id": ids["user"],
        "assistant_token_id": ids["assistant"],
    }


def _init_talker_experts(model: Any, seed: int) -> None:
    """transformers 5.25 never initialises the talker's MoE experts (torch.empty: whatever memory held,
    a different checkpoint every build, possibly NaN) and leaves its routers at zero (every expert
    weighted alike): draw them, seeded, as the thinker's are drawn."""
    import torch
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeTalkerTextExperts,
        Qwen3OmniMoeTalkerTextTopKRouter,
    )

    generator = torch.Generator().manual_seed(seed + 1)
    std = model.config.talker_config.initializer_range
    with torch.no_grad():
        for module in model.talker.modules():
            if isinstance(module, Qwen3OmniMoeTalkerTextExperts):
                params = [module.gate_up_proj, module.down_proj]
            elif isinstance(module, Qwen3OmniMoeTalkerTextTopKRouter):
                params = [module.weight]
            else:
                continue
            for param in params:
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def _make_audible(model: Any) -> None:
    """Random code2wav weights may speak far below 16-bit PCM's step, which would make any comparison of
    waveforms vacuous: scale its last convolution so that a sample decode peaks near half of full scale."""
    import torch

    with torch.no_grad():
        codes = (torch.arange(40 * CODE_GROUPS).reshape(1, CODE_GROUPS, 40) * 7) % CODEBOOK
        peak = float(model.code2wav(codes).abs().max())
        last = model.code2wav.decoder[-1].conv
        last.weight.mul_(0.5 / max(peak, 1e-30))
        last.bias.mul_(0.5 / max(peak, 1e-30))
