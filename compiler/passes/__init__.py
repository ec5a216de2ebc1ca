"""Relax passes lorac adds to TVM's pipeline (pipeline.py applies them): GEMM dispatch and
its epilogues, precision, the residual stream's storage, fast math, bounded gathers."""
