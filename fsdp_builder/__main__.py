"""``python -m fsdp_builder``: the ``fsdp-builder`` command (``torchrun -m fsdp_builder demo``)."""

import sys

from fsdp_builder.tools.cli import main

if __name__ == "__main__":  # ranks the demo spawns import this module without running it
    sys.exit(main())
