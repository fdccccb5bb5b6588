"""The scaffolding shared by the FSDP2 tests (tests/multiprocess/test_fsdp*.py).

Each of those files runs as a script in a subprocess (``tests.helpers.processes.run_two_ranks``) that
spawns gloo ranks; this module holds what they all do the same way: the small ``fully_shard``
MLP and its batches, a digest of the full (unsharded) state, the rank's side of a launch (a
file rendezvous, one phase, its JSON result) and the test's side (launch a phase, read the
ranks' results).
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence

import torch

Body = Callable[[int, str, str], Dict[str, Any]]  # (rank, tmp, phase) -> the rank's JSON result


def unsharded_mlp() -> torch.nn.Module:
    """The unsharded 4-8-6-1 tanh MLP, seeded (what ``fsdp_mlp`` shards)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1)
    )


def fsdp_mlp() -> torch.nn.Module:
    """``unsharded_mlp()`` with ``fully_shard`` on each Linear layer and on the root."""
    from torch.distributed.fsdp import fully_shard

    net = unsharded_mlp()
    for layer in (net[0], net[2], net[4]):
        fully_shard(layer)
    fully_shard(net)
    return net


def batches(rank: int, steps: int) -> List[Any]:
    """``steps`` (x, y) batches of 8 rows, different on each rank, the same on each launch."""
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(steps)]


def full_digest(model: torch.nn.Module, opt: Any = None, moments: Sequence[str] = ()) -> str:
    """A digest of every parameter and of the optimizer state entries named in ``moments``
    (``("exp_avg",)``, ``("exp_avg", "exp_avg_sq")`` for Adam), all as full tensors: a collective."""
    flat = [p.full_tensor().detach().reshape(-1) for p in model.parameters()]
    if moments:
        flat += [s[k].full_tensor().reshape(-1) for s in opt.state.values() for k in moments if k in s]
    return hashlib.sha256(torch.cat(flat).numpy().tobytes()).hexdigest()


def run_rank(rank: int, world: int, tmp: str, phase: str, body: Body, timeout: float = 60) -> None:
    """One rank of a launch: join the gloo group (file rendezvous ``rendezvous-{phase}``), run
    ``body(rank, tmp, phase)`` and write its result to ``{tmp}/{phase}-rank{rank}.json``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/rendezvous-{phase}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )
    out = body(rank, tmp, phase)
    with open(os.path.join(tmp, f"{phase}-rank{rank}.json"), "w") as f:
        json.dump(out, f)
    gc.collect()
    dist.destroy_process_group()


def spawn_ranks(body: Body, phase: str, timeout: float = 60) -> None:
    """A test script's ``__main__``: spawn the ranks of one launch into ``sys.argv[1]``; the phase
    and the world size come from ``SAFETRAIN_TEST_PHASE`` / ``SAFETRAIN_TEST_WORLD`` when set."""
    world = int(os.environ.get("SAFETRAIN_TEST_WORLD", "2"))
    phase = os.environ.get("SAFETRAIN_TEST_PHASE", phase)
    torch.multiprocessing.spawn(run_rank, args=(world, sys.argv[1], phase, body, timeout), nprocs=world, join=True)


def launch(script: str, tmp: Path, phase: str, timeout: float, what: str, world: int = 2) -> List[Dict[str, Any]]:
    """Run ``script`` for ``phase`` on ``world`` ranks (``run_two_ranks``); each rank's result."""
    from tests.helpers.processes import run_two_ranks

    os.environ["SAFETRAIN_TEST_PHASE"], os.environ["SAFETRAIN_TEST_WORLD"] = phase, str(world)
    try:
        run_two_ranks(script, tmp, timeout, what)
    finally:
        del os.environ["SAFETRAIN_TEST_PHASE"], os.environ["SAFETRAIN_TEST_WORLD"]
    return [json.loads((tmp / f"{phase}-rank{r}.json").read_text()) for r in range(world)]
