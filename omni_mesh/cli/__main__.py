"""`python -m omni_mesh.cli`, as the benchmarks' tests and scripts/gpu_check.sh run it."""

import sys

from omni_mesh.cli.entry import main

sys.exit(main())
