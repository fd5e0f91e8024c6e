"""The Qwen2.5-Omni parts on a GPU equal the library's one-call generate() on the same GPU.

Needs CUDA: skipped with the reason where there is none (this project's CI machines). Run on a lent
GPU machine with `python -m pytest tests/test_engines_cuda.py` (it imports only the engines).
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_parts_on_cuda_equal_generate_on_cuda(tmp_path: Path, dtype: str) -> None:
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    from omni_mesh.engines.qwen2_5_omni import Talker, Thinker, Token2Wav
    from omni_mesh.engines.tiny import build_tiny

    checkpoint = build_tiny("qwen2_5_omni", tmp_path / "tiny")
    torch_dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello on a GPU"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch_dtype).to("cuda:0").eval()
    talker_ref = Talker(model.talker, model.config)
    torch.manual_seed(5)
    sequences, wav = model.generate(
        ids.to("cuda:0"), thinker_max_new_tokens=6, thinker_do_sample=False, talker_do_sample=False,
        talker_max_new_tokens=40, talker_eos_token_id=talker_ref.stop_ids,
        talker_logits_processor=talker_ref.logits_processor(),
    )
    thinker = Thinker.load(checkpoint, torch_dtype, "cuda:0")
    talker = Talker.load(checkpoint, torch_dtype, "cuda:0")
    token2wav = Token2Wav.load(checkpoint, torch_dtype, "cuda:0")
    assert next(thinker.model.parameters()).is_cuda and next(token2wav.model.parameters()).dtype == torch.float32
    output = thinker.generate(ids, max_tokens=6, temperature=0)
    codes = talker.generate(output.to_payload(), max_codes=40, temperature=0)
    ours = token2wav.decode(codes, seed=5)
    assert output.reply_ids.tolist() == sequences[0, ids.shape[1] :].cpu().tolist()
    assert ours.shape == wav.shape
    assert (ours - wav.cpu()).abs().max().item() <= 2 / 32768
