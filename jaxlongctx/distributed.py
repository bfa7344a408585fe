"""Multi-process start-up: every process runs the same program over one global device mesh."""

from __future__ import annotations

import jax


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    bind_address: str | None = None,
    timeout_s: int = 300,
) -> None:
    """Join a multi-process JAX run (call before any other JAX use); CPU processes talk over gloo.

    With no arguments JAX detects the cluster (SLURM, Open MPI, cloud TPU, ...). Afterwards
    `jax.devices()` lists every process's devices, so `parallel.make_mesh` spans all of them.
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address,
        num_processes,
        process_id,
        coordinator_bind_address=bind_address,
        initialization_timeout=timeout_s,
    )


def is_primary() -> bool:
    """True in the process that should write files and print (process 0)."""
    return jax.process_index() == 0
