"""The requests the batching tests send together: prompts of different lengths, each with its own
reply length (rows leave the batch at different steps)."""

PROMPTS = [
    "hello", "what is the weather like today, in one long sentence please", "a b c", "tell me a story",
    "x", "the quick brown fox jumps over the lazy dog", "one two", "zzz yyy",
]
REPLY_TOKENS = [5, 17, 9, 30, 12, 3, 25, 8]
