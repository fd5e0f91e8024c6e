"""Real model parts as stage handlers (docs/engines.md).

    settings        a stage's `engine:` mapping and a request's sampling params (no torch: validate reads them)
    stages          the handlers: ThinkerStage, TalkerStage, Code2WavStage
    models          a checkpoint opened for a stage: its architecture's parts, its tokenizer
    qwen2_5_omni    Qwen2.5-Omni's thinker, talker and token2wav, each loading only its own weights
    qwen3_omni      Qwen3-Omni's thinker, talker and code2wav
    checkpoint      reading one part's tensors from a Hugging Face checkpoint directory
    generation      streamer, stop criterion and sampling (vLLM's penalties) handed to transformers' generate()
    stops           a request's stop strings and stop token ids, as vLLM ends a reply on them
    bridge          a blocking generate() streamed into the event loop
    text            chat template in, token-by-token text deltas out
    tiny            tiny random checkpoints of the real architectures (`omni-mesh models tiny`)
    vision_ops      torchvision importable next to a CPU torch (the processors need it)
"""

from omni_mesh.engines import vision_ops

vision_ops.install()  # before anything here imports transformers' processors (cheap: imports nothing)
