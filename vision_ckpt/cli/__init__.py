"""The command line, ``vision-ckpt``: the only code that prints or exits.

``main`` parses the arguments, builds the model a spec names and calls the layers below.
"""

from .main import main as main

__all__ = ["main"]
