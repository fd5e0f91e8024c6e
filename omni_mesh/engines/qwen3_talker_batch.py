"""Qwen3-Omni's talker in the running batch (omni_mesh.engines.batching): its code predictor and its MoE
decoder each run once per step for every row.

A step of one request in generate() (the talker's `prepare_inputs_for_generation`): the code predictor
draws the last code's residual codes (a fresh 2-row prompt: the talker's last hidden state and the code's
embedding, then one code per group), which complete a frame; the frame's embeddings summed, plus the
thinker's next text row (tts pad once they run out), are the talker's next input; the talker draws the
next frame's first code. Here both models take every row at once: the code predictor's rows all have the
same length (no padding), the talker's cache is stacked left-padded as the thinker's (ThinkerBatch).
Each row keeps its own processors, seed and step; a frame goes to its request as soon as it is complete.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import DynamicCache, LogitsProcessorList

from omni_mesh.engines.batching import Job, Row
from omni_mesh.engines.draw_rows import draw_rows, shared_key
from omni_mesh.engines.next_token import logits_processors
from omni_mesh.engines.qwen3_omni import TALKER_GRID_KEYS
from omni_mesh.engines.talker_batch import TalkerBatch
from omni_mesh.engines.thinker_batch import Begun, Sequence, ThinkerBatch


def _ignore(item: Any) -> None:
    return None


#: generate()'s code predictor when the talker samples (`prepare_inputs_for_generation`).
PREDICTOR_SAMPLING = {"top_k": 50, "top_p": 0.8}


@dataclass
class Voice(Sequence):
    """A Qwen3 talker row: a Sequence (its first codes), and what its code predictor and next input read."""

    push: Callable[[torch.Tensor], None] = _ignore  # the request's: each finished frame [1, G]
    hidden: torch.Tensor | None = None  # [1, 1, H] the talker's last hidden state (last layer, last row)
    predictor: LogitsProcessorList = field(default_factory=LogitsProcessorList)
    step: int = 0  # generate()'s generation_step: which trailing text row the next input adds
    key: str | None = None  # draw_rows.shared_key of its talker processors: rows drawn in one call
    predictor_key: str | None = None  # and of its code predictor's


class Qwen3TalkerBatch(ThinkerBatch):
    """`batching.Engine` over Qwen3-Omni's talker (`model`: the transformers talker with its code predictor)."""

    def __init__(self, model: Any, codec_eos: int) -> None:
        super().__init__(model)
        self.codec_eos = codec_eos
        self.groups = int(model.config.num_code_groups)

    _rope_delta = TalkerBatch._rope_delta  # the talker keeps its rope deltas on itself, as Qwen2.5's

    def join(self, job: Job, begun: Begun) -> tuple[Row, int]:
        # the row pushes frames (from step()), not the first codes the batch hands Row.take()
        quiet = replace(job, push=_ignore)
        prepared = begun.prepared
        if prepared is None:  # nothing to speak (Qwen3OmniTalker.prepare): done at once, no frame
            state = Voice(begun, LogitsProcessorList(), None, True, torch.zeros(1, 0, dtype=torch.long),
                          torch.zeros(4, 1, dtype=torch.long), 0, push=job.push)
            return Row(quiet, state, 1, frozenset({self.codec_eos})), self.codec_eos
        with begun.lock or contextlib.nullcontext():
            kwargs = dict(prepared.kwargs)
            cache = kwargs.pop("cache", None)
            if cache is not None and not any(key in kwargs for key in TALKER_GRID_KEYS):
                hidden, logits = self._first_step(kwargs, cache)
            else:
                cache = DynamicCache(config=self.model.config.get_text_config()) if cache is None else cache
                # generate()'s first step (the last input rows, as the one-request path runs them): raw logits
                result = self.model.generate(
                    **kwargs, cache=cache, max_new_tokens=1, do_sample=False, output_logits=True,
                    output_hidden_states=True, return_dict_in_generate=True,
                )
                hidden, logits = result.hidden_states[0][0][-1][:, -1:], result.logits[0]
            delta = self._rope_delta()
        length = int(cache.get_seq_length())
        position = torch.full((4, 1), length + delta, dtype=torch.long, device=cache.layers[0].keys.device)
        position[0] = length  # the text row (the mask's positions) has no rope delta
        greedy = not begun.generation.get("do_sample", False)
        generator = None
        if begun.seed is not None and not greedy:  # generate() draws from the global generator, seeded so
            generator = torch.Generator(device=position.device).manual_seed(begun.seed)
        sequence = prepared.input_ids  # [1, 0]: generate() of embeddings penalises only the codes it draws
        predictor = {"do_sample": not greedy, **({} if greedy else PREDICTOR_SAMPLING)}
        processors = self._processors(begun)
        predictor_processors = logits_processors(self.model.code_predictor, predictor, sequence)
        state = Voice(
            begun, processors, generator, greedy, sequence, position, length,
            kv=[(layer.keys, layer.values) for layer in cache.layers], push=job.push,
            hidden=hidden, predictor=predictor_processors,
            key=shared_key(processors, begun.generation, greedy),
            predictor_key=shared_key(predictor_processors, predictor, greedy),
        )
        return Row(quiet, state, begun.max_tokens, begun.eos), self._pick(state, logits)

    def _first_step(self, kwargs: dict[str, Any], cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
        """generate()'s first step of a text prompt's input prefilled but its last rows
        (Qwen3OmniTalker.prepare) as one forward of the talker's decoder and codec head, with the arguments generate() gives it: (the
        last row's last-layer hidden state [1, 1, H], the float32 logits [1, V]), bit for bit generate()'s
        (measured), without its ~2 ms of set-up a request: a wave of requests joins one after another."""
        embeds, positions = kwargs["inputs_embeds"], kwargs["position_ids"]
        rest = int(embeds.shape[1]) - int(cache.get_seq_length())
        out = self.model.model(
            inputs_embeds=embeds[:, -rest:], position_ids=positions[..., -rest:],
            attention_mask=kwargs["attention_mask"], cache=cache, use_cache=True, output_hidden_states=True,
        )
        logits = self.model.codec_head(out.last_hidden_state)[:, -1].to(torch.float32)
        return out.hidden_states[-1][:, -1:], logits

    def step(self, rows: list[Row]) -> list[int]:
        states: list[Voice] = [row.state for row in rows]
        frames = self._frames(states)
        for state, frame in zip(states, frames, strict=True):
            state.steps.append(frame)
            state.push(frame)
        embeds = self._next_inputs(states, frames)
        self._restack(states)
        assert self.cache is not None and self.mask is not None
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(states), 1)], dim=1)
        out = self.model.model(
            inputs_embeds=embeds, position_ids=torch.stack([s.position for s in states], dim=1),
            attention_mask=self.mask, cache=self.cache, use_cache=True, output_hidden_states=True,
        )
        logits = self.model.codec_head(out.last_hidden_state)[:, -1].to(torch.float32)
        drawn = draw_rows([(s.processors, s.sequence, s.greedy, s.generator, s.key) for s in states], logits)
        for i, state in enumerate(states):
            state.length += 1
            state.position = state.position + 1
            state.step += 1
            state.hidden = out.hidden_states[-1][i : i + 1, -1:]
            state.sequence = drawn[i]
            state.fed = int(drawn[i][0, -1])
        return [state.fed for state in states]

    def _frames(self, states: list[Voice]) -> list[torch.Tensor]:
        """Each row's frame [1, G] of its last code: the code predictor draws the residual codes of every
        row at once (as generate() does for one: a 2-row prompt, then one code per group)."""
        predictor = self.model.code_predictor
        device = self.mask.device if self.mask is not None else states[0].position.device
        last = torch.tensor([[int(s.sequence[0, -1])] for s in states], device=device)
        embeds = torch.cat((torch.cat([s.hidden for s in states]), self.model.get_input_embeddings()(last)), dim=1)
        cache = DynamicCache(config=predictor.config)
        drawn = [torch.zeros(1, 0, dtype=torch.long, device=device) for _ in states]
        start = 0
        for group in range(self.groups - 1):
            if group:  # generate()'s step `group` embeds the code it drew last with the group's embedding
                embeds = predictor.get_input_embeddings()[group - 1](torch.cat([d[:, -1:] for d in drawn]))
            positions = torch.arange(start, start + embeds.shape[1], device=device).expand(len(states), -1)
            start += embeds.shape[1]
            out = predictor.model(inputs_embeds=embeds, position_ids=positions, cache=cache, use_cache=True)
            logits = predictor.lm_head[group](out.last_hidden_state)[:, -1].to(torch.float32)
            drawn = draw_rows([(s.predictor, d, s.greedy, s.generator, s.predictor_key)
                               for s, d in zip(states, drawn, strict=True)], logits)
        return [torch.cat([last[i : i + 1], d], dim=1).to("cpu", torch.long) for i, d in enumerate(drawn)]

    def _next_inputs(self, states: list[Voice], frames: list[torch.Tensor]) -> torch.Tensor:
        """[B, 1, H]: each row's frame embedded and summed (the talker's embedding of its first code, the
        code predictor's of the others), plus its next trailing text row or tts pad."""
        talker, predictor = self.model, self.model.code_predictor
        device = states[0].hidden.device if states[0].hidden is not None else None
        codes = torch.cat(frames).to(device)  # [B, G]
        parts = [talker.get_input_embeddings()(codes[:, :1])]
        parts += [predictor.get_input_embeddings()[g](codes[:, g + 1 : g + 2]) for g in range(self.groups - 1)]
        embeds = torch.cat(parts, dim=1).sum(1, keepdim=True)
        rows = []
        for state in states:
            kwargs = state.begun.prepared.kwargs
            trailing = kwargs["trailing_text_hidden"]
            rows.append(trailing[:, state.step] if state.step < trailing.shape[1] else kwargs["tts_pad_embed"][:, 0])
        return embeds + torch.stack(rows).to(embeds.device)


def frames_of(groups: int, prepared: Any, sequence: torch.Tensor, steps: list[torch.Tensor]) -> torch.Tensor:
    """A finished row's codes int64 [T, groups]: the frames its steps completed (the last code drawn, a
    stop or the one past max_codes, never gets one)."""
    del prepared, sequence
    return torch.cat(steps) if steps else torch.zeros(0, groups, dtype=torch.long)
