"""The communication model of the article: parameter server versus ring all-reduce, for K bytes of gradients.

Single-process data parallelism (``dp``, ``parallel_criterion``) works like a parameter server with the root device
as the server: each step sends the parameters to the N−1 other devices and brings their gradients back, so
2(N−1)K bytes pass through the root's link, one after another: 2(N−1)K/b seconds on a link of b bytes/s. DDP's ring
all-reduce sends 2(N−1)K/N bytes per device, all links busy at once: 2(N−1)K/(N·b) seconds, nearly flat in N.
"""

from __future__ import annotations

from typing import Any

BITS_PER_BYTE = 8


def parameter_server_bytes(grad_bytes: float, devices: int) -> float:
    """Bytes through the root's link per step: parameters out to and gradients back from N−1 devices, 2(N−1)K."""
    return 2 * (devices - 1) * grad_bytes


def ring_allreduce_bytes(grad_bytes: float, devices: int) -> float:
    """Bytes each device sends (and receives) per step in a ring all-reduce of K bytes, 2(N−1)K/N."""
    return 2 * (devices - 1) * grad_bytes / devices


def link_bytes_per_s(link_gbps: float) -> float:
    """A link's bandwidth in bytes/s from gigabits/s (10⁹ bits)."""
    return link_gbps * 1e9 / BITS_PER_BYTE


def communication_model(grad_bytes: int, devices: int, link_gbps: float) -> dict[str, Any]:
    """Bytes and seconds per step under both schemes (what the report prints beside the measurements)."""
    bandwidth = link_bytes_per_s(link_gbps)
    ps = parameter_server_bytes(grad_bytes, devices)
    ring = ring_allreduce_bytes(grad_bytes, devices)
    return {
        "devices": devices,
        "gradient_bytes": grad_bytes,
        "link_gbps": link_gbps,
        "parameter_server_bytes_per_step": ps,
        "parameter_server_seconds_per_step": ps / bandwidth,
        "ring_allreduce_bytes_per_device_per_step": ring,
        "ring_allreduce_seconds_per_step": ring / bandwidth,
        "formulae": {
            "parameter_server": "2(N-1)K bytes through the root, 2(N-1)K/b seconds",
            "ring_allreduce": "2(N-1)K/N bytes per device, 2(N-1)K/(N*b) seconds",
        },
    }
