"""The fleet secret: parsing, accepted set for rotation, sources, and that it never prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.fleet_secret import FleetSecret, generate_secret, load_fleet_secret, write_secret_file
from fastdecode.runtime.settings import SchedulerSettings

NEW, OLD = "n" * 20 + "new", "o" * 20 + "old"


def test_first_line_is_sent_every_line_accepted() -> None:
    s = FleetSecret.parse(f"{NEW}\n\n{OLD}\n", "test")
    assert s.send == NEW
    assert s.matches(NEW) and s.matches(OLD.encode()) and not s.matches(NEW + "x") and not s.matches(None)
    assert NEW not in repr(s) and OLD not in repr(s)


@pytest.mark.parametrize("text", ["", "\n \n", "short", "é" * 20, "tab\tinside-the-secret-value"])
def test_bad_secrets_are_one_clear_error(text: str) -> None:
    with pytest.raises(InvalidInput):
        FleetSecret.parse(text, "test")


def test_file_wins_over_env_and_is_private(tmp_path: Path) -> None:
    path = write_secret_file(tmp_path / "fleet.secret", generate_secret())
    assert path.stat().st_mode & 0o077 == 0
    from_file = load_fleet_secret(NEW, path)
    assert from_file is not None and from_file.send == path.read_text().strip()
    from_env = load_fleet_secret(f"{NEW},{OLD}", None)
    assert from_env is not None and from_env.send == NEW and from_env.matches(OLD)
    assert load_fleet_secret(None, None) is None
    with pytest.raises(InvalidInput, match="cannot read"):
        load_fleet_secret(None, tmp_path / "missing")


def test_settings_carry_the_secret_to_links_and_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTDECODE_FLEET_SECRET", NEW)
    s = SchedulerSettings(dense="a:1", shards="b:2")
    assert s.tls.secret is not None and s.tls.secret.send == NEW
    assert NEW not in repr(s) and NEW not in repr(s.tls)
