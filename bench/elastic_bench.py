#!/usr/bin/env python3
"""Elastic replicas under fire: fsdp-train under `fsdp-run --replicas R`, one replica killed
(SIGKILL of one of its ranks) every K steps and restarted by the launcher, against the same job
uninterrupted. Prints the step efficiency, the time to continue after a death, the time for a
restarted replica to rejoin, and the final validation loss of both runs.

    bench/elastic_bench.py --bin build/bin --replicas 2 --shards 2 --steps 200 --kill-every 20

The ranks' pids come from /proc (fsdp-run's children with FSDP_REPLICA_ID in their
environment); the replicas are killed in turn, each only once it trains (a restarted one has
rejoined) and while another one trains too, so the job never ends on a kill.
"""
import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

STEP = re.compile(r"^\[replica (\d+) rank 0\] step (\d+)/(\d+)")
REDONE = re.compile(r"^\[replica (\d+) rank 0\] fsdp-train: step (\d+) redone .*: ([0-9.]+) s from")
JOINED = re.compile(r"^\[replica (\d+) rank 0\] fsdp-train: replica \d+ joined the running job "
                    r"at step (\d+), ([0-9.]+) s after it started")
RESTART = re.compile(r"^fsdp-run: restarting replica (\d+)")
VAL = re.compile(r"^\[replica (\d+) rank 0\]   val loss\s+([0-9.]+)")
ELASTIC = re.compile(r"^\[replica (\d+) rank 0\]   elastic\s+replica \d+: (\d+) steps committed, "
                     r"(\d+) attempts thrown away")


def replica_ranks(launcher_pid):
    """{replica: [pid, ...]} of the launcher's children that are ranks."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if b"FSDP_REPLICA_ID" in env and b"RANK" in env:
            out.setdefault(int(env[b"FSDP_REPLICA_ID"]), []).append(int(entry))
    return out


def run(args, kill_every):
    run_dir = tempfile.mkdtemp(prefix="fsdp-elastic-bench-")
    cmd = [f"{args.bin}/fsdp-run", "--replicas", str(args.replicas), "-n",
           str(args.replicas * args.shards), "--max-restarts", "1000", "--restart-delay",
           str(args.restart_delay), "--", f"{args.bin}/fsdp-train", "--steps", str(args.steps),
           "--log-every", "1", "--sample-tokens", "0", "--run-dir", run_dir] + args.train_args
    env = dict(os.environ, FSDP_TIMEOUT_S=str(args.timeout))
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, bufsize=1)
    state = {"step": 0, "running": set(range(args.replicas)), "restarted_at": {},
             "rejoin": [], "redone": {}, "val": {}, "kills": 0, "next_kill": kill_every,
             "victim": 1 % args.replicas, "elastic": {}}
    lock = threading.Lock()

    def reader():
        for line in proc.stdout:
            now = time.monotonic()
            if args.verbose:
                sys.stdout.write(line)
            with lock:
                if m := STEP.match(line):
                    state["step"] = max(state["step"], int(m.group(2)))
                    state["running"].add(int(m.group(1)))
                    state["replica_steps"] = state.get("replica_steps", 0) + 1
                elif m := REDONE.match(line):
                    state["redone"].setdefault(int(m.group(2)), float(m.group(3)))
                elif m := RESTART.match(line):
                    state["restarted_at"][int(m.group(1))] = now
                elif m := JOINED.match(line):
                    r = int(m.group(1))
                    if r in state["restarted_at"]:
                        state["rejoin"].append(now - state["restarted_at"].pop(r))
                elif m := VAL.match(line):
                    state["val"][int(m.group(1))] = float(m.group(2))
                elif m := ELASTIC.match(line):
                    state["elastic"][int(m.group(1))] = (int(m.group(2)), int(m.group(3)))

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    while proc.poll() is None:
        time.sleep(0.02)
        if not kill_every:
            continue
        with lock:
            due = state["step"] >= state["next_kill"] and state["step"] < args.steps - 2
            victim = state["victim"]
            training = set(state["running"])  # printed a step since its last (re)start
        if not due or victim not in training or not training - {victim}:
            continue
        ranks = replica_ranks(proc.pid)
        if victim not in ranks:
            continue
        os.kill(ranks[victim][0], signal.SIGKILL)
        with lock:
            state["kills"] += 1
            state["next_kill"] += kill_every
            state["victim"] = (victim + 1) % args.replicas
            state["running"].discard(victim)
    t.join()
    state["wall_s"] = time.monotonic() - t0
    state["exit"] = proc.returncode
    return state


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin", default="build/bin")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kill-every", type=int, default=20)
    p.add_argument("--restart-delay", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("train_args", nargs="*", help="more fsdp-train arguments (after --)")
    args = p.parse_args()
    base = run(args, 0)
    fire = run(args, args.kill_every)
    redo = sorted(fire["redone"].values())
    attempted = args.steps + len(fire["redone"])
    mesh = f"{args.replicas} x {args.shards}"
    print(f"elastic bench: {mesh} mesh, {args.steps} steps, a replica killed every "
          f"{args.kill_every} steps ({fire['kills']} kills), restart delay {args.restart_delay} s")
    print(f"  exit status           uninterrupted {base['exit']}, under kills {fire['exit']}")
    print(f"  step efficiency       {args.steps}/{attempted} = {args.steps / attempted:.3f} "
          f"(steps committed / step attempts of the job)")
    if redo:
        print(f"  time to continue      median {statistics.median(redo):.2f} s, max "
              f"{max(redo):.2f} s (a killed step's first attempt to its commit)")
    if fire["rejoin"]:
        print(f"  time to rejoin        median {statistics.median(fire['rejoin']):.2f} s, max "
              f"{max(fire['rejoin']):.2f} s (launcher's restart to the replica's first step; "
              f"{len(fire['rejoin'])} rejoins)")
    width = fire.get("replica_steps", 0) / (args.replicas * args.steps)
    print(f"  full width            {width:.3f} of the replica-steps of the uninterrupted run "
          f"were trained (the rest: steps with a replica missing)")
    print(f"  wall time             uninterrupted {base['wall_s']:.1f} s, under kills "
          f"{fire['wall_s']:.1f} s")
    bv = sorted(set(base["val"].values()))
    fv = sorted(set(fire["val"].values()))
    print(f"  final val loss        uninterrupted {bv}, under kills {fv}")
    return 0 if base["exit"] == 0 and fire["exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
