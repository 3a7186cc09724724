"""Where a per-node supervisor of a Slurm job stands in its job: read from the SLURM_* environment srun
gives each task. Standard library only (it runs before torchrun starts: launch latency)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..config import RunConfig
from ..slurm import master_port, node_torchrun_args, sqlite_on_network_problem


@dataclass(frozen=True)
class SlurmNode:
    index: int  # SLURM_NODEID: 0 on the job's first node
    count: int  # SLURM_NNODES
    job_id: str
    master_addr: str  # the first node's address: where every node's torchrun meets
    first_rank: int  # the global rank of this node's local rank 0

    @classmethod
    def from_env(cls, cfg: RunConfig, env: dict[str, str] | None = None) -> SlurmNode:
        env = dict(os.environ if env is None else env)
        index = int(env.get("SLURM_NODEID", "0"))
        # srun's launch node is the batch script's: the job's first node, node 0.
        addr = env.get("SLURM_LAUNCH_NODE_IPADDR") or "127.0.0.1"
        return cls(index, int(env.get("SLURM_NNODES", str(cfg.nodes))), env.get("SLURM_JOB_ID", "0"), addr,
                   index * cfg.ranks_per_node)

    @property
    def rendezvous(self) -> list[str]:
        return node_torchrun_args(self.count, self.index, self.master_addr, master_port(self.job_id))


def store_refusal(db_url: str, mounts_file: Path | None = None) -> str | None:
    """Why this node must not write the store: a SQLite file on a network file system. None otherwise."""
    from ..faults import MOUNTS_ENV

    mounts_file = mounts_file or Path(os.environ.get(MOUNTS_ENV) or "/proc/mounts")
    if not db_url.startswith("sqlite"):
        return None
    path = db_url.split("///", 1)[1] if "///" in db_url else ""
    if not path or path == ":memory:":
        return None
    try:
        mounts = mounts_file.read_text()
    except OSError:
        return None
    return sqlite_on_network_problem(Path(path).resolve(), mounts)
