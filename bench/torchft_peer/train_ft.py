"""torchft replica-group trainer (1 process per replica group), CPU + Gloo.

Follows torchft's train_ddp.py (Manager + torchft DDP + torchft Optimizer
wrapper + PGTransport), with a small 4-layer MLP (width 256, batch 8) and
synthetic data instead of CIFAR10, and per-step JSON logging so a runner can
measure commit efficiency and recovery times.

Env: REPLICA_GROUP_ID, TORCHFT_LIGHTHOUSE, STEPS, LOGDIR, PG (gloo|babygloo),
     TRANSPORT (pg|http), STORE_PORT_BASE.
"""
import json
import os
import sys
import time

T_START = time.time()

from datetime import timedelta

import torch
import torch.nn as nn
from torch.distributed import TCPStore

from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft.process_group import ProcessGroupBabyGloo
from torchft.checkpointing.pg_transport import PGTransport

T_IMPORTED = time.time()


def main():
    GID = int(os.environ.get("REPLICA_GROUP_ID", 0))
    STEPS = int(os.environ.get("STEPS", 200))
    LOGDIR = os.environ.get("LOGDIR", "/tmp/torchft-peer-logs")
    PG_KIND = os.environ.get("PG", "gloo")
    TRANSPORT = os.environ.get("TRANSPORT", "pg")
    WIDTH = int(os.environ.get("WIDTH", 256))
    BATCH = int(os.environ.get("BATCH", 8))
    PG_TIMEOUT_S = float(os.environ.get("PG_TIMEOUT_S", 5))

    torch.set_num_threads(1)
    torch.manual_seed(0)  # identical init in all groups (init_sync also syncs at step 0)

    os.makedirs(LOGDIR, exist_ok=True)
    logf = open(os.path.join(LOGDIR, f"steps_g{GID}.jsonl"), "a", buffering=1)


    def log(**kw):
        kw.update(t=time.time(), g=GID, pid=os.getpid())
        logf.write(json.dumps(kw) + "\n")


    log(ev="start", t_start=T_START, t_imported=T_IMPORTED)

    # Per-replica-group TCPStore (torchelastic would normally host it); 1 proc/group.
    store_port = int(os.environ.get("STORE_PORT_BASE", 29600)) + GID
    store = TCPStore("127.0.0.1", store_port, 1, is_master=True, wait_for_workers=False)

    model = nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.ReLU(),
        nn.Linear(WIDTH, WIDTH), nn.ReLU(),
        nn.Linear(WIDTH, WIDTH), nn.ReLU(),
        nn.Linear(WIDTH, WIDTH),
    )
    inner_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner_opt.load_state_dict(sd["optim"])


    def state_dict():
        return {"model": model.state_dict(), "optim": inner_opt.state_dict()}


    if PG_KIND == "babygloo":
        pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=PG_TIMEOUT_S))
    else:
        pg = ProcessGroupGloo(timeout=timedelta(seconds=PG_TIMEOUT_S))

    kw = {}
    if TRANSPORT == "pg":
        kw["checkpoint_transport"] = PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu"))

    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_ft_{GID}",
        timeout=timedelta(seconds=30),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store_port,
        hostname="127.0.0.1",
        **kw,
    )


    class FixedDDP(DistributedDataParallel):
        """torchft DDP with the comm hook's error path fixed (torchft 0.2.0 bug):
        when the Gloo allreduce fails (peer SIGKILLed -> 'Connection reset by
        peer'), _ManagedWork.wait() reports the error to the manager and returns
        False without ever setting the inner future, so the stock hook's
        `assert fut._fut` raises AssertionError and kills the *surviving* replica.
        Here we return a completed future instead; the manager already recorded
        the error, so should_commit() returns False and the step is discarded."""

        @staticmethod
        def _comm_hook(state, bucket):
            work = state.allreduce(bucket.buffer())
            work.wait()
            fut = work.get_future()
            inner = getattr(fut, "_fut", None)
            if inner is None:
                done = torch.futures.Future()
                done.set_result(bucket.buffer())
                return done
            return inner


    DDP_HOOK = os.environ.get("DDP_HOOK", "fixed")
    ddp = (FixedDDP if DDP_HOOK == "fixed" else DistributedDataParallel)(manager, model)
    optimizer = Optimizer(manager, inner_opt)
    crit = nn.MSELoss()
    log(ev="manager_ready")

    # synthetic data: fixed per-group generator, target = fixed random linear map
    gen = torch.Generator().manual_seed(1000 + GID)
    W_true = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(7)) / WIDTH ** 0.5

    STOP_FILE = os.path.join(LOGDIR, "stop_at")


    def target_steps():
        # the runner may write a global stop step (all groups stop at the same step)
        try:
            return int(open(STOP_FILE).read().strip())
        except (OSError, ValueError):
            return STEPS


    attempt = 0
    while manager.current_step() < target_steps():
        t0 = time.time()
        x = torch.randn(BATCH, WIDTH, generator=gen)
        y = x @ W_true
        optimizer.zero_grad()          # -> manager.start_quorum() (async)
        out = ddp(x)
        loss = crit(out, y)
        loss.backward()                # grad allreduce via manager.allreduce (waits quorum)
        step_before = manager.current_step()
        t_bwd = time.time()
        ok = manager.should_commit()   # same as torchft.Optimizer.step() minus the inner step
        if ok:
            inner_opt.step()
        t1 = time.time()
        log(ev="step", attempt=attempt, step=step_before, commit=bool(ok),
            participants=manager.num_participants(), loss=float(loss.detach()), dt=t1 - t0,
            dt_commit=t1 - t_bwd, healed=step_before > 0 and attempt == 0)
        attempt += 1

    with torch.no_grad():
        csum = float(sum(p.double().sum() for p in model.parameters()))
    log(ev="done", step=manager.current_step(), checksum=csum, attempts=attempt)
    logf.close()
    # let peers finish their last allreduce before we vanish
    time.sleep(float(os.environ.get("EXIT_GRACE_S", 3)))
    manager.shutdown(wait=False)
    os._exit(0)


if __name__ == "__main__":  # ProcessGroupBabyGloo spawns a child that re-imports this file
    main()
