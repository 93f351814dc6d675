"""Open Inference Protocol gRPC (Triton's GRPCInferenceService) on a Unix socket.

The service definition is Triton's own, from tritonclient, so ``tritonclient.grpc`` and any
other client generated from Triton's protos works unchanged: ``InferenceServerClient(
"unix:///run/edged/edged-grpc.sock")``. Like the REST adapter this is thin: every call goes to
the same ``DataPlane``. A gRPC deadline becomes the request's timeout in the scheduler.

Access: the same checks as on REST (``edged.server.access``): ``server.allowed_uids``/
``allowed_gids`` on every call, admin for RepositoryModelLoad/Unload. grpc itself says nothing
of a Unix-socket caller: ``context.peer()`` is ``"unix:"`` and the auth context holds only the
transport's security type, with insecure and with local (UDS) credentials alike. So edged
accepts each connection on the public socket itself, reads the caller's credentials there
(SO_PEERCRED, SO_PEERGROUPS) and relays the connection's bytes, unparsed, to grpc's server on a
socket in a 0700 directory only edged can enter, from a client socket bound to a name of its
own (``p<n>``, never reused in a run). grpc reports that name as the call's peer
(``unix:<dir>/p<n>``), and it maps back to the caller. A call whose peer is not one of the
relay's is refused whatever it asks (fail closed).

The package: ``servicer`` (the service over the data plane) and ``relay`` (the public socket,
the callers' credentials, grpc's own server). It loads nothing itself.
"""
