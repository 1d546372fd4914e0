"""verl's rendezvous ports for the adapter's worker groups (imported by the tests beside it)."""
from pathlib import Path


def master_port_range() -> list[int]:
    """A range for verl's RayWorkerGroup(master_port_range=...), below the kernel's ephemeral ports.

    Without one, verl takes a port the kernel hands out for port 0 and binds it again only when the rank-0
    worker builds its TCP store, seconds later; in between, any socket of the host (Ray's, gloo's) may get the
    same ephemeral port, and the store fails with EADDRINUSE. Ports below the ephemeral range are only ever
    bound by name, and Ray's workers take 10002-19999 by default."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert low > 22_000, f"the ephemeral ports start at {low}: no room for the rendezvous ports below them"
    return [low - 2_000, low]
