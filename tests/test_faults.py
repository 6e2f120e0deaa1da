"""Fault injection: real processes killed at every step, concurrent runs, leftovers.

Each test function belongs to one guarantee of ``docs/reliability.md``.
"""
