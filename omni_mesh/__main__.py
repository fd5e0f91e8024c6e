import sys

from omni_mesh.cli import main

sys.exit(main())
