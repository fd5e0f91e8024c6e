"""Qwen2.5-Omni's token2wav over several requests in one call (code2wav's Gather, omni_mesh.engines.gather):
whole replies, and streamed chunks (`ChunkedDecode.feed_many`), of any lengths.

Its DiT attends both ways within a window of blocks, so a row padded to a longer one would read the
padding: `dit_mask.compact_mask` masks it. BigVGAN's convolutions are not causal, so each row's mel goes
through it cut to its own length (rows of one length together). Requests of one speaker go together (the
speaker's reference mel is one input of the batch).

The DiT draws each request's noise inside `sample()` from torch's global generator (`Token2Wav.decode`
seeds it first), which cannot give each row a seed of its own: so the ODE loop of `sample()` is written
out here (a few lines around the model's own DiT forward and its RK4 solver), each row starting from the
noise its own seed draws. Each equals its own decode to float rounding (tests/test_code2wav_batch.py:
within 2 steps of 16-bit PCM).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

from omni_mesh.engines.dit_mask import compact_mask
from omni_mesh.engines.qwen2_5_omni import Token2Wav, speaker_entry
from omni_mesh.engines.speaker_once import speaker_once

#: `Qwen2_5OmniToken2WavModel.forward`'s defaults, which `Token2Wav.decode` leaves as they are.
GUIDANCE_SCALE = 0.5
SWAY_COEFFICIENT = -1.0
#: mel frames BigVGAN takes in one call: its activations (a row of 200 frames is 48,000 samples wide) past
#: this outgrow the CPU's caches (tiny model, one thread: 0.16 s a row alone, 0.09 in 8 rows of 200
#: frames, 0.17 in 16)
VOCODE_FRAMES = 1600


@torch.no_grad()
def decode_many(token2wav: Token2Wav, requests: list[tuple[torch.Tensor, str | None, int | None]]) -> list[torch.Tensor]:
    """Each (codes, speaker, seed)'s waveform, as `token2wav.decode(codes, speaker=, seed=)` makes it."""
    out: list[torch.Tensor] = [torch.zeros(0)] * len(requests)
    groups: dict[str | None, list[int]] = defaultdict(list)
    limit = token2wav.model.code2wav_dit_model.config.max_position_embeddings
    for i, (codes, speaker, _) in enumerate(requests):
        if codes.numel() > 0 and codes.numel() * token2wav.model.config.dit_config.repeats <= limit:
            groups[speaker].append(i)
        else:  # nothing to decode, or too long (decode() says so)
            out[i] = token2wav.decode(codes, speaker=speaker, seed=requests[i][2])
    for speaker, rows in groups.items():
        if len(rows) == 1:
            codes, _, seed = requests[rows[0]]
            out[rows[0]] = token2wav.decode(codes, speaker=speaker, seed=seed)
            continue
        codes = [requests[i][0].reshape(-1) for i in rows]
        for i, wav in zip(rows, _decode_rows(token2wav, codes, speaker, [requests[i][2] for i in rows]), strict=True):
            out[i] = wav
    return out


def _decode_rows(token2wav: Token2Wav, codes: list[torch.Tensor], speaker: str | None,
                 seeds: list[int | None]) -> list[torch.Tensor]:
    """The waveform of each codes (one speaker), each row from its own seed's noise, right-padded."""
    model = token2wav.model
    dit, device = model.code2wav_dit_model, model.device
    entry = speaker_entry(token2wav.speakers, speaker)
    rows = len(seeds)
    reference_mel = entry["ref_mel"].to(device).float().expand(rows, -1, -1)
    conditioning = entry["cond"].to(device).float().reshape(1, -1).expand(rows, -1)
    durations = [len(c) * dit.repeats for c in codes]
    duration = max(durations)
    with token2wav.lock:  # an unseeded row draws from the global generator, as decode() does
        noise = torch.stack([_padded(_noise((duration_i, dit.mel_dim), seed, device), duration)
                             for seed, duration_i in zip(seeds, durations, strict=True)])
    speaker_embedding = conditioning.unsqueeze(1).repeat(1, duration, 1)
    padded_codes = torch.stack([_padded(c, max(len(c) for c in codes)) for c in codes]).to(device)

    def velocity(time_step: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        output = dit(hidden_states=hidden_states, quantized_code=padded_codes, speaker_embedding=speaker_embedding,
                     condition_vector=reference_mel, time_step=time_step, apply_cfg=True)
        guided, unconditioned = torch.chunk(output, 2, dim=0)
        return guided + (guided - unconditioned) * GUIDANCE_SCALE

    times = torch.linspace(0, 1, token2wav.num_steps, device=device, dtype=torch.float32)
    times += SWAY_COEFFICIENT * (torch.cos(torch.pi / 2 * times) - 1 + times)
    with compact_mask(dit, durations), speaker_once(dit):
        mel = RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(times)[-1].permute(0, 2, 1)
    return _vocode(model, mel, durations)


def _vocode(model: Any, mel: torch.Tensor, durations: list[int]) -> list[torch.Tensor]:
    """BigVGAN of each row's mel [mel_dim, duration] cut to its own duration, rows of one length together,
    up to VOCODE_FRAMES mel frames a call."""
    out: list[torch.Tensor] = [torch.zeros(0)] * len(durations)
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, duration in enumerate(durations):
        by_length[duration].append(i)
    for duration, same in by_length.items():
        step = max(1, VOCODE_FRAMES // duration)
        for rows in (same[start : start + step] for start in range(0, len(same), step)):
            wav = model.code2wav_bigvgan_model(mel[rows, :, :duration]).reshape(len(rows), -1).float().cpu()
            for i, row in zip(rows, wav, strict=True):
                out[i] = row
    return out


def _padded(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """`tensor` with zeros after it along its first dimension up to `length`."""
    return torch.cat([tensor, tensor.new_zeros(length - len(tensor), *tensor.shape[1:])])


def _noise(shape: tuple[int, ...], seed: int | None, device: Any) -> torch.Tensor:
    """sample()'s initial noise for one request: torch.manual_seed(seed), then randn, as decode() draws it."""
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32, device=device)
