"""A worker process's identity, recorded as lease owner."""

import os
import socket


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"
