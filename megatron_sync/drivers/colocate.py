"""One torchrun job holding both roles on each host: trainer ranks and inference ranks side by side.

Run under torchrun with `--nproc-per-node` = trainer ranks + inference ranks per host (launch/colocate.sh):

    torchrun --nproc-per-node 4 -m megatron_sync.drivers.colocate --trainer-ranks 2 --module my_pkg.train \\
        -- --config train.yaml --serve --engine reference --model-dir /models/qwen3 --config train.yaml

On every host the first `--trainer-ranks` local processes become the trainer job's ranks and the others
the inference job's (`megatron_sync.drivers.serve`). Each role gets an environment of its own, as if it had been
launched alone: RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE numbered within the role (host by
host), and its own rendezvous port for its default process group (MASTER_PORT + 1 for the trainer,
+ 2 for the inference ranks; torchrun's own store keeps MASTER_PORT). The two roles then meet at
`weight_sync.master_address:master_port` like two separately launched jobs; with `transport: ipc`
every bucket goes through shared memory (which needs each trainer stage source on the inference
ranks' host: one host, or a trainer whose pipeline stages all live there).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from dataclasses import dataclass
from typing import Mapping, Optional

SERVE_FLAG = "--serve"


COLOCATED = "MEGATRON_SYNC_COLOCATED"
"""Set to 1 in both roles' environments by this launcher: the jobs share their hosts' devices."""


def colocated(env: Optional[Mapping[str, str]] = None) -> bool:
    """True in a process this launcher started (a trainer whose engines share its devices: `transport: auto`
    then considers ipc)."""
    return (os.environ if env is None else env).get(COLOCATED) == "1"


@dataclass(frozen=True)
class Role:
    """This process's place in its role's job."""

    name: str  # "trainer" | "inference"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_port: int

    def environment(self) -> dict[str, str]:
        """Return the variables that make this process one rank of its role's own job."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "MASTER_PORT": str(self.master_port),
                "GROUP_RANK": str(self.rank // self.local_world_size),
                "TORCHELASTIC_USE_AGENT_STORE": "False",  # torchrun's store stays torchrun's
                COLOCATED: "1"}  # transport auto: the engines share this host's devices (ipc is a candidate)


def role_of(env: Mapping[str, str], trainer_ranks: int) -> Role:
    """Return the role of the torchrun process described by `env` (its RANK, LOCAL_RANK, ... variables).

    ValueError when a host has no inference rank left, or the processes per host are not all alike.
    """
    local_rank, per_host = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
    if not 0 < trainer_ranks < per_host:
        raise ValueError(f"--trainer-ranks {trainer_ranks} must leave each host at least one inference rank "
                         f"and take at least one of its {per_host} processes (torchrun's --nproc-per-node)")
    if world % per_host:
        raise ValueError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={per_host}: every host must run "
                         "the same number of processes")
    host, hosts, port = rank // per_host, world // per_host, int(env.get("MASTER_PORT", "29500"))
    if local_rank < trainer_ranks:
        return Role("trainer", host * trainer_ranks + local_rank, hosts * trainer_ranks, local_rank, trainer_ranks,
                    port + 1)
    serving = per_host - trainer_ranks
    return Role("inference", host * serving + local_rank - trainer_ranks, hosts * serving,
                local_rank - trainer_ranks, serving, port + 2)


def split_arguments(argv: list[str]) -> tuple[list[str], list[str]]:
    """Return (trainer arguments, inference arguments): the inference job's follow `--serve`."""
    if SERVE_FLAG not in argv:
        raise ValueError(f"no {SERVE_FLAG}: give the inference job's arguments after it "
                         "(e.g. --serve --engine reference --model-dir /models/qwen3 --config train.yaml)")
    at = argv.index(SERVE_FLAG)
    return argv[:at], argv[at + 1:]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="trainer and inference ranks in one torchrun job (see module doc)")
    parser.add_argument("--trainer-ranks", type=int, required=True, help="trainer processes per host")
    entry = parser.add_mutually_exclusive_group(required=True)
    entry.add_argument("--module", help="the trainer's entry point, a module run as __main__")
    entry.add_argument("--script", help="the trainer's entry point, a script run as __main__")
    args, rest = parser.parse_known_args(argv)
    rest = rest[1:] if rest[:1] == ["--"] else rest
    trainer_args, serve_args = split_arguments(rest)
    role = role_of(os.environ, args.trainer_ranks)
    os.environ.update(role.environment())
    if role.name == "inference":
        from megatron_sync.drivers import serve

        return serve.main(serve_args)
    sys.argv = [args.script or args.module, *trainer_args]
    if args.module:
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(args.script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
