"""Portable persistent decode kernels (K1/K2) in Triton; see ``backend.py``.

Importing this package imports nothing heavy: ``config`` is pure Python, the kernels and the
backend import triton and torch when they are imported themselves.
"""
