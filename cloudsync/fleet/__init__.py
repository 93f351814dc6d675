"""The fleet side: the operators' tools (``edgefleet``) and canary rollouts, over the protocol.
It never imports the device agent."""
