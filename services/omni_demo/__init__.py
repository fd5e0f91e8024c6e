"""Demo Thinker -> Talker -> Code2Wav pipeline shaped like Qwen-Omni, small enough for a laptop CPU.

Topologies name the handlers as ``services.omni_demo.stages:thinker``, ``...:talker`` and
``...:code2wav``.
"""

from services.omni_demo.stages import code2wav, talker, thinker

__all__ = ["code2wav", "talker", "thinker"]
