"""Where a model call runs. The path decision is pure (``conditions``, ``estimates``,
``learned``, ``tiers``, ``decide``); ``router`` runs it, with the I/O (a layer up: the house
test places it with the core). Import the modules (``edged.routing.decide``...): this package
loads nothing, so that a module that needs one of them loads only that one."""
