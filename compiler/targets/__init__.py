"""One module or package per target family, found by name (pipeline.FAMILIES); modules whose
names start with "_" are helpers shared by several targets. The interface a target module
offers is pipeline.py's docstring."""
