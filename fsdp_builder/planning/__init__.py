"""What gets sharded: the wrap policy, the ignored states and the unit plan (no process group
needed)."""
