"""`python -m omni_mesh.stage TOPOLOGY --stage NAME ...`: the same as `omni-mesh stage ...`."""

import sys

from omni_mesh.cli.entry import main

sys.exit(main(["stage", *sys.argv[1:]]))
