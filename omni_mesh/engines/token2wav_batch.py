"""Qwen2.5-Omni's token2wav over several requests in one call (code2wav's Gather, omni_mesh.engines.gather).

Its DiT attends both ways across blocks, so a row padded to a longer one would decode differently: only
requests with as many codes and the same speaker (the speaker's reference mel is one input of the
batch) go together; any other decodes alone, as before. The DiT draws each request's noise inside
`sample()` from torch's global generator (`Token2Wav.decode` seeds it first), which cannot give each row
a seed of its own: so the ODE loop of `sample()` is written out here (a few lines around the model's own
DiT forward and its RK4 solver), each row starting from the noise its own seed draws. Each equals its
own decode to float rounding (tests/test_code2wav_batch.py: within 2 steps of 16-bit PCM).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

from omni_mesh.engines.qwen2_5_omni import Token2Wav, speaker_entry

#: `Qwen2_5OmniToken2WavModel.forward`'s defaults, which `Token2Wav.decode` leaves as they are.
GUIDANCE_SCALE = 0.5
SWAY_COEFFICIENT = -1.0


@torch.no_grad()
def decode_many(token2wav: Token2Wav, requests: list[tuple[torch.Tensor, str | None, int | None]]) -> list[torch.Tensor]:
    """Each (codes, speaker, seed)'s waveform, as `token2wav.decode(codes, speaker=, seed=)` makes it."""
    out: list[torch.Tensor] = [torch.zeros(0)] * len(requests)
    groups: dict[tuple[int, str | None], list[int]] = defaultdict(list)
    limit = token2wav.model.code2wav_dit_model.config.max_position_embeddings
    for i, (codes, speaker, _) in enumerate(requests):
        if codes.numel() > 0 and codes.numel() * token2wav.model.config.dit_config.repeats <= limit:
            groups[(codes.numel(), speaker)].append(i)
        else:  # nothing to decode, or too long (decode() says so)
            out[i] = token2wav.decode(codes, speaker=speaker, seed=requests[i][2])
    for (_, speaker), rows in groups.items():
        if len(rows) == 1:
            codes, _, seed = requests[rows[0]]
            out[rows[0]] = token2wav.decode(codes, speaker=speaker, seed=seed)
            continue
        codes = torch.stack([requests[i][0].reshape(-1) for i in rows])
        for i, wav in zip(rows, _decode_rows(token2wav, codes, speaker, [requests[i][2] for i in rows]), strict=True):
            out[i] = wav
    return out


def _decode_rows(token2wav: Token2Wav, codes: torch.Tensor, speaker: str | None, seeds: list[int | None]) -> torch.Tensor:
    """[B, samples] of codes [B, n] (one speaker), each row from its own seed's noise."""
    model = token2wav.model
    dit, device = model.code2wav_dit_model, model.device
    entry = speaker_entry(token2wav.speakers, speaker)
    rows = len(seeds)
    reference_mel = entry["ref_mel"].to(device).float().expand(rows, -1, -1)
    conditioning = entry["cond"].to(device).float().reshape(1, -1).expand(rows, -1)
    duration = codes.shape[1] * dit.repeats
    with token2wav.lock:  # an unseeded row draws from the global generator, as decode() does
        noise = torch.cat([_noise((1, duration, dit.mel_dim), seed, device) for seed in seeds])
    speaker_embedding = conditioning.unsqueeze(1).repeat(1, duration, 1)
    codes = codes.to(device)

    def velocity(time_step: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        output = dit(hidden_states=hidden_states, quantized_code=codes, speaker_embedding=speaker_embedding,
                     condition_vector=reference_mel, time_step=time_step, apply_cfg=True)
        guided, unconditioned = torch.chunk(output, 2, dim=0)
        return guided + (guided - unconditioned) * GUIDANCE_SCALE

    times = torch.linspace(0, 1, token2wav.num_steps, device=device, dtype=torch.float32)
    times += SWAY_COEFFICIENT * (torch.cos(torch.pi / 2 * times) - 1 + times)
    mel = RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(times)[-1].permute(0, 2, 1)
    return model.code2wav_bigvgan_model(mel).reshape(rows, -1).float().cpu()


def _noise(shape: tuple[int, ...], seed: int | None, device: Any) -> torch.Tensor:
    """sample()'s initial noise for one request: torch.manual_seed(seed), then randn, as decode() draws it."""
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32, device=device)
