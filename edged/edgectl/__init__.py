"""``edgectl``, edged's operator command line: one module per command group.

``parser`` builds the command line and runs a command (``main``, the console script); ``base``
holds what the groups share (exit codes, reading input files, tables, the global flags'
request parameters); ``status``, ``admin``, ``models``, ``inference``, ``tasks`` and ``kb`` hold
the commands; ``edgectl top``'s live loop is ``edged.top_live``, beside its renderer
``edged.top``.
"""

from edged.edgectl.parser import build_parser, main

__all__ = ["build_parser", "main"]
