"""A tiny random Qwen2.5-Omni of the real architecture (thinker, talker, token2wav): seeded, offline,
a couple of MB, written in about a second. It speaks noise; the point is the real code path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: The tokenizer's special tokens, in id order after its BPE vocabulary.
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
    "<|IMAGE|>", "<|VIDEO|>", "<|vision_bos|>", "<|vision_eos|>", "<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>",
)
HIDDEN = 64
#: The talker's codec vocabulary: ids below SPEECH_CODES are speech (the DiT embeds them), then its
#: control ids, as the real model lays them out (8192 speech codes, pad 8292, bos 8293, eos 8294).
SPEECH_CODES = 256
CODEC_PAD, CODEC_BOS, CODEC_EOS, CODEC_MASK = 292, 293, 294, 296
TALKER_VOCAB = 300
SPEAKERS = ("Chelsie", "Ethan")


def build_tiny_qwen2_5_omni(directory: Path, seed: int = 0) -> None:
    """Write config, weights, generation config, tokenizer and spk_dict.pt into `directory`."""
    import torch
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    from omni_mesh.engines.tiny_processor import make_towers_matter, save_tiny_processor, tokenizer_options
    from omni_mesh.engines.tiny_tokenizer import save_tiny_tokenizer

    directory = Path(directory)
    tokenizer = save_tiny_tokenizer(directory, SPECIAL_TOKENS, **tokenizer_options("qwen2_5_omni"))
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    media = {
        "audio_token_index": ids["<|AUDIO|>"],
        "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"],
        "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"],
        "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"],
    }
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
    layers = {"intermediate_size": 2 * HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = Qwen2_5OmniConfig(
        thinker_config={
            "text_config": {
                "vocab_size": len(tokenizer), "hidden_size": HIDDEN, **layers, "rope_parameters": rope,
                "max_position_embeddings": 4096, "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
            },
            "audio_config": {"encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 32, "d_model": 16, "output_dim": HIDDEN},
            "vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": HIDDEN, "fullatt_block_indexes": [0]},
            "user_token_id": ids["<|im_start|>"],
            **media,
        },
        talker_config={
            "vocab_size": TALKER_VOCAB, "embedding_size": HIDDEN, "hidden_size": HIDDEN, "head_dim": 16, **layers,
            "rope_parameters": rope, "max_position_embeddings": 8192,
            "tts_text_start_token_id": ids["<|tts_bos|>"], "tts_text_end_token_id": ids["<|tts_eos|>"],
            "tts_text_pad_token_id": ids["<|tts_pad|>"], "tts_codec_start_token_id": CODEC_BOS,
            "tts_codec_end_token_id": CODEC_EOS, "tts_codec_pad_token_id": CODEC_PAD, "tts_codec_mask_token_id": CODEC_MASK,
            **media,
        },
        token2wav_config={
            "dit_config": {
                "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 16, "ff_mult": 2,
                "emb_dim": 16, "num_embeds": SPEECH_CODES + 1, "mel_dim": 80, "enc_emb_dim": 16, "enc_dim": 16,
                "enc_channels": [16, 16, 16, 16, 48], "enc_attention_channels": 8, "enc_se_channels": 8,
                "look_ahead_layers": [1], "look_backward_layers": [0], "dropout": 0.0,
            },
            "bigvgan_config": {"mel_dim": 80, "upsample_initial_channel": 64, "resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1, 3, 5]]},
        },
    )
    torch.manual_seed(seed)
    model = Qwen2_5OmniForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    speakers = {
        name: {
            "bos_token": ids["<|tts_bos|>"],
            "cond": torch.randn(1, 16, generator=generator),
            "ref_mel": torch.randn(1, 40, 80, generator=generator),
        }
        for name in SPEAKERS
    }
    _make_audible(model, speakers[SPEAKERS[0]])
    make_towers_matter(model.thinker)
    model.save_pretrained(str(directory))
    torch.save(speakers, directory / "spk_dict.pt")
    save_tiny_processor(directory, tokenizer, "qwen2_5_omni")


def _make_audible(model: Any, speaker: dict) -> None:
    """Random BigVGAN weights speak at about 1e-8 of full scale, which 16-bit PCM rounds to silence
    (and would make any comparison of waveforms vacuous): scale its last, linear, bias-free layer so
    that a sample decode peaks near half of full scale."""
    import torch

    with torch.no_grad():
        codes = torch.arange(50).reshape(1, -1) % SPEECH_CODES
        wav = model.token2wav(codes, conditioning=speaker["cond"], reference_mel=speaker["ref_mel"], num_steps=4)
        peak = float(wav.abs().max())
        model.token2wav.code2wav_bigvgan_model.conv_post.weight.mul_(0.5 / max(peak, 1e-30))
