"""The runtime: what runs while a model trains.

Owns the bundled checkpoint core (``_core``: the checkpoint functions and the call of one
region; ``_frame``: its saved-tensor hooks and recomputation; ``_call_state``: the RNG,
autocast, kernel settings and BatchNorm statistics a recomputation reinstates;
``_saved_inputs``: how a region's inputs wait; ``_chain``: a region of consecutive calls), the
operator keep policy of selective regions (``_selective``), the exact leaner MLP backward
(``_lean``), what the wrapper needs while torch.compile traces (``_traced``: warnings that keep
the graph, the trace's stack of region levels, regions run between graphs), and the wrapper
with the training level (``wrapper``). It imports the base modules
and the config's levels and schema, never a layer above it.
"""
