"""The move step's former module: it is ``move_unit_states`` in ``runtime/tree.py`` now, and this
path (and ``fsdp_builder.moving``, the one before it) still imports it."""

from fsdp_builder.runtime.tree import CPU, move_unit_states

__all__ = ["CPU", "move_unit_states"]
