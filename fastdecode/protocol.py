"""Wire-level constants the SDK and the servers agree on. Imports nothing: the SDK uses it without
loading any server module."""

from __future__ import annotations

MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # activations of a large batch fit; anything bigger is a bug

# Channel options of every internal link and of the SDK (which replaces the reconnect backoff).
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]

# Added on the Attend data plane (gpu_dense's channels to the shards, the shards' servers). An HTTP/2
# stream's flow-control window starts at 64 KiB, so a decode item (B=32: 295 KB out, 98 KB back) went
# out in pieces, each waiting on a window update from the peer's poller; with an 8 MiB window it goes
# in one. `bench transport --breakdown`, 5 alternating runs: attend_rt 2.60 -> 2.08 ms, dense CPU per
# round trip 1.54 -> 1.34 ms. A stream holds one item at a time, so no more than that is buffered.
DATA_PLANE_OPTIONS: list[tuple[str, int]] = [("grpc.http2.lookahead_bytes", 8 << 20)]

# Most decode steps one step plan may run a sequence for (the scheduler's --decode-steps; `steps` in
# dense.proto's StepPlan): each is a token the scheduler's stop rules see only after the plan, so a
# stopped sequence wastes at most this many less one.
MAX_DECODE_STEPS = 16

# Most speculative drafts one decode row may carry (`drafts` in dense.proto's StepPlan): a row of
# k + 1 positions costs the shards about one read of its KV while the kernel stays memory-bound.
MAX_DRAFTS = 15

# The gateway's request id rides in this metadata key on every call made for a request; a call made
# for several sequences at once (Reserve, Release) names them all, comma-separated.
REQUEST_ID_KEY = "x-request-id"

# Trailer on every error status the gateway answers itself, so a client can tell them from transport
# failures (a lost connection), which are worth retrying (fastdecode.client).
ERROR_SOURCE_KEY = "fastdecode-error-source"
# Set on an UNAVAILABLE whose cause is a dependency that stayed down (errors.DependencyDown): the
# gateway ends the request instead of resubmitting it to a scheduler that would refuse it again.
DEPENDENCY_DOWN_KEY = "fastdecode-dependency-down"
ERROR_TRAILER = ((ERROR_SOURCE_KEY, "gateway"),)
# The scheduler marks its own answers to Submit the same way: the gateway resubmits a request after
# a lost connection, not after a status the scheduler gave.
SCHEDULER_ERROR_TRAILER = ((ERROR_SOURCE_KEY, "scheduler"),)
