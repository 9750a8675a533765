"""The command line, ``vision-ckpt``: the only code that prints or exits.

``main`` parses the arguments and turns errors into exit codes; the subcommands (``_measuring``:
profile, plan, suggest; ``_budget``: fit, derive) build the model a spec names with ``_inputs``
and call the layers below.
"""

from .main import main as main

__all__ = ["main"]
