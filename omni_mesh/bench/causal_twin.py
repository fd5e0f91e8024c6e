"""A plain `Qwen2ForCausalLM` with a Qwen2.5-Omni thinker's language model copied in: what
`transformers serve --continuous-batching` can load (it batches plain causal LMs only and cannot load
an Omni checkpoint), so `omni-mesh bench thinker` measures both servers on the same weights.

For text, the thinker's 3-D rope reduces to 1-D positions (the three rows are equal), so the twin's
greedy ids are the thinker's: `same_greedy_ids` checks that before any figure is taken.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

#: The thinker's language model in an Omni checkpoint -> the causal LM's names.
PREFIXES = {"thinker.model.": "model.", "thinker.lm_head.": "lm_head."}
#: What the tokenizer and chat template need, copied as they are.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                   "vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json")


def build_twin(checkpoint: Path, directory: Path) -> Path:
    """`directory` made a Qwen2ForCausalLM checkpoint with `checkpoint`'s thinker language model, its
    tokenizer and eos/pad ids. ValueError when `checkpoint` holds no Qwen2.5-Omni thinker."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((checkpoint / "config.json").read_text())
    text = config.get("thinker_config", {}).get("text_config")
    if config.get("model_type") != "qwen2_5_omni" or text is None:
        raise ValueError(f"{checkpoint}: not a Qwen2.5-Omni checkpoint (model_type {config.get('model_type')!r}); "
                         "the causal twin is built from a Qwen2.5-Omni thinker")
    tensors: dict[str, Any] = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(path), "pt") as weights:
            for key in weights.keys():  # noqa: SIM118 - safe_open is not a mapping
                for old, new in PREFIXES.items():
                    if key.startswith(old):
                        tensors[new + key[len(old):]] = weights.get_tensor(key)
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError(f"{checkpoint}: no thinker.model.* weights in its *.safetensors")
    # the thinker's own lm_head, whatever its text config says of tying (the tiny one's is untied)
    tied = "lm_head.weight" not in tensors
    directory.mkdir(parents=True, exist_ok=True)
    save_file({key: value.contiguous() for key, value in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({**_causal_config(text), "tie_word_embeddings": tied}, indent=2))
    generation = {"eos_token_id": text.get("eos_token_id"), "pad_token_id": text.get("pad_token_id")}
    (directory / "generation_config.json").write_text(json.dumps(generation))
    for name in TOKENIZER_FILES:
        if (checkpoint / name).exists():
            shutil.copy(checkpoint / name, directory / name)
    settings = directory / "tokenizer_config.json"
    if settings.exists():  # a plain tokenizer: transformers serve would load the Omni processor (images, video)
        tokenizer = json.loads(settings.read_text())
        tokenizer.pop("processor_class", None)
        settings.write_text(json.dumps(tokenizer, indent=2))
    return directory


def _causal_config(text: dict) -> dict:
    """A Qwen2Config from the thinker's text config: the same sizes, 1-D rope with its theta."""
    keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "hidden_act", "max_position_embeddings", "rms_norm_eps", "vocab_size", "tie_word_embeddings",
            "eos_token_id", "pad_token_id", "bos_token_id", "attention_dropout", "dtype", "torch_dtype")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        **{key: text[key] for key in keep if text.get(key) is not None},
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "use_sliding_window": False, "sliding_window": None, "use_cache": True,
    }


def same_greedy_ids(checkpoint: Path, twin: Path, prompt: str, max_tokens: int) -> dict[str, Any]:
    """The thinker stage's one-request path (transformers' generate() through omni_mesh.engines) and the
    twin's generate(), greedy, on `prompt` as a chat: both reply ids, and whether they are equal."""
    import torch
    from transformers import AutoModelForCausalLM

    from omni_mesh.engines.models import open_model
    from omni_mesh.engines.settings import Sampling, parse_engine
    from omni_mesh.engines.text import prompt_ids

    model = open_model(parse_engine({"part": "thinker", "model": str(checkpoint)}, "bench-thinker"))
    thinker = model.load("thinker")
    ids = prompt_ids(model.tokenizer, {"messages": [{"role": "user", "content": prompt}]})
    with torch.no_grad():
        output = model.think(thinker, ids, Sampling.of(model.spec, {"temperature": 0, "max_tokens": max_tokens}),
                             None, None)
        ours = [int(t) for t in model.reply_ids(output).tolist()]
        causal = AutoModelForCausalLM.from_pretrained(str(twin)).eval()
        generated = causal.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    theirs = [int(t) for t in generated[0, ids.shape[1]:].tolist()]
    return {"prompt_tokens": int(ids.shape[1]), "thinker": ours, "twin": theirs, "equal": ours == theirs}
