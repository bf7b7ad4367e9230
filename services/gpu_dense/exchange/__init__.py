"""gpu_dense's exchange: one layer's q, k, v to the kv_attention shards and each o back, every way it
goes. The step runner (fastdecode/dense/runner.py) reaches it only through the plane it declares,
`LayerPlane` (attend_layer, and the capabilities attend_layer_at, attend_layer_blocking, staging,
each None where a plane has none); the servicer drives the wider `ShardPlaneService` (service.py).

- service.py: ShardPlaneService, what the servicer asks of a plane (add, remove, restore shards);
  ShardAddress, a shard as Info reports it.
- connect.py: the plane for a fleet's settings: in-process links (exchange_workers 0) or K workers;
  `connect` is registered as the `grpc` shard plane (pyproject.toml) for the benchmarks.
- links.py: ShardLinks, the Attend streams in this process (one AttendLink per shard).
- plane.py: ExchangePlane, the Attend streams in K worker processes: each layer handed over in
  shared memory, on the event loop (attend_layer, attend_layer_at) or from a slot's thread
  (attend_layer_blocking).
- process.py: the dense side's handle on one worker process; slices.py: a layer's items as arena
  slices, and each answer back as o; messages.py: the control messages (exchange.proto);
  transport.py: the arenas, the control socket, the slots' blocking sockets.
- worker.py: the Python worker (`python -m services.gpu_dense.exchange.worker`: links.py's
  ShardLinks on an event loop); native/: the C++ one, the default where `make setup` built it.
- host_shard.py: one shard served in this process (`--host-shard`), the others behind either plane.

Nothing here is imported by the package itself: the Python worker loads only what it runs.
"""
