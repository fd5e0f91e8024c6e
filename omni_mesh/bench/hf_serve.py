"""`python -m omni_mesh.bench.hf_serve ARGS`: `transformers serve ARGS` in processes whose torchvision
imports on a CPU torch (omni_mesh.engines.vision_ops; transformers' loading imports it). At module level:
serve's engine process (multiprocessing, spawned) imports this module again, as `__mp_main__`."""

from __future__ import annotations

import sys

import omni_mesh.engines  # noqa: F401 - installs the torchvision finder before transformers imports it

if __name__ == "__main__":
    from transformers.cli.transformers import main

    sys.argv = ["transformers", "serve", *sys.argv[1:]]
    main()
