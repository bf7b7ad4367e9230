"""The wire layer: proto messages to domain objects and back, one module per proto family (gateway,
scheduler, dense, kv). It sits above the cores: it imports them and the generated messages (protobuf),
never gRPC; the services call it and the cores never see a proto. Importing this package loads none
of its modules: the gateway loads wire.gateway and no torch."""
