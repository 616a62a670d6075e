#!/usr/bin/env python3
"""Kill/restart scenario for torchft on CPU/Gloo, with one command.

  run_scenario.py --groups 2 --steps 200 --k 20 --max-kills 9 --out DIR

Starts torchft_lighthouse, one relaunch loop per replica group (1 process per
group, nice -n 10), watches the per-step JSON logs, and every K full-quorum
committed steps (all groups in the quorum) SIGKILLs one group (round-robin);
the relaunch loop restarts it after --restart-delay seconds.  After the run it
prints the figures (also written to DIR/summary.json).

--steps S: each group stops at manager step S (torchft's step is global: a
healed group jumps to the peer's step).  With --until-kills, S is ignored and
the runner stops all groups K full-quorum steps after the last kill.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VENV = os.environ.get("TORCHFT_VENV", "/work/torchft-venv")

ap = argparse.ArgumentParser()
ap.add_argument("--groups", type=int, default=2)
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--k", type=int, default=20)
ap.add_argument("--max-kills", type=int, default=9)
ap.add_argument("--until-kills", action="store_true")
ap.add_argument("--restart-delay", type=float, default=1.0)
ap.add_argument("--pg", default="gloo", choices=["gloo", "babygloo"])
ap.add_argument("--transport", default="pg", choices=["pg", "http"])
ap.add_argument("--ddp-hook", default="fixed", choices=["fixed", "stock"])
ap.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
ap.add_argument("--join-timeout-ms", type=int, default=1000)
ap.add_argument("--quorum-tick-ms", type=int, default=100)
ap.add_argument("--lighthouse-port", type=int, default=29510)
ap.add_argument("--store-port-base", type=int, default=29600)
ap.add_argument("--wall-limit", type=float, default=600)
ap.add_argument("--out", default="out")
a = ap.parse_args()

os.makedirs(a.out, exist_ok=True)
for f in os.listdir(a.out):
    os.remove(os.path.join(a.out, f))
evf = open(os.path.join(a.out, "events.jsonl"), "a", buffering=1)
lock = threading.RLock()


def event(**kw):
    kw["t"] = time.time()
    with lock:
        evf.write(json.dumps(kw) + "\n")
    return kw


LOAD_START = os.getloadavg()
lh = subprocess.Popen(
    ["nice", "-n", "10", f"{VENV}/bin/torchft_lighthouse",
     "--min_replicas", "1", "--quorum_tick_ms", str(a.quorum_tick_ms),
     "--join_timeout_ms", str(a.join_timeout_ms),
     "--heartbeat_timeout_ms", str(a.heartbeat_timeout_ms),
     "--bind", f"127.0.0.1:{a.lighthouse_port}"],
    stdout=open(os.path.join(a.out, "lighthouse.log"), "w"), stderr=subprocess.STDOUT)
event(ev="lighthouse_start", pid=lh.pid)
time.sleep(0.5)

env = dict(os.environ, TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{a.lighthouse_port}",
           STEPS=str(10**9 if a.until_kills else a.steps), LOGDIR=a.out, PG=a.pg,
           TRANSPORT=a.transport, DDP_HOOK=a.ddp_hook, STORE_PORT_BASE=str(a.store_port_base))
cur = {}          # gid -> Popen of current incarnation
finished = set()
stop_all = threading.Event()


def relaunch_loop(gid):
    inc = 0
    while not stop_all.is_set():
        log = open(os.path.join(a.out, f"g{gid}_inc{inc}.log"), "w")
        p = subprocess.Popen(["nice", "-n", "10", f"{VENV}/bin/python", f"{HERE}/train_ft.py"],
                             env=dict(env, REPLICA_GROUP_ID=str(gid)),
                             stdout=log, stderr=subprocess.STDOUT)
        with lock:
            cur[gid] = p
        event(ev="spawn", g=gid, inc=inc, pid=p.pid)
        rc = p.wait()
        event(ev="exit", g=gid, inc=inc, pid=p.pid, rc=rc)
        if rc == 0:
            with lock:
                finished.add(gid)
            # training is over once any group reached the final step: do not
            # respawn anyone (a group restarted now has no peer to heal from
            # and would train a fresh model from step 0)
            stop_all.set()
            return
        if stop_all.is_set():
            with lock:
                finished.add(gid)
            return
        inc += 1
        time.sleep(a.restart_delay)


threads = [threading.Thread(target=relaunch_loop, args=(g,), daemon=True) for g in range(a.groups)]
for th in threads:
    th.start()

# ---- monitor: follow step logs, decide kills --------------------------------
pos = {g: 0 for g in range(a.groups)}
last = {}                 # gid -> last step record
full_q_steps = 0          # committed full-quorum steps (counted on the reference group)
kills = 0
victim = 0
pending_rejoin = None     # gid killed and not yet back in a full quorum
t_begin = time.time()
stop_written = False
t_kill = 0.0
t_first_done = None


def read_new(g):
    path = os.path.join(a.out, f"steps_g{g}.jsonl")
    try:
        with open(path) as f:
            f.seek(pos[g])
            data = f.read()
    except FileNotFoundError:
        return []
    nl = data.rfind("\n")
    if nl < 0:
        return []
    pos[g] += nl + 1
    return [json.loads(l) for l in data[: nl + 1].splitlines() if l.strip()]


def read_new_keep(g):
    for r in read_new(g):
        if r.get("ev") == "step":
            last[g] = r


while True:
    with lock:
        if len(finished) == a.groups:
            break
    if stop_all.is_set():
        # after the first group finished: give the others a grace period,
        # then kill any incarnation that is still (re)joining
        # (groups in lockstep have logged step >= final-1; one that is still
        # rejoining has not and is killed at once, as it would otherwise
        # train a fresh model from step 0 with no peer to heal from)
        if t_first_done is None:
            t_first_done = time.time()
            for g in range(a.groups):
                read_new_keep(g)
            try:
                final = int(open(os.path.join(a.out, "stop_at")).read())
            except OSError:
                final = a.steps
            with lock:
                for g, p in cur.items():
                    lr = last.get(g)
                    if g not in finished and p.poll() is None and \
                            (lr is None or lr["pid"] != p.pid or lr["step"] < final - 1):
                        p.kill()
                        event(ev="orphan_killed", g=g, pid=p.pid)
    if time.time() - t_begin > a.wall_limit:
        event(ev="wall_limit")
        break
    for g in range(a.groups):
        for r in read_new(g):
            if r.get("ev") != "step":
                continue
            last[g] = r
            # count full-quorum committed steps on one reference group that is alive
            ref = (pending_rejoin + 1) % a.groups if pending_rejoin is not None else victim
            ref = min(last.keys()) if ref not in last else ref
            if g == ref and r["commit"] and r["participants"] == a.groups:
                if pending_rejoin is not None and r["t"] < t_kill + a.restart_delay:
                    continue  # step that was already in flight at the kill
                if pending_rejoin is not None:
                    event(ev="full_quorum_again", g=pending_rejoin, step=r["step"])
                    pending_rejoin = None
                    full_q_steps = 0
                full_q_steps += 1
    if pending_rejoin is None and full_q_steps >= a.k and kills < a.max_kills and not stop_written:
        with lock:
            p = cur.get(victim)
        if p is not None and p.poll() is None and victim not in finished:
            os.kill(p.pid, signal.SIGKILL)
            t_kill = time.time()
            event(ev="kill", g=victim, pid=p.pid, at_step=last.get(victim, {}).get("step"))
            kills += 1
            pending_rejoin = victim
            victim = (victim + 1) % a.groups
            full_q_steps = 0
    if a.until_kills and not stop_written and kills >= a.max_kills and pending_rejoin is None \
            and full_q_steps >= a.k:
        stop_at = max(r["step"] for r in last.values()) + 2
        open(os.path.join(a.out, "stop_at"), "w").write(str(stop_at))
        event(ev="stop_at", step=stop_at)
        stop_written = True
    time.sleep(0.005)

stop_all.set()
for g, p in cur.items():
    if p.poll() is None:
        p.kill()
lh.terminate()
lh.wait()
event(ev="end")
evf.close()

# ---- analysis ----------------------------------------------------------------
ev = [json.loads(l) for l in open(os.path.join(a.out, "events.jsonl"))]
steps = {g: [json.loads(l) for l in open(os.path.join(a.out, f"steps_g{g}.jsonl"))]
         for g in range(a.groups)}
S = {g: [r for r in steps[g] if r["ev"] == "step"] for g in steps}
summary = {"args": vars(a), "groups": {}, "kills": [], "restarts": []}

for g in range(a.groups):
    att = len(S[g])
    com = sum(r["commit"] for r in S[g])
    done = [r for r in steps[g] if r["ev"] == "done"]
    summary["groups"][g] = dict(attempted=att, committed=com, uncommitted=att - com,
                                efficiency=round(com / att, 4) if att else None,
                                incarnations=len([e for e in ev if e["ev"] == "spawn" and e["g"] == g]),
                                final_step=done[-1]["step"] if done else None,
                                checksum=done[-1]["checksum"] if done else None)

# steady state: committed full-quorum steps that are >=3 attempts away from any
# non-full/uncommitted step and not the first 5 attempts of an incarnation
for g in range(a.groups):
    rs = S[g]
    bad = [i for i, r in enumerate(rs) if not (r["commit"] and r["participants"] == a.groups)]
    good = [r["dt"] for i, r in enumerate(rs)
            if r["attempt"] >= 5 and all(abs(i - b) > 3 for b in bad)]
    summary["groups"][g]["steady_step_ms_median"] = round(1e3 * statistics.median(good), 3) if good else None
    summary["groups"][g]["steady_step_ms_mean"] = round(1e3 * statistics.mean(good), 3) if good else None
    summary["groups"][g]["steady_n"] = len(good)

kill_ev = [e for e in ev if e["ev"] == "kill"]


def sp_t(gk, tk):
    sp = next((e for e in ev if e["ev"] == "spawn" and e["g"] == gk and e["t"] > tk), None)
    return sp


def fc_t(gk, tk):
    sp = sp_t(gk, tk)
    fc = next((r for r in S[gk] if r["pid"] == sp["pid"] and r["commit"]), None) if sp else None
    return fc["t"] if fc else float("inf")


for k in kill_ev:
    tk, gk = k["t"], k["g"]
    row = {"killed": gk, "at_step": k["at_step"], "survivors": {}}
    for g in range(a.groups):
        if g == gk:
            continue
        # only steps that *started* after the kill (a step already past its
        # allreduce when the kill landed may still commit with the old quorum)
        after = [r for r in S[g] if r["t"] - r["dt"] > tk]
        inflight = [r for r in S[g] if r["t"] > tk and r["t"] - r["dt"] <= tk]
        first_commit = next((r for r in after if r["commit"]), None)
        fails = [r for r in after if first_commit and r["t"] <= first_commit["t"] and not r["commit"]]
        if first_commit:
            row["survivors"][g] = dict(
                kill_to_next_commit_s=round(first_commit["t"] - tk, 3),
                inflight_step_committed=[r["commit"] for r in inflight],
                uncommitted_before=len(fails),
                next_commit_participants=first_commit["participants"],
                steps_committed_alone=sum(1 for r in after if r["commit"] and r["participants"] < a.groups
                                          and (not sp_t(gk, tk) or r["t"] < fc_t(gk, tk))))
    # restart of the killed group
    sp = next((e for e in ev if e["ev"] == "spawn" and e["g"] == gk and e["t"] > tk), None)
    if sp:
        inc_steps = [r for r in S[gk] if r["pid"] == sp["pid"]]
        st = next((r for r in steps[gk] if r["pid"] == sp["pid"] and r["ev"] == "start"), None)
        mr = next((r for r in steps[gk] if r["pid"] == sp["pid"] and r["ev"] == "manager_ready"), None)
        fc = next((r for r in inc_steps if r["commit"]), None)
        fq = next((e for e in ev if e["ev"] == "full_quorum_again" and e["t"] > tk), None)
        healed = False
        try:
            txt = open(os.path.join(a.out, f"g{gk}_inc{sp['inc']}.log")).read()
            healed = "healing is required" in txt
        except OSError:
            pass
        rr = dict(group=gk, kill_to_spawn_s=round(sp["t"] - tk, 3))
        if st:
            rr["spawn_to_python_start_s"] = round(st["t_start"] - sp["t"], 3)
            rr["python_start_to_torch_imported_s"] = round(st["t_imported"] - st["t_start"], 3)
        if mr and st:
            rr["imported_to_manager_ready_s"] = round(mr["t"] - st["t_imported"], 3)
        if fc:
            rr["spawn_to_first_commit_s"] = round(fc["t"] - sp["t"], 3)
            if mr:
                rr["manager_ready_to_first_commit_s"] = round(fc["t"] - mr["t"], 3)
            rr["first_commit_step"] = fc["step"]
            rr["uncommitted_before_first_commit"] = sum(
                1 for r in inc_steps if r["t"] < fc["t"] and not r["commit"])
        rr["healed_from_peer"] = healed
        if fq:
            rr["kill_to_full_quorum_s"] = round(fq["t"] - tk, 3)
        summary["restarts"].append(rr)
    summary["kills"].append(row)

summary["wall_s"] = round(ev[-1]["t"] - ev[0]["t"], 3)
summary["loadavg_start_end"] = [LOAD_START, os.getloadavg()]
json.dump(summary, open(os.path.join(a.out, "summary.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))


def med(xs):
    xs = [x for x in xs if x is not None]
    return (round(statistics.median(xs), 3), round(min(xs), 3), round(max(xs), 3)) if xs else None


print("\n== compact ==")
for g, d in summary["groups"].items():
    print(f"group {g}: committed/attempted {d['committed']}/{d['attempted']} = {d['efficiency']}, "
          f"incarnations {d['incarnations']}, steady step median {d['steady_step_ms_median']} ms "
          f"(mean {d['steady_step_ms_mean']}), final step {d['final_step']}, checksum {d['checksum']}")
sv = [v for k in summary["kills"] for v in k["survivors"].values()]
print("kills:", len(summary["kills"]))
print("kill -> survivor next commit s (median,min,max):", med([v["kill_to_next_commit_s"] for v in sv]))
print("survivor steps committed alone per outage:", [v["steps_committed_alone"] for v in sv])
print("survivor uncommitted steps per kill:", [v["uncommitted_before"] for v in sv])
rs = summary["restarts"]
for key in ["spawn_to_first_commit_s", "python_start_to_torch_imported_s", "imported_to_manager_ready_s",
            "manager_ready_to_first_commit_s", "kill_to_full_quorum_s"]:
    print(f"restart {key} (median,min,max):", med([r.get(key) for r in rs]))
print("restarted healed from peer:", [r["healed_from_peer"] for r in rs])
print("wall_s:", summary["wall_s"], "loadavg start/end:", summary["loadavg_start_end"])
