"""Typed settings shared by every service: flags first, then FASTDECODE_* environment variables."""

from __future__ import annotations

import logging
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from fastdecode.logs import configure_logging
from fastdecode.rpc import TLSFiles


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FASTDECODE_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    metrics_port: int | None = Field(None, ge=0, le=65535)
    grace_seconds: float = Field(20.0, ge=0)
    log_level: str = "INFO"
    log_json: bool = False
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    threads: int | None = Field(None, ge=1, description="torch intra-op threads")

    @property
    def tls(self) -> TLSFiles:
        return TLSFiles(self.tls_cert, self.tls_key, self.tls_ca)

    def configure_logging(self, name: str) -> logging.Logger:
        return configure_logging(name, self.log_level, self.log_json)


def split_addresses(value: str | list[str]) -> list[str]:
    if isinstance(value, list):
        return [v.strip() for v in value if v.strip()]
    return [v.strip() for v in value.split(",") if v.strip()]
