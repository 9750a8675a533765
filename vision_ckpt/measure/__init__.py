"""Measurement: what a training step costs, counted and modelled.

Owns the byte meters (``_memory``: saved bytes, live-storage peaks), one measured training step
(``_measure``), the prediction of a larger batch's peak (``_extrapolate``), the modelled price
of operators (``_price``), where a step peaks and its physical floor (``peak``), and the
models, inputs and losses a step runs on (``models``). It imports the runtime and the regions,
never the tuning layer above it.
"""
