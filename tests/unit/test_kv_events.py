"""The KV events' encoding (services/scheduler/kv_events.py): vLLM's block hashes (sha256 over
canonical CBOR), its EventBatch as msgspec writes the array_like structs, and the --kv-events address.
The golden bytes and hashes were checked against msgspec encoding vLLM's structs and cbor2."""

from __future__ import annotations

import hashlib

import msgpack
import pytest

from fastdecode.runtime.endpoints import parse_pub_endpoint
from fastdecode.runtime.errors import InvalidInput
from services.scheduler.kv_events import (
    all_blocks_cleared,
    block_removed,
    block_stored,
    cbor,
    encode_batch,
    external,
    none_hash,
    vllm_block_hashes,
)


@pytest.mark.parametrize(
    ("value", "hex_"),
    [  # RFC 8949 appendix A
        (0, "00"),
        (23, "17"),
        (24, "1818"),
        (100, "1864"),
        (1000, "1903e8"),
        (1000000, "1a000f4240"),
        (1000000000000, "1b000000e8d4a51000"),
        (-1, "20"),
        ("a", "6161"),
        (b"\x01\x02", "420102"),
        ((1, 2), "820102"),
        (None, "f6"),
    ],
)
def test_canonical_cbor(value: object, hex_: str) -> None:
    assert cbor(value).hex() == hex_


def test_block_hashes_are_vllms_sha256_cbor() -> None:
    # vLLM: NONE_HASH = sha256_cbor(PYTHONHASHSEED); block = sha256_cbor((parent, tokens, extra_keys))
    root = hashlib.sha256(b"\x61" + b"0").digest()  # CBOR text "0"
    assert none_hash("0") == root
    first = hashlib.sha256(cbor((root, tuple(range(16)), None))).digest()
    hashes = vllm_block_hashes(list(range(32)), 16)
    assert hashes[0] == external(first) == int.from_bytes(first[-8:], "big")
    assert hashes == [12687895063098490012, 1814341696565857452]  # cbor2 and hashlib agree
    assert vllm_block_hashes(list(range(40)), 16)[:2] == hashes  # a partial block has no hash
    salted = vllm_block_hashes(list(range(32)), 16, salt="tenant")
    assert salted[0] != hashes[0] and salted[1] != hashes[1]  # the salt is block 0's extra key
    assert vllm_block_hashes(list(range(32)), 16, seed="1") != hashes


GOLDEN = (  # msgspec.msgpack.encode(KVEventBatch(ts=1.5, events=[...], data_parallel_rank=0))
    "93cb3ff8000000000000939aab426c6f636b53746f726564920102c0dc0020000102030405060708090a0b0c0d0e0f"
    "101112131415161718191a1b1c1d1e1f10c0a3475055c0c0c094ac426c6f636b52656d6f7665649101a3475055c091"
    "b0416c6c426c6f636b73436c656172656400"
)


def test_event_batch_is_msgspecs_array_layout() -> None:
    events = [block_stored([1, 2], None, list(range(32)), 16), block_removed([1]), all_blocks_cleared()]
    payload = encode_batch(1.5, events)
    assert payload.hex() == GOLDEN
    ts, decoded, rank = msgpack.unpackb(payload)
    assert (ts, rank) == (1.5, 0)
    stored, removed, cleared = decoded
    tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name, extra, group = stored
    assert (tag, hashes, parent, tokens, block_size) == ("BlockStored", [1, 2], None, list(range(32)), 16)
    assert (lora_id, medium, lora_name, extra, group) == (None, "GPU", None, None, None)
    assert removed == ["BlockRemoved", [1], "GPU", None]
    assert cleared == ["AllBlocksCleared"]


def test_event_hashes_fit_msgpack_uint64() -> None:
    big = (1 << 64) - 1
    _, [ev], _ = msgpack.unpackb(encode_batch(0.0, [block_stored([big], big, [1], 1)]))
    assert ev[1] == [big] and ev[2] == big


@pytest.mark.parametrize(
    ("address", "bind"),
    [("tcp://*:5557", True), ("tcp://127.0.0.1:5557", False), ("tcp://router.local:1", False)],
)
def test_endpoint(address: str, bind: bool) -> None:
    assert parse_pub_endpoint(address) == (address, bind)


@pytest.mark.parametrize(
    "address", ["", "5557", "tcp://host", "tcp://host:0", "tcp://host:70000", "ipc:///tmp/x", "tcp://a b:1"]
)
def test_bad_endpoint_is_one_clear_error(address: str) -> None:
    with pytest.raises(InvalidInput, match="expected tcp://HOST:PORT"):
        parse_pub_endpoint(address)
