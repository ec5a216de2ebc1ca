"""The runtime's name for lorac's one user-facing error type, which lives in lorac.core
(core/errors.py) so that graphs and compiler raise the same class without importing the
runtime."""
from lorac.core.errors import LoracError

__all__ = ["LoracError"]
