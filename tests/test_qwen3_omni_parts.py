"""Qwen3-Omni's three parts, each loaded alone from a tiny random checkpoint of the real architecture,
against `Qwen3OmniMoeForConditionalGeneration.generate()` on the same checkpoint.

What is compared with generate() (greedy): its thinker is greedy through `thinker_do_sample=False`, its
talker (which samples by default) through `talker_do_sample=False` (generate() mirrors it onto the code
predictor); `thinker_eos_token_id` is this checkpoint's <|im_end|> (generate()'s default is the real
model's id). Its text ids are compared with the thinker's reply, the codes it hands to code2wav
(caught at `code2wav.chunked_decode`) with the talker's, its waveform with code2wav's decode.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from omni_mesh.engines.checkpoint import CheckpointError  # noqa: E402
from omni_mesh.engines.qwen3_omni import TALKER_INPUT_KEYS, Qwen3OmniTalker  # noqa: E402
from omni_mesh.engines.qwen3_omni_code2wav import Qwen3OmniCode2Wav  # noqa: E402
from omni_mesh.engines.qwen3_omni_thinker import Qwen3OmniThinker  # noqa: E402
from omni_mesh.engines.tiny_qwen3_omni import CODE_GROUPS, CODEBOOK, build_tiny_qwen3_omni  # noqa: E402

F32 = torch.float32
PCM_STEP = 1 / 32768
MAX_TOKENS = 24
MAX_CODES = 60
#: Conversations, each with a speaker: a user turn with an audio placeholder (the talker reads the
#: thinker's hidden state for it), and a text-only one with an earlier assistant turn (not spoken again).
CASES = {
    "audio": ("Ethan", [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, how are you today? <|audio_start|><|audio_pad|><|audio_end|>"},
    ]),
    "text": ("Chelsie", [
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi, how are you?"},
        {"role": "user", "content": "Fine, thank you. What a lovely day it is."},
    ]),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test of the module with torch on one thread (conftest.one_torch_thread)."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3_omni")
    build_tiny_qwen3_omni(directory, seed=0)
    return directory


@pytest.fixture(scope="module")
def prompts(tiny) -> dict[str, torch.Tensor]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny))
    texts = {case: tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
             for case, (_, messages) in CASES.items()}
    return {case: tokenizer(text, return_tensors="pt")["input_ids"] for case, text in texts.items()}


@pytest.fixture(scope="module")
def prompt(prompts) -> torch.Tensor:
    return prompts["audio"]


@pytest.fixture(scope="module")
def whole(tiny):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(tiny)).eval()


@pytest.fixture(scope="module")
def reference(whole, prompts, tmp_path_factory) -> dict:
    """The one-call generate() on the checkpoint, greedy, and a sharded copy of the checkpoint that
    the parts load from (so the index path is the one under test)."""
    model = whole
    sharded = tmp_path_factory.mktemp("qwen3_omni_sharded")
    model.save_pretrained(str(sharded), max_shard_size="400KB")
    assert (sharded / "model.safetensors.index.json").exists()

    caught: list[torch.Tensor] = []
    chunked_decode = model.code2wav.chunked_decode

    def catch(codes, *args, **kwargs):
        caught.append(codes.clone())
        return chunked_decode(codes, *args, **kwargs)

    model.code2wav.chunked_decode = catch
    runs = {}
    for case, (speaker, _) in CASES.items():
        prompt = prompts[case]
        caught.clear()
        with torch.no_grad():
            sequences, wav = model.generate(
                input_ids=prompt, speaker=speaker,
                thinker_max_new_tokens=MAX_TOKENS, thinker_eos_token_id=model.config.im_end_token_id,
                thinker_do_sample=False, talker_do_sample=False, talker_max_new_tokens=MAX_CODES + 1,
            )
        runs[case] = {
            "reply": sequences[0, prompt.shape[1]:],
            "codes": caught[0][0].T,  # [1, G, T] -> [T, G]
            "wav": wav.reshape(-1),
        }
    return {"runs": runs, "sharded": sharded}


@pytest.fixture(scope="module")
def parts(reference) -> tuple[Qwen3OmniThinker, Qwen3OmniTalker, Qwen3OmniCode2Wav]:
    sharded = reference["sharded"]
    return (
        Qwen3OmniThinker.load(sharded, F32, "cpu"),
        Qwen3OmniTalker.load(sharded, F32, "cpu"),
        Qwen3OmniCode2Wav.load(sharded, F32, "cpu"),
    )


def _only(tiny: Path, prefixes: tuple[str, ...], directory: Path, drop: str = "") -> Path:
    """A copy of the checkpoint keeping only the tensors under `prefixes` (less any key containing `drop`)."""
    directory.mkdir()
    shutil.copy(tiny / "config.json", directory / "config.json")
    tensors = load_file(str(tiny / "model.safetensors"))
    kept = {k: v for k, v in tensors.items() if k.startswith(prefixes) and not (drop and drop in k)}
    save_file(kept, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.mark.parametrize(
    ("cls", "prefix"),
    [(Qwen3OmniThinker, "thinker."), (Qwen3OmniTalker, "talker."), (Qwen3OmniCode2Wav, "code2wav.")],
)
def test_each_part_loads_from_its_own_weights_alone(tiny, whole, tmp_path, cls, prefix):
    part = cls.load(_only(tiny, (prefix,), tmp_path / "alone"), F32, "cpu")
    # every tensor as the whole model loads it (its MoE experts fused, its keys renamed as transformers does)
    expected = getattr(whole, prefix[:-1]).state_dict()
    state = part.model.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[key], expected[key]) for key in expected)


def test_a_part_with_missing_weights_names_them(tiny, tmp_path):
    broken = _only(tiny, ("thinker.", "talker.", "code2wav."), tmp_path / "broken", drop="code2wav.decoder.6")
    with pytest.raises(CheckpointError, match=r"missing: decoder\.6\.conv\.bias, decoder\.6\.conv\.weight") as error:
        Qwen3OmniCode2Wav.load(broken, F32, "cpu")
    assert str(broken) in str(error.value)
    # the other parts do not care
    Qwen3OmniThinker.load(broken, F32, "cpu")

    none = _only(tiny, ("thinker.", "talker."), tmp_path / "no_code2wav")
    with pytest.raises(CheckpointError, match="no weights under 'code2wav.'"):
        Qwen3OmniCode2Wav.load(none, F32, "cpu")


@pytest.mark.parametrize("case", list(CASES))
def test_split_parts_equal_generate(reference, parts, prompts, case):
    thinker, talker, code2wav = parts
    speaker, prompt, expected = CASES[case][0], prompts[case], reference["runs"][case]
    tokens: list[int] = []
    output = thinker.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, on_token=tokens.append)
    assert torch.equal(output["reply_ids"], expected["reply"])
    assert tokens == output["reply_ids"].tolist()  # once per token, in order
    assert int(output["user_multimodal"].sum()) == (case == "audio")  # a placeholder: the hidden-state path
    assert set(output) == {"reply_ids", *TALKER_INPUT_KEYS}

    frames: list[torch.Tensor] = []
    codes = talker.generate(output, max_codes=MAX_CODES, temperature=0.0, speaker=speaker, on_codes=frames.append)
    assert codes.dtype == torch.int64 and codes.shape[1] == CODE_GROUPS
    assert torch.equal(codes, expected["codes"])
    assert torch.equal(torch.cat(frames), codes) and all(f.shape == (1, CODE_GROUPS) for f in frames)
    assert 0 < len(codes) <= MAX_CODES and int(codes.max()) < CODEBOOK

    wav = code2wav.decode(codes)
    assert wav.dtype == torch.float32 and wav.shape == expected["wav"].shape
    assert float(wav.abs().max()) > 100 * PCM_STEP  # audible: the comparison below is not vacuous
    assert float((wav - expected["wav"]).abs().max()) <= 2 * PCM_STEP


def test_streamed_code2wav_equals_one_shot(parts):
    code2wav = parts[2]
    codes = torch.randint(0, CODEBOOK, (113, CODE_GROUPS), generator=torch.Generator().manual_seed(3))
    one_shot = code2wav.decode(codes)
    assert len(one_shot) == 113 * code2wav.samples_per_frame - code2wav.conv.loss
    for chunk_frames, feed in [(25, 1), (25, 7), (4, 30), (1, 2)]:
        stream = code2wav.stream(chunk_frames=chunk_frames)
        pieces = [stream.feed(codes[i:i + feed]) for i in range(0, len(codes), feed)]
        streamed = torch.cat([*pieces, stream.finish()])
        assert streamed.shape == one_shot.shape, (chunk_frames, feed)
        assert float((streamed - one_shot).abs().max()) <= 1e-5, (chunk_frames, feed)
    # the reference's way (25 frames of context, the context's audio cut off) drops samples per boundary;
    # too little context to cover the samples not yet made is refused rather than leaving gaps
    with pytest.raises(ValueError, match="left_context"):
        code2wav.stream(left_context=0)


def test_should_stop_stops_thinker_and_talker(parts, prompt):
    thinker, talker, _ = parts
    tokens: list[int] = []
    output = thinker.generate(prompt, max_tokens=MAX_TOKENS, on_token=tokens.append, should_stop=lambda: len(tokens) >= 3)
    # generate() checks its stopping criteria before it streams the step's token: one more may come
    assert len(output["reply_ids"]) in (3, 4) and tokens == output["reply_ids"].tolist()

    full = thinker.generate(prompt, max_tokens=8)
    frames: list[torch.Tensor] = []
    codes = talker.generate(full, max_codes=MAX_CODES, temperature=0.0, on_codes=frames.append,
                            should_stop=lambda: len(frames) >= 5)
    assert len(codes) == 5


def test_thinker_eos_ends_the_reply_and_the_text(parts, prompt):
    """With an eos the thinker really emits, it stops there and tells the talker where the text ends."""
    thinker = parts[0]
    free = thinker.generate(prompt, max_tokens=MAX_TOKENS)["reply_ids"]
    stop = int(free[4])
    original = thinker.eos_token_ids
    thinker.eos_token_ids = [stop]
    try:
        output = thinker.generate(prompt, max_tokens=MAX_TOKENS)
    finally:
        thinker.eos_token_ids = original
    end = free.tolist().index(stop)
    assert output["reply_ids"].tolist() == free[: end + 1].tolist()
    assert output["text_end"] == end


def test_sampled_talker_is_seeded_and_valid(parts, prompt):
    thinker, talker, _ = parts
    output = thinker.generate(prompt, max_tokens=6)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(talker.generate(output, max_codes=20, temperature=0.9, top_p=0.95))
    assert torch.equal(runs[0], runs[1]) and int(runs[0].max()) < CODEBOOK


def test_talker_refuses_what_is_not_a_thinker_output(parts):
    with pytest.raises(ValueError, match="lacks"):
        parts[1].generate({"reply_ids": torch.zeros(2, dtype=torch.long)}, max_codes=4)
    with pytest.raises(ValueError, match="speaker"):
        parts[1].speaker_id("nobody")


def test_checkpoint_files_and_seeded_build(tiny, tmp_path):
    config = json.loads((tiny / "config.json").read_text())
    assert config["talker_config"]["text_config"]["vocab_size"] > 1024
    assert (tiny / "generation_config.json").exists() and (tiny / "tokenizer.json").exists()
    # the same seed, the same weights (the talker's experts, which transformers leaves uninitialised, too)
    build_tiny_qwen3_omni(tmp_path, seed=0)
    assert (tmp_path / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parts_on_cuda_equal_generate_on_cuda(tiny, whole, prompts, dtype):
    """The same comparison on a GPU, in float32 and bfloat16 (the parts and generate() on one device)."""
    model = type(whole).from_pretrained(str(tiny), dtype=dtype).to("cuda:0").eval()
    caught: list[torch.Tensor] = []
    chunked_decode = model.code2wav.chunked_decode
    model.code2wav.chunked_decode = lambda codes, *a, **k: (caught.append(codes.cpu()), chunked_decode(codes, *a, **k))[1]
    prompt = prompts["text"]
    with torch.no_grad():
        sequences, wav = model.generate(
            input_ids=prompt.to("cuda:0"), thinker_max_new_tokens=12, thinker_eos_token_id=model.config.im_end_token_id,
            thinker_do_sample=False, talker_do_sample=False, talker_max_new_tokens=41,
        )
    thinker = Qwen3OmniThinker.load(tiny, dtype, "cuda:0")
    talker = Qwen3OmniTalker.load(tiny, dtype, "cuda:0")
    code2wav = Qwen3OmniCode2Wav.load(tiny, dtype, "cuda:0")
    output = thinker.generate(prompt, max_tokens=12)
    codes = talker.generate(output, max_codes=40, temperature=0.0)
    ours = code2wav.decode(codes)
    assert output["reply_ids"].tolist() == sequences[0, prompt.shape[1]:].cpu().tolist()
    assert torch.equal(codes, caught[0][0].T)
    assert ours.shape == wav.reshape(-1).shape
    assert float((ours - wav.reshape(-1).cpu()).abs().max()) <= 2 * PCM_STEP


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
@pytest.mark.xfail(strict=False, reason="on an H200 in float32 the streamed decode drifts from the one-shot "
                   "decode along the sequence (6.2e-3 at most; 1e-9 at the start), with cuDNN TF32 on or off; "
                   "on CPU it is 1.3e-7. Not understood yet: see docs/engines.md")
def test_streamed_code2wav_equals_one_shot_on_cuda(tiny, parts, prompts):
    thinker, talker, _ = parts
    code2wav = Qwen3OmniCode2Wav.load(tiny, torch.float32, "cuda:0")
    codes = talker.generate(thinker.generate(prompts["text"], max_tokens=12), max_codes=40, temperature=0.0)
    ours = code2wav.decode(codes)
    stream = code2wav.stream(chunk_frames=5)
    streamed = torch.cat([*[stream.feed(codes[i:i + 3]) for i in range(0, len(codes), 3)], stream.finish()])
    assert float((streamed - ours).abs().max()) <= 1e-5
