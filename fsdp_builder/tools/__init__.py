"""Tools around the library: the command line, the demo, memory estimates, the local launcher
and the export of a sharded model to Hugging Face files."""
