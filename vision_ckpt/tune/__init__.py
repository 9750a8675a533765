"""Tuning: choosing levels and plans from measurements.

Owns the profile of every level and the lowest level that fits (``profile``, ``_search``), the
per-block planner for a budget (``_planner``, ``_optimise``), the largest batch that fits
(``fit``), and levels derived by measurement for any model (``derive``, with the candidate
spans of a traced forward in ``_spans``). It imports every layer below; only the integrations
and the command line sit above it.
"""
