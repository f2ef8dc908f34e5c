"""Rank uniformity with two real ranks (torch.distributed, gloo, CPU, loopback only).

Both ranks see the same scheduler metadata; each also holds rank-local state that differs (a
fail-stop history on one rank only; a local wish to disable mono decode on one rank only). The
ranks must take the same path at every step: local state enters only through the MIN vote."""

import json
import os
import subprocess
import sys
import textwrap
import time

DRIVER = textwrap.dedent(
    """
    import json, sys, time
    import torch.distributed as dist
    from monodecode.config import MonoConfig
    from monodecode.model.profiles import profile_dims
    from monodecode.model.weights import random_weights
    from monodecode.runtime.failstop import FailStopEvent, FailStopRecorder, FailStop
    from monodecode.services.platform import Platform
    from monodecode.runtime.runner import Runner
    from monodecode.runtime.vote import StepInfo

    rank, scenario, tmp = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    cpu_group = dist.new_group(backend="gloo")
    fs = f"{tmp}/failstop-{rank}"
    if scenario == "crash_history" and rank == 1:
        rec = FailStopRecorder(fs, rank=1, exit_on_failstop=False, termination_log=f"{tmp}/t1")
        for i in range(3):
            try:
                rec.fail(FailStopEvent(rank=1, step=i, site="wait_timeout", layer=0, kernel="k2", time=time.time()))
            except FailStop:
                pass
    cfg = MonoConfig(enabled=True, widths=(1, 2, 4), failstop_dir=fs, termination_log=f"{tmp}/t{rank}",
                     on_refusal="raise", exit_on_failstop=False)
    dims = profile_dims("tiny")
    runner = Runner(cfg, dims, random_weights(dims, seed=0), Platform("cpu", "cpu", "cpu", 2),
                    tp_rank=rank, tp_size=2, tp_group=cpu_group, faults=()).start()
    steps = [StepInfo(1), StepInfo(3), StepInfo(6, 6), StepInfo(2), StepInfo(5), StepInfo(4, graph_mode="full"),
             StepInfo(4, 1), StepInfo(2, graph_mode="piecewise"), StepInfo(1), StepInfo(2, has_metadata=False), StepInfo(4)]
    paths = []
    for i, info in enumerate(steps):
        if scenario == "local_disable" and rank == 1 and i == 2:
            runner.request_disable("rank-local check failed")
        if i == 6:
            runner.revote()  # the safe point where local state is folded in
        d = runner.begin_step(info)
        paths.append([d.path, d.reason, d.width])
    json.dump({"state": runner.state, "reasons": runner.reasons, "paths": paths, "votes": runner.vote.votes},
              open(f"{tmp}/rank{rank}.json", "w"))
    dist.destroy_process_group()
    """
)


def run_ranks(tmp_path, scenario):
    script = tmp_path / "rank.py"
    script.write_text(DRIVER)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    env.pop("MONODECODE_FAULT", None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), scenario, str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    deadline = time.time() + 240
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=max(1, deadline - time.time()))
        outs.append((p.returncode, err))
    assert all(rc == 0 for rc, _ in outs), outs
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_local_disable_is_voted_not_read(tmp_path):
    r0, r1 = run_ranks(tmp_path, "local_disable")
    assert r0["paths"] == r1["paths"]  # same path at every step, on both ranks
    paths = r0["paths"]
    # before the vote (steps 0-5) rank 1's local wish changes nothing
    assert paths[:6] == [
        ["mono", None, 1],
        ["mono", None, 4],
        ["fallback", "prefill", None],
        ["mono", None, 2],
        ["fallback", "rows_exceed_width", None],
        ["mono", None, 4],
    ]
    # after the vote at step 6 both ranks run the stock path
    assert all(p == ["fallback", "degraded", None] for p in paths[6:])
    assert r0["state"] == r1["state"] == "degraded"
    assert r1["reasons"] == ["disabled: rank-local check failed"]
    assert r0["reasons"] == ["peer_disabled: another tensor-parallel rank disabled mono decode"]
    assert r0["votes"] == r1["votes"] == 3


def test_one_ranks_crash_history_degrades_both(tmp_path):
    r0, r1 = run_ranks(tmp_path, "crash_history")
    assert r0["state"] == r1["state"] == "degraded"  # not raised, although on_refusal is raise
    assert r1["reasons"][0].startswith("failstop_loop: 3 fail-stops")
    assert r0["reasons"] == ["peer_refused: another tensor-parallel rank refused; see its log"]
    assert r0["paths"] == r1["paths"] and all(p[0] == "fallback" for p in r0["paths"])
    assert r0["votes"] == r1["votes"]
