"""The scaffolding shared by the FSDP2 tests (tests/multiprocess/test_fsdp*.py).

Each of those files runs as a script in a subprocess (``tests.helpers.processes.run_two_ranks``) that
spawns gloo ranks; this module holds what they all do the same way: the small ``fully_shard``
MLP and its batches, a digest of the full (unsharded) state, the rank's side of a launch (a
file rendezvous, one phase, its JSON result) and the test's side (launch a phase, read the
ranks' results).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence

import torch

from tests.helpers.processes import join_gloo_group

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

    join_gloo_group(rank, world, tmp, timeout, rendezvous=f"rendezvous-{phase}")
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


# The runs of the sharded snapshot tests (test_fsdp_snapshots.py): resume, verification, async save.

RUN_STEPS = 10


def adam_digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """A digest of every parameter and every momentum buffer as full tensors (a collective)."""
    return full_digest(model, opt, ("exp_avg",))


def snapshot_cfg(directory: str) -> List[str]:
    """What the resume scenarios configure: a sharded snapshot every 3 steps into ``directory``, 2 kept."""
    return [
        "log.progress=false",
        "snapshot.every=3",
        "snapshot.keep=2",
        "snapshot.store=safetensors",
        f"snapshot.dir={directory}",
    ]


def sharded_fit(rank: int, directory: str, max_steps: int, resume: Any = None) -> Dict[str, Any]:
    """``fit`` of ``fsdp_mlp`` with Adam on ``batches(rank, RUN_STEPS)`` up to ``max_steps``: the
    full-state digest, the steps, the forwards trained, the run id, whether it ended finite."""
    import torch.nn.functional as F

    from safetrain import SafeTrainer, load_config

    model = fsdp_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    calls = []

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(1)  # one forward per step (replays are off under FSDP2)
        return F.mse_loss(out, y)

    trainer = SafeTrainer(model, opt, load_config(None, snapshot_cfg(directory)), loss_fn=loss_fn)
    result = trainer.fit(batches(rank, RUN_STEPS), epochs=1, max_steps=max_steps, resume=resume)
    trained = len(calls)
    finite = all(bool(torch.isfinite(p.full_tensor()).all()) for p in model.parameters())
    return {
        "digest": adam_digest(model, opt),
        "steps": result.steps,
        "events": trained,
        "run": trainer.guard.store.run_id,
        "finite": finite,
    }


def load_newest(rank: int, directory: str) -> Dict[str, Any]:
    """Load the newest snapshot of ``directory`` into a fresh guard; its step and full-state digest."""
    from safetrain import distributed, load_config
    from safetrain.guard import Guard

    model = fsdp_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with Guard(model, opt, load_config(None, snapshot_cfg(directory + "-scratch"))) as guard:
        info = distributed.load_snapshot(directory, guard.state)
        params = full_digest(model)
        return {"step": info.step, "digest": adam_digest(model, opt), "params": params}


def restore_midrun(rank: int, directory: str, before_fault: Callable[[], None] = lambda: None) -> Dict[str, Any]:
    """A NaN loss on rank 1 at step 6 -> every rank restores the sharded snapshot of step 3 from disk
    (steps 4 and 5 read clean after it: vouched for, issue 23). ``before_fault`` runs on every rank just
    before step 6 (the verification damages that snapshot)."""
    import math

    import torch.nn.functional as F

    from safetrain import load_config
    from safetrain.guard import Guard

    model = fsdp_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cfg = load_config(None, [*snapshot_cfg(directory), "sanitize.targets=off", "recovery.actions.loss=restore"])
    restored: List[Any] = []
    with Guard(model, opt, cfg, loss_fn=F.mse_loss) as guard:
        guard.bus.subscribe(lambda e: restored.append(e.detail.get("snapshot_step")) if e.name == "restored" else None)
        guard.begin_epoch(0)
        actions = []
        for step, (x, y) in enumerate(batches(rank, RUN_STEPS)[:7], start=1):
            if step == 6:
                before_fault()
                if rank == 1:
                    y = y.clone().fill_(math.nan)
            actions.append(guard.step((x, y)).action)
    finite = all(bool(torch.isfinite(p.full_tensor()).all()) for p in model.parameters())
    return {"actions": actions, "restored": restored, "digest": adam_digest(model, opt), "finite": finite}
