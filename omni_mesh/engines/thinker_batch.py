"""The thinkers' (and Qwen2.5-Omni's talker's) continuous batching (omni_mesh.engines.batching): each request's prompt prefilled on
its own (the thinker's `prepare()`: chunked, media included) and its first step made by generate(), as
the one-request path makes it; then one forward of the thinker's language model per step for every
running request, each with its own KV cache stacked into a left-padded batch, its own 3-D rope
positions, and its own logits processors and seed (the ones generate() would build for it alone).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, LogitsProcessorList

from omni_mesh.engines import kv_stack, mixed_step
from omni_mesh.engines.batching import Job, Row
from omni_mesh.engines.next_token import draw, logits_processors
from omni_mesh.engines.prefill import PrefillStopped, Prepared, generation_positions, new_cache


@dataclass
class Begun:
    """A request made ready in the model thread (`Job.begin`): its prefilled prompt and its settings."""

    prepared: Prepared
    generation: dict[str, Any]  # generate()'s sampling arguments (generation.sampling_kwargs, decoding_args)
    seed: int | None
    max_tokens: int
    eos: frozenset[int]
    output: Callable[[Prepared, torch.Tensor, list[Any]], Any]  # (prepared, sequences, steps) -> the result
    saw: Callable[[int], None] | None = None
    lock: Any = None  # the thinker's, where it keeps per-call state (rope deltas) across prepare and step 0


@dataclass
class Sequence:
    """What a row keeps between steps."""

    begun: Begun
    processors: LogitsProcessorList
    generator: torch.Generator | None
    greedy: bool
    prefix: torch.Tensor  # [1, P + n]: the prompt and the reply, but the tokens `appended` since (`sequence`)
    position: torch.Tensor  # [rows, 1]: the position ids of the next token fed (text row, then 3-D rope rows)
    length: int  # tokens in its KV cache
    steps: list[Any] = field(default_factory=list)  # per step, the hidden states output() reads
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # its own cache until stacked into the batch
    fed: int = -1  # the token the next step feeds: the sequence's last (kept as an int: no tensor read a step)
    fresh: bool = False  # its prompt is still to be prefilled (ThinkerBatch._prefill, with the others joining)
    waiting: bool = False  # its first token comes with the next step (its last prompt token is fed there)
    appended: list[int] = field(default_factory=list)  # a plain greedy row's tokens not yet in `prefix`

    @property
    def sequence(self) -> torch.Tensor:
        """[1, P + n]: the prompt and the reply so far (a tensor made per row per step cost more)."""
        if self.appended:
            self.prefix = torch.cat([self.prefix, self.prefix.new_tensor([self.appended])], dim=1)
            self.appended = []
        return self.prefix

    @sequence.setter
    def sequence(self, value: torch.Tensor) -> None:
        self.prefix, self.appended = value, []


class ThinkerBatch:
    """`batching.Engine` over a thinker (`model`: the transformers thinker, with `.model` its language
    model and `.lm_head`); `layers`: the hidden states each decode step keeps for output()."""

    def __init__(self, model: Any, layers: tuple[int, ...] = ()) -> None:
        self.model = model
        self.layers = layers
        self.members: list[Sequence] = []  # the rows stacked in `cache`, in order (held: an id could be reused)
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [B, width]: 0 over each row's left padding
        self.positions: torch.Tensor | None = None  # [rows, B, 1]: the members' next positions (theirs go stale)
        self.no_processors: set[tuple] = set()  # sampling settings that build no logits processor
        self.empty: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # _empty's

    def join(self, job: Job, begun: Begun) -> tuple[Row, int | None]:
        prepared = begun.prepared
        if self.direct_first_step and _plain_text(prepared) and self._deferrable(prepared) and "cache" not in prepared.kwargs:
            # not prefilled (models.think_begin): the next step prefills it with the others that join
            state = self._sequence(begun, None, None, None, waiting=True)
            return Row(job, state, begun.max_tokens, begun.eos, saw=begun.saw), None
        if self.direct_first_step and _prefilled_text(prepared):
            if self._deferrable(prepared):  # its last prompt token goes with the next batched step
                cache, positions = prepared.kwargs["cache"], prepared.kwargs["position_ids"]
                state = self._sequence(begun, cache, positions[:, 0, -1:].clone(), None, waiting=True)
                return Row(job, state, begun.max_tokens, begun.eos, saw=begun.saw), None
            cache, hidden, logits, delta = self._first_step(prepared)
        else:
            lock = begun.lock or _NoLock()
            with lock:
                cache = prepared.kwargs.get("cache")
                cache = new_cache(self.model) if cache is None else cache
                result = self.model.generate(
                    input_ids=prepared.input_ids, max_new_tokens=1, do_sample=False, output_logits=True,
                    return_dict_in_generate=True, **{**prepared.kwargs, "cache": cache},
                )
                delta = self._rope_delta()
            hidden, logits = result.hidden_states[0] if result.hidden_states else None, result.logits[0]
        length = int(cache.get_seq_length())
        position = torch.full((self.position_rows, 1), length + delta, dtype=torch.long,
                              device=prepared.input_ids.device)
        if self.position_rows == 4:  # the text row (the mask's positions) has no rope delta
            position[0] = length
        state = self._sequence(begun, cache, position, hidden)
        token = self._pick(state, logits)
        return Row(job, state, begun.max_tokens, begun.eos, saw=begun.saw), token

    def _sequence(self, begun: Begun, cache: DynamicCache | None, position: torch.Tensor | None,
                  hidden: Any, *, waiting: bool = False) -> Sequence:
        """A row's state: its prompt prefilled into `cache` (None: not yet, `_prefill` does it), `position`
        the next token's positions, `hidden` the first step's hidden states; `waiting`: the first step is yet
        to come (a row of the next batched step)."""
        input_ids = begun.prepared.input_ids
        greedy = not begun.generation.get("do_sample", False)
        generator = None
        if begun.seed is not None and not greedy:  # generate() draws from the global generator, seeded so
            generator = torch.Generator(device=input_ids.device).manual_seed(begun.seed)
        return Sequence(begun, self._processors(begun), generator, greedy, input_ids,
                        position if position is not None else torch.zeros(0), 0 if cache is None else int(cache.get_seq_length()),
                        steps=[hidden] if hidden is not None else [],
                        kv=None if cache is None else [(layer.keys, layer.values) for layer in cache.layers],
                        fed=int(input_ids[0, -1]), fresh=cache is None, waiting=waiting)

    def _deferrable(self, prepared: Prepared) -> bool:
        """Whether a prefilled text prompt's first step may be a row of the next batched step: its cache is
        not empty (a one-token prompt has nothing prefilled to stack), and the step keeps the hidden states
        the output reads (those of `layers`; none asked for, none kept)."""
        return prepared.input_ids.shape[1] > 1 and (bool(self.layers) or not prepared.kwargs.get("output_hidden_states"))

    def step(self, rows: list[Row]) -> list[int]:
        states: list[Sequence] = [row.state for row in rows]
        mixed = None
        if fresh := [s for s in states if s.fresh]:
            mixed = self._enter(states, fresh)  # the prompts go with this step's forward, or in one of their own
        changed = self._rows_changed(states)
        if changed and self.positions is not None:  # the rows that stay take their positions from the batch's
            for i, member in enumerate(self.members):
                member.position = self.positions[:, i]
        self._restack(states)
        assert self.cache is not None and self.mask is not None
        device = self.mask.device
        if changed or self.positions is None:  # [rows, B, 1]; else last step's, one on
            self.positions = torch.stack([s.position for s in states], dim=1)
        positions = self.positions
        if mixed is not None:
            out, logits, last = self._mixed(states, mixed, positions)
            hidden = [out.hidden_states[layer][0, last].unsqueeze(1).split(1) for layer in self.layers]
        else:
            tokens = torch.tensor([[s.fed] for s in states], device=device)
            self.mask = torch.cat([self.mask, self.mask.new_ones(len(states), 1)], dim=1)
            out, logits = self._forward(states, tokens, positions)
            hidden = [out.hidden_states[layer].split(1) for layer in self.layers]  # per layer, each row's view
        self.positions = positions + 1
        # greedy rows without processors (generate()'s plain argmax): one argmax for all of them
        plain = [i for i, state in enumerate(states) if state.greedy and not state.processors]
        best = dict(zip(plain, logits[plain].argmax(dim=-1).tolist(), strict=True)) if plain else {}
        picked = []
        for i, state in enumerate(states):
            state.length += 1
            state.waiting = False
            if hidden:
                state.steps.append(tuple(rows[i] for rows in hidden))
            if i in best:
                state.appended.append(best[i])
                state.fed = best[i]
                picked.append(best[i])
            else:
                picked.append(self._pick(state, logits[i : i + 1]))
        return picked

    def _enter(self, states: list[Sequence], fresh: list[Sequence]) -> tuple[mixed_step.Layout, list[torch.Tensor]] | None:
        """The rows that joined since the last step with their prompts yet to prefill: with this step's
        forward where it may take them (mixed_step: each enters the batch with an empty cache), then the
        step's layout and each one's whole prompt positions [4, 1, P]; else prefilled now (None)."""
        layout = mixed_step.Layout([0 if s.fresh else s.length for s in states],
                                   [int(s.sequence.shape[1]) if s.fresh else 1 for s in states])
        if not mixed_step.fits(layout, self.model.config):
            self._prefill(fresh)
            return None
        whole = [generation_positions(self.model, s.sequence) for s in fresh]
        for s, positions in zip(fresh, whole, strict=True):
            s.kv, s.length, s.position = self._empty(s.sequence.device), 0, positions[:, 0, -1:].clone()
        return layout, whole

    def _mixed(self, states: list[Sequence], mixed: tuple[mixed_step.Layout, list[torch.Tensor]],
               positions: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """One forward for the joining prompts whole and the other rows' fed tokens (mixed_step): the model's
        output, the float32 logits [B, V], each row's last token's index in the step's sequence. A joining
        row keeps its cache in the batch's and, where its output reads them, the prompt's hidden states but
        the last token's (as `_prefill`)."""
        layout, whole = mixed
        joining = iter(whole)
        device = self.mask.device if self.mask is not None else states[0].sequence.device
        ids: list[int] = []
        places, starts = [], []
        for i, s in enumerate(states):
            starts.append(len(ids))
            if s.fresh:
                ids.extend(s.sequence[0].tolist())
                places.append(next(joining)[:, 0])
            else:
                ids.append(s.fed)
                places.append(positions[:, i])
        flat = mixed_step.FlatCache(self.cache, layout, device)  # type: ignore[arg-type]
        with mixed_step.mixed(self.model.config.get_text_config(), flat):
            out = self.model.model(input_ids=torch.tensor([ids], device=device), position_ids=torch.cat(places, dim=1)[:, None],
                                   cache=flat, use_cache=True, output_hidden_states=bool(self.layers))
        self.cache, self.mask = flat.stacked()
        last = torch.tensor(layout.last, device=device)
        for s, start in zip(states, starts, strict=True):
            if not s.fresh:
                continue
            size = int(s.sequence.shape[1])
            s.length, s.fresh = size - 1, False
            if s.begun.prepared.kwargs.get("output_hidden_states"):
                s.begun.prepared.hidden = [out.hidden_states[layer][:, start : start + size - 1] for layer in self.layers]
        return out, self.model.lm_head(out.last_hidden_state[0, last]).to(torch.float32), last

    def _empty(self, device: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A cache of no tokens, per layer (a joining row's before a mixed step; made once: never written)."""
        if self.empty is None or self.empty[0][0].device != torch.device(device):
            text = self.model.config.get_text_config()
            size = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
            empty = torch.zeros(1, text.num_key_value_heads, 0, size, dtype=self.model.dtype, device=device)
            self.empty = [(empty, empty)] * text.num_hidden_layers
        return self.empty

    def _prefill(self, states: list[Sequence]) -> None:
        """The prompts of rows that joined since the last step, but their last tokens (the step feeds those),
        in one forward: left-padded to the longest, each with the positions generate() computes for it
        alone (prefill.generation_positions) and the padding masked. Each row keeps its part of the cache
        (stacked into the batch next) and, where its output reads them, the prompt's hidden states."""
        lengths = [int(s.sequence.shape[1]) - 1 for s in states]
        width = max(lengths)
        device = states[0].sequence.device
        whole = [generation_positions(self.model, s.sequence) for s in states]  # [4, 1, P] each
        ids = torch.cat([_pad_ids(s.sequence[:, :-1], width) for s in states])
        positions = torch.cat([_pad_ids(p[..., :-1].reshape(p.shape[0], -1), width)[:, None] for p in whole], dim=1)
        mask = kv_stack.padding_mask(lengths, width, device)
        keep = [bool(s.begun.prepared.kwargs.get("output_hidden_states")) for s in states]
        cache = new_cache(self.model)
        out = self.model.model(input_ids=ids, position_ids=positions, attention_mask=kv_stack.prefill_mask(mask, self.model.config),
                               cache=cache, use_cache=True, output_hidden_states=any(keep) and bool(self.layers))
        for i, s in enumerate(states):
            pad = width - lengths[i]
            s.kv = [(layer.keys[i : i + 1, :, pad:], layer.values[i : i + 1, :, pad:]) for layer in cache.layers]
            s.length, s.position, s.fresh = lengths[i], whole[i][:, 0, -1:].clone(), False
            if keep[i]:  # as prefill.thinker_prefill keeps them: the prefilled tokens' rows of each layer
                s.begun.prepared.hidden = [out.hidden_states[layer][i : i + 1, pad:] for layer in self.layers]

    def _first_step(self, prepared: Prepared) -> tuple[DynamicCache, Any, torch.Tensor, int]:
        """generate()'s first step of a prompt prefilled but its last token (prefill.thinker_prefill), as one
        forward of the language model: (the cache, the step's hidden states of every layer when the
        prepared kwargs ask for them, else None; the float32 logits [1, V]; the rope delta: the next position
        less the cache length). generate() would cost a few ms of set-up a request for the same forward."""
        kwargs = prepared.kwargs
        cache, positions = kwargs["cache"], kwargs["position_ids"]
        keep = bool(kwargs.get("output_hidden_states"))
        out = self.model.model(input_ids=prepared.input_ids[:, -1:], position_ids=positions[..., -1:], cache=cache,
                               use_cache=True, output_hidden_states=keep)
        logits = self.model.lm_head(out.last_hidden_state[:, -1]).to(torch.float32)
        delta = int(positions[1:].max()) + 1 - int(prepared.input_ids.shape[1])  # the 3-D rows' lead over the text row
        return cache, out.hidden_states if keep else None, logits, delta

    #: Position id rows: the thinkers' text row and 3-D rope rows.
    position_rows = 4
    #: A text prompt's first step as one forward of `model.model` and `lm_head` (_first_step).
    direct_first_step = True

    def _rope_delta(self) -> int:
        """What generate() adds to the cache length for the next position (the prompt's rope delta, which
        the model keeps as state between its calls)."""
        delta = getattr(self.model.model, "rope_deltas", None)
        return 0 if delta is None else int(delta.reshape(-1)[0])

    def _forward(self, states: list[Sequence], tokens: torch.Tensor, positions: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """One step of the batch: the model's output and the float32 logits [B, V]."""
        out = self.model.model(
            input_ids=tokens, position_ids=positions, attention_mask=kv_stack.step_mask(self.mask, self.model.config),
            cache=self.cache, use_cache=True, output_hidden_states=bool(self.layers),
        )
        return out, self.model.lm_head(out.last_hidden_state[:, -1]).to(torch.float32)

    def finish(self, row: Row) -> Any:
        state: Sequence = row.state
        if state.waiting:  # cancelled before its first step: nothing to build an output from
            raise PrefillStopped("cancelled before its first token")
        if len(self.members) == 1 and self.members[0] is state:  # the last row leaves: its cache goes now
            self.members, self.cache, self.mask = [], None, None
        return state.begun.output(state.begun.prepared, state.sequence, state.steps)

    def release(self) -> None:
        """The batch is empty: its stacked cache goes."""
        self.members, self.cache, self.mask = [], None, None

    def kv_usage(self, rows: list[Row]) -> tuple[int, int]:
        """(tokens, bytes) of KV cache held now: the stacked batch with its padding, and the caches of rows
        that joined since it was stacked (omni_mesh.engines.batching's gauge)."""
        tokens, size = 0, 0
        if self.cache is not None and self.cache.layers:
            keys = self.cache.layers[0].keys  # [rows, heads, width, head size]
            tokens += int(keys.shape[0] * keys.shape[2])
            size += sum(_nbytes(layer.keys) + _nbytes(layer.values) for layer in self.cache.layers)
        for row in rows:
            state: Sequence = row.state
            if state.kv is not None:
                tokens += state.length
                size += sum(_nbytes(k) + _nbytes(v) for k, v in state.kv)
        return tokens, size

    def _pick(self, state: Sequence, logits: torch.Tensor) -> int:
        """The next token as generate() picks it (`draw`), appended to the row's sequence."""
        state.sequence = draw(state.processors, state.sequence, logits, state.greedy, state.generator)
        state.fed = int(state.sequence[0, -1])
        return state.fed

    def _processors(self, begun: Begun) -> LogitsProcessorList:
        """generate()'s processors for the request; settings known to build none (greedy, most often) are
        remembered: building them costs about a millisecond a request (generate()'s config copies)."""
        key = _settings_key(begun.generation)
        if key is not None and key in self.no_processors:
            return LogitsProcessorList()
        processors = logits_processors(self.model, begun.generation, begun.prepared.input_ids)
        if key is not None and not processors:
            self.no_processors.add(key)
        return processors

    def _rows_changed(self, states: list[Sequence]) -> bool:
        """Whether `states` are not the rows stacked in the batch, in their order (one joined or left)."""
        return len(states) != len(self.members) or any(a is not b for a, b in zip(states, self.members, strict=True))

    def _restack(self, states: list[Sequence]) -> None:
        """The batch's cache stacked anew when its rows are not the ones stacked (a row joined or left):
        changed in place where the rows that stay lead in their order (omni_mesh.engines.kv_stack)."""
        if not self._rows_changed(states):
            return
        index = {id(member): i for i, member in enumerate(self.members)}
        keep = [index[id(s)] for s in states if s.kv is None and id(s) in index]
        kept, joining = states[: len(keep)], states[len(keep) :]
        config = self.model.config.get_text_config()
        if (self.cache is None or self.mask is None or not keep or keep != sorted(keep)
                or any(index.get(id(s)) != i for s, i in zip(kept, keep, strict=True)) or any(s.kv is None for s in joining)):
            rows = [(s.kv, index.get(id(s), -1), s.length) for s in states]
            self.cache, self.mask = kv_stack.stack(rows, self.cache, config)
        else:
            self.cache, self.mask = kv_stack.restack(self.cache, self.mask, keep, [s.length for s in kept],
                                                     [(s.kv, -1, s.length) for s in joining], config)
        for s in states:
            s.kv = None
        self.members = list(states)


#: generate() arguments a prompt prefilled by prefill.thinker_prefill may carry that its first step's
#: forward does not need (stops and flags generate() reads); any other (media) takes generate()'s path.
_PLAIN_KWARGS = frozenset({"cache", "position_ids", "output_hidden_states", "eos_token_id", "use_audio_in_video"})


def _plain_text(prepared: Prepared) -> bool:
    """A text prompt: generate() would get no argument for media."""
    kwargs = prepared.kwargs
    return set(kwargs) <= _PLAIN_KWARGS and not kwargs.get("use_audio_in_video")


def _prefilled_text(prepared: Prepared) -> bool:
    """A text prompt prefilled but its last token, with 4 position rows (text, then 3-D rope)."""
    kwargs = prepared.kwargs
    return (_plain_text(prepared) and "cache" in kwargs and "position_ids" in kwargs
            and kwargs["position_ids"].dim() == 3 and kwargs["position_ids"].shape[0] == 4)


def _pad_ids(x: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, n] -> [rows, width], ones before (ids or positions under the mask's padding: never read)."""
    missing = width - x.shape[1]
    return x if missing == 0 else torch.cat([x.new_ones(x.shape[0], missing), x], dim=1)


def _settings_key(generation: dict[str, Any]) -> tuple | None:
    """Sampling settings as a set member; None when a value is no plain one (a custom processor)."""
    if not all(isinstance(value, (bool, int, float, str, type(None))) for value in generation.values()):
        return None
    return tuple(sorted(generation.items()))


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
