"""Rendezvous ports, drawn below Linux's ephemeral range (32768-60999 by default).

The OS hands the ports of outgoing connections (gloo's own pairs, other runs on the machine) out of the ephemeral
range, so a port probed free there can be taken before rank 0 binds it; one below it is taken only by another
program that asks for it by number.
"""
from __future__ import annotations

import random
import socket
import zlib

PORT_BASE = 20000
PORT_SPAN = 12000  # 20000..31999
PROBES = 64


def port_for_job(job_id: str) -> int:
    """A rendezvous port every task of job `job_id` computes alike."""
    return PORT_BASE + zlib.crc32(str(job_id).encode()) % PORT_SPAN


def free_local_port() -> int:
    """A port of this machine's that nothing holds now, for a run whose ranks all start here (rank 0 binds it while
    it starts the others). At random in the span, so concurrent runs rarely probe the same one; the OS's pick if
    every probe is held."""
    draw = random.SystemRandom()
    for _ in range(PROBES):
        port = PORT_BASE + draw.randrange(PORT_SPAN)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
