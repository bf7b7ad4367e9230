"""What the unit tier may not do: start a process or open a port (tests/unit/conftest.py applies it)."""

from __future__ import annotations

import asyncio
import multiprocessing.process
import os
import socket
import subprocess
from typing import Any

import grpc
import grpc.aio


class ProcessOrPortInUnitTest(AssertionError):
    """A unit test started a process or opened a port."""


def refuse(what: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ProcessOrPortInUnitTest(f"unit tests start no process and open no port: {what}")

    return refuse


GUARDED: list[tuple[object, str]] = [
    (subprocess.Popen, "__init__"),  # subprocess.run, check_output, ... all go through it
    (os, "fork"),
    (os, "forkpty"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
    (os, "system"),
    (os, "execv"),
    (os, "execve"),
    (multiprocessing.process.BaseProcess, "start"),
    (asyncio, "create_subprocess_exec"),
    (asyncio, "create_subprocess_shell"),
    (socket.socket, "bind"),
    (socket.socket, "listen"),
    (socket.socket, "connect"),
    (socket.socket, "connect_ex"),
    (grpc, "server"),  # gRPC binds its ports in C, past the socket module
    (grpc.aio, "server"),
]
