"""The CUDA build's own schedule rules, tried before DLight's (_gpu_schedule.py)."""
from __future__ import annotations


def first_rules() -> tuple:
    """lorac's CUDA schedule rules, tried before DLight's (compiler/targets/_gpu_schedule.py)."""
    from .._gpu_schedule import VectorizedElementwise, WarpRowReduction

    return (VectorizedElementwise(), WarpRowReduction())
