"""lorac.runtime: loads artifacts, trains, checkpoints, exports."""
