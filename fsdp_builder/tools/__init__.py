"""Tools around the library: the command line, the demo, memory estimates, the dry run and the
local launcher."""
