"""The requests the batching tests send together: prompts of different lengths, each with its own
reply length (rows leave the batch at different steps)."""

PROMPTS = [
    "hello", "what is the weather like today, in one long sentence please", "a b c", "tell me a story",
    "x", "the quick brown fox jumps over the lazy dog", "one two", "zzz yyy",
]
REPLY_TOKENS = [5, 17, 9, 30, 12, 3, 25, 8]


def chat(prompt: str) -> dict:
    """A request's inputs: one user message."""
    return {"messages": [{"role": "user", "content": prompt}]}


def alone_texts(checkpoint: object, params: dict) -> list[str]:
    """Each prompt's reply text from the thinker's one-request path (transformers' generate()), in this
    process with one torch thread; `params(i)` -> the i-th request's params."""
    import torch

    from omni_mesh.engines.models import open_model
    from omni_mesh.engines.settings import Sampling, parse_engine
    from omni_mesh.engines.text import prompt_ids

    model = open_model(parse_engine({"part": "thinker", "model": str(checkpoint)}, "reference"))
    thinker = model.load("thinker")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        texts = []
        for i, prompt in enumerate(PROMPTS):
            with torch.no_grad():
                out = model.think(thinker, prompt_ids(model.tokenizer, chat(prompt)),
                                  Sampling.of(model.spec, params[i]), None, None)
            texts.append(model.tokenizer.decode(model.reply_ids(out).tolist(), skip_special_tokens=True))
        return texts
    finally:
        torch.set_num_threads(threads)
