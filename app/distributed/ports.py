"""A free TCP port for a run's ranks to meet at, picked on the node that hosts their rendezvous (the Slurm scripts run
`python -m app.distributed.ports JOB_ID` in their batch shell, which runs on the job's first node).

Lightning's port under Slurm is 15000 + the job id's last four digits, and the torchrun script's was 29500 + the id
modulo 3000: two jobs whose first node was the same machine (8-GPU nodes shared by smaller jobs), with ids alike there,
met at one port, and the second failed at its start (EADDRINUSE) or, under torchrun, joined the first's rendezvous
store, trained in its world and died when the first job ended. Written here: neither Lightning nor torch picks a port
for a launcher they do not run.
"""

from __future__ import annotations

import socket
import sys

LOWEST, HIGHEST = 20000, 32767
"""Below Linux's ephemeral ports (32768 on), which outgoing connections take at any moment."""


def free_port(seed: int = 0) -> int:
    """The first port, from a start that the seed (a job id) moves so that jobs starting together try different
    ones, that nothing on this machine is bound to (nor listens on, nor holds in TIME_WAIT)."""
    span = HIGHEST - LOWEST + 1
    for k in range(span):
        port = LOWEST + (seed + k) % span
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
        return port
    raise OSError(f"no free port between {LOWEST} and {HIGHEST}")


if __name__ == "__main__":
    print(free_port(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
