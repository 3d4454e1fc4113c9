"""Materializers: how a unit on the meta device gets storage and values.

`initializers` holds the protocol, the base class and the init strategies; `sharded` the
shard-first ones; `loading` and `checkpoints` the loaders; `buffers` computes non-persistent
buffers; `nonfinite` the NaN/inf policy of loads.
"""
