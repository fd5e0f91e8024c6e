"""Code2Wav's vocoder stand-in: codec code-groups -> short pentatonic tones -> 16-bit PCM WAV.

Each code-group (one per reply token) becomes a 0.1 s tone: the first code picks the melody note
from an A-minor pentatonic scale, the others add quieter voices an octave lower. Raised-cosine fades
at both ends avoid clicks, and the pentatonic scale keeps any chord of notes consonant, so the
result is pleasant to listen to while still depending on every code.
"""

from __future__ import annotations

import numpy as np

from omni_mesh.audio import SAMPLE_RATE, pcm16_bytes, wav_base64, wav_bytes
from services.omni_demo.model import CODEBOOK_SIZE

__all__ = ["GROUP_SAMPLES", "GROUP_SECONDS", "SAMPLE_RATE", "pcm16_bytes", "synthesize", "wav_base64", "wav_bytes"]
GROUP_SECONDS = 0.1
GROUP_SAMPLES = int(SAMPLE_RATE * GROUP_SECONDS)
_ATTACK_SAMPLES = int(0.005 * SAMPLE_RATE)
_RELEASE_SAMPLES = int(0.025 * SAMPLE_RATE)
_PENTATONIC = (0, 3, 5, 7, 10)  # semitones above the root within one octave
_ROOT_HZ = 220.0  # A3
_VOICE_GAINS = (1.0, 0.45, 0.3, 0.2)  # melody first; later codes are quieter harmony
_PEAK = 0.6  # headroom under full scale, so a loud chord never clips


def code_to_hz(code: int) -> float:
    """Map a code to a pentatonic note, climbing octave by octave (codes 0..15 span A3..A6)."""
    octave, degree = divmod(int(code), len(_PENTATONIC))
    return _ROOT_HZ * 2.0 ** (octave + _PENTATONIC[degree] / 12.0)


def _envelope() -> np.ndarray:
    env = np.ones(GROUP_SAMPLES, dtype=np.float32)
    env[:_ATTACK_SAMPLES] = 0.5 - 0.5 * np.cos(np.linspace(0.0, np.pi, _ATTACK_SAMPLES, dtype=np.float32))
    env[-_RELEASE_SAMPLES:] = 0.5 + 0.5 * np.cos(np.linspace(0.0, np.pi, _RELEASE_SAMPLES, dtype=np.float32))
    return env


_ENV = _envelope()
_T = np.arange(GROUP_SAMPLES, dtype=np.float32) / SAMPLE_RATE
_NOTE_HZ = np.array([code_to_hz(code) for code in range(CODEBOOK_SIZE)], dtype=np.float32)


def synthesize(groups: np.ndarray) -> np.ndarray:
    """float32 samples in [-1, 1] for codes ``[n_groups, codes_per_group]``, GROUP_SAMPLES per group."""
    groups = np.asarray(groups, dtype=np.int64)
    if groups.ndim != 2:
        raise ValueError(f"code groups must be 2-D [groups, codes_per_group], got {tuple(groups.shape)}")
    if groups.size and (groups.min() < 0 or groups.max() >= len(_NOTE_HZ)):
        raise ValueError(f"codes must lie in [0, {len(_NOTE_HZ)}), got {groups.min()}..{groups.max()}")
    last = len(_VOICE_GAINS) - 1  # any voices past the table share its quietest gain
    gains = np.array([_VOICE_GAINS[min(i, last)] for i in range(groups.shape[1])], np.float32)
    freqs = _NOTE_HZ[groups]
    freqs[:, 1:] /= 2.0  # harmony an octave below the melody
    phase = 2.0 * np.pi * freqs[:, :, None] * _T[None, None, :]
    # A touch of second harmonic makes the tones warmer than bare sines.
    voices = np.sin(phase) + 0.25 * np.sin(2.0 * phase)
    mix = (voices * gains[None, :, None]).sum(axis=1) / (1.25 * gains.sum())
    return (_PEAK * mix * _ENV[None, :]).astype(np.float32).reshape(-1)
