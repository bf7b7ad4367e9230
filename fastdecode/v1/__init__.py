"""Generated protobuf/gRPC stubs for fastdecode.v1 (see protos/)."""
