"""``python -m fsdp_builder.cli``, the command's module path of earlier releases: warns, then
runs ``fsdp_builder.tools.cli`` (use ``fsdp-builder`` or ``python -m fsdp_builder``)."""

import sys

from fsdp_builder.moved import warn_moved

warn_moved("fsdp_builder.cli", "fsdp_builder.tools.cli")

from fsdp_builder.tools.cli import main  # noqa: E402  (after the warning, as the old path ran)

if __name__ == "__main__":
    sys.exit(main())
