"""Tenants fail closed: a keys file that yields no keys never turns authentication off."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from fastdecode.gateway.auth import Tenants

ALICE = "Bearer alice-key-0001"


def test_no_token_and_no_file_is_off() -> None:
    t = Tenants()
    assert not t.enabled
    assert t.tenant_of("") == ""


@pytest.mark.parametrize("text", ["", "\n\n", "# tenant key\n# bob bob-key-0002\n"])
def test_a_file_without_keys_at_start_admits_nobody(
    tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys"
    path.write_text(text)
    with caplog.at_level(logging.WARNING, "fastdecode.gateway.auth"):
        t = Tenants(keys_file=path)
    assert t.enabled
    for header in ["", "Bearer ", ALICE, "Basic abc"]:
        assert t.tenant_of(header) is None
    assert "holds no keys; no request is admitted" in caplog.text
    path.write_text("alice alice-key-0001\n")
    t.reload()
    assert t.tenant_of(ALICE) == "alice"


@pytest.mark.parametrize("text", ["", "# every key revoked\n"])
def test_a_reload_without_keys_keeps_the_old_ones(
    tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys"
    path.write_text("alice alice-key-0001\n")
    t = Tenants(keys_file=path)
    path.write_text(text)
    with caplog.at_level(logging.WARNING, "fastdecode.gateway.auth"):
        t.reload()
    assert t.tenant_of(ALICE) == "alice"
    assert t.tenant_of("Bearer wrong-key-0000") is None
    assert t.tenant_of("") is None
    assert "the old ones stay" in caplog.text


def test_the_token_alone_with_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("")
    t = Tenants(b"the-default-token", path)
    assert t.tenant_of("Bearer the-default-token") == "default"
    assert t.tenant_of("Bearer other") is None
