"""The runtime: what runs while a model trains.

Owns the bundled checkpoint core (``_core``: regions, recomputation, RNG and BatchNorm
handling), the operator keep policy of selective regions (``_selective``), the exact leaner MLP
backward (``_lean``), and the wrapper with the training level (``wrapper``). It imports the base
modules and the config's levels and schema, never a layer above it.
"""
