"""Data-parallel benchmark on the CPU: the reference workload (MLP 784-512-256-10, ReLU,
cross-entropy, Adam lr=1e-3) on Fashion-MNIST with RANKS processes started by mpirun, one
thread each, batch B per rank (B * RANKS samples per step), for cmlp and for PyTorch's
DistributedDataParallel (backend gloo) in the same run.

  - cmlp: cmlp.distributed.init_process_group("mpi"), Trainer(batch_size=B).fit over one
    epoch (after a warm-up epoch of at most WARM steps); samples/s of the whole group from the
    history (all ranks' samples over the epoch's time).
  - PyTorch: DistributedDataParallel(nn.Sequential(...)), nn.CrossEntropyLoss,
    torch.optim.Adam(fused=True), a DistributedSampler-style split (every rank the same seeded
    permutation, its contiguous share of each step's B * RANKS samples), images normalised once
    into a float32 tensor, zero_grad(set_to_none=True); 50 warm-up steps, then the same number
    of steps as cmlp's epoch, timed between barriers.
  - one process: the same workload on one process with RANKS threads (cmlp fit; PyTorch's loop
    with torch.set_num_threads(RANKS)) at batch B * RANKS: the update data parallelism must
    match, on the same cores.
  - sharded optimizer state (--zero, ZeRO stage 1): cmlp's ZeroRedundancyOptimizer(model,
    Adam) in the same fit, against torch.distributed.optim.ZeroRedundancyOptimizer(Adam) under
    DDP in the same loop; besides samples/s, the largest optimizer state any rank holds (bytes
    of Adam's buffers) and cmlp's peak allocated memory on rank 0 (max_memory_allocated),
    sharded and not.
Every number is the best of REPEATS runs (memory is the same in every run). Targets: cmlp's
data-parallel samples/s at least PyTorch DDP's at every batch, sharded or not; sharded, no rank
holds more than 1/RANKS of the state (rounded up to 64 floats).

Run from the repository root (needs mpirun; PyTorch optional):
    PYTHONPATH=python python3 bench/bench_distributed.py [--ranks 2] [--batches 32,512]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

SIZES = [784, 512, 256, 10]
REPEATS = 3
WARM = 100


def mpi_env():
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl_vader_single_copy_mechanism="none")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.path.join(here, "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                                        else "")
    return env


def data():
    import cmlp
    (x, y), _ = cmlp.datasets.fashion_mnist()
    return x, y


# ---------------------------------------------------------------- workers (one rank each)

def cmlp_worker(batch, zero):
    import cmlp
    d = cmlp.distributed
    d.init_process_group("mpi")
    x, y = data()
    model = cmlp.MLP(SIZES, seed=0)
    opt = (d.optim.ZeroRedundancyOptimizer(model, cmlp.optim.Adam, lr=1e-3) if zero
           else cmlp.optim.Adam(model, lr=1e-3))
    trainer = cmlp.Trainer(model, opt, batch_size=batch)
    steps = -(-len(x) // (batch * d.get_world_size()))
    warm = min(WARM, steps) * batch * d.get_world_size()
    trainer.fit(x[:warm], y[:warm], epochs=1, progress=False)
    h = trainer.fit(x, y, epochs=1, progress=False)[0]
    state = np.array([cmlp.memory.memory_breakdown().get("optimizer state", 0)], dtype=np.int64)
    d.all_reduce(state, "max")
    if d.get_rank() == 0:
        print(json.dumps({"samples_per_second": h["samples_per_second"], "steps": steps, "loss": h["loss"],
                          "state": int(state[0]), "peak": cmlp.memory.max_memory_allocated()}))
    d.destroy_process_group()


def torch_worker(batch, steps, port, zero):
    import torch
    import torch.distributed as td
    import torch.nn as nn
    rank, world = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    torch.set_num_threads(1)
    td.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x, y = data()
    xt = (torch.from_numpy(x).float() / 255.0 - 0.5) / 0.5
    yt = torch.from_numpy(y.astype(np.int64))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
    model = nn.parallel.DistributedDataParallel(net)
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3, fused=True)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(xt), generator=g)
    per_step = batch * world

    def run(n):
        for s in range(n):
            start = (s * per_step) % (len(xt) - per_step)
            idx = perm[start + rank * batch:start + (rank + 1) * batch]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(xt[idx]), yt[idx])
            loss.backward()
            opt.step()

    run(50)
    td.barrier()
    t0 = time.perf_counter()
    run(steps)
    td.barrier()
    seconds = time.perf_counter() - t0
    local = opt.optim if zero else opt  # ZeroRedundancyOptimizer: this rank's own optimizer
    held = sum(v.numel() * v.element_size() for s in local.state.values() for k, v in s.items()
               if k in ("exp_avg", "exp_avg_sq"))
    state = torch.tensor([held], dtype=torch.int64)
    td.all_reduce(state, op=td.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({"samples_per_second": steps * per_step / seconds, "state": int(state[0])}))
    td.destroy_process_group()


# ---------------------------------------------------------------- one process, RANKS threads

def cmlp_single(batch, threads):
    import cmlp
    x, y = data()
    model = cmlp.MLP(SIZES, seed=0)
    trainer = cmlp.Trainer(model, cmlp.optim.Adam(model, lr=1e-3), batch_size=batch)
    warm = min(WARM * batch, len(x))
    trainer.fit(x[:warm], y[:warm], epochs=1, progress=False)
    return trainer.fit(x, y, epochs=1, progress=False)[0]["samples_per_second"]


def torch_single(batch, threads):
    import torch
    import torch.nn as nn
    torch.set_num_threads(threads)
    x, y = data()
    xt = (torch.from_numpy(x).float() / 255.0 - 0.5) / 0.5
    yt = torch.from_numpy(y.astype(np.int64))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    loss_fn = nn.CrossEntropyLoss()
    perm = torch.randperm(len(xt))

    def run(n):
        for s in range(n):
            start = (s * batch) % (len(xt) - batch)
            idx = perm[start:start + batch]
            opt.zero_grad(set_to_none=True)
            loss_fn(model(xt[idx]), yt[idx]).backward()
            opt.step()

    run(50)
    steps = -(-len(xt) // batch)
    t0 = time.perf_counter()
    run(steps)
    return steps * batch / (time.perf_counter() - t0)


# ---------------------------------------------------------------- driver

def job(ranks, args, timeout=900):
    cmd = [shutil.which("mpirun"), "-np", str(ranks), sys.executable, os.path.abspath(__file__), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: mpirun exited {p.returncode}\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batches", default="32,512", help="batch sizes per rank, comma-separated")
    ap.add_argument("--worker", choices=["cmlp", "torch"], help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--zero", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker == "cmlp":
        return cmlp_worker(a.batch, a.zero)
    if a.worker == "torch":
        return torch_worker(a.batch, a.steps, a.port, a.zero)
    if not shutil.which("mpirun"):
        sys.exit("bench_distributed: mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)")
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    import cmlp
    batches = [int(b) for b in a.batches.split(",")]
    best = {b: {"cmlp": 0.0, "torch": 0.0, "cmlp1": 0.0, "torch1": 0.0, "zcmlp": 0.0, "ztorch": 0.0}
            for b in batches}
    memory = {}  # (library, sharded) -> largest state on a rank (and cmlp's peak)
    port = 29500 + os.getpid() % 1000
    for rep in range(REPEATS):
        for b in batches:
            for zero in (False, True):
                flag = ["--zero"] if zero else []
                r = job(a.ranks, ["--worker", "cmlp", "--batch", str(b)] + flag)
                key = "zcmlp" if zero else "cmlp"
                best[b][key] = max(best[b][key], r["samples_per_second"])
                memory["cmlp", zero] = (r["state"], r["peak"])
                if have_torch:
                    t = job(a.ranks, ["--worker", "torch", "--batch", str(b), "--steps", str(r["steps"]), "--port",
                                      str(port + rep * 20 + 2 * batches.index(b) + zero)] + flag)
                    key = "ztorch" if zero else "torch"
                    best[b][key] = max(best[b][key], t["samples_per_second"])
                    memory["torch", zero] = (t["state"], None)
            best[b]["cmlp1"] = max(best[b]["cmlp1"], cmlp_single(b * a.ranks, a.ranks))
            if have_torch:
                best[b]["torch1"] = max(best[b]["torch1"], torch_single(b * a.ranks, a.ranks))
            print(f"run {rep + 1}: batch {b} x {a.ranks}: {best[b]}", file=sys.stderr, flush=True)
    print(f"machine: nproc {os.cpu_count()}, cmlp {cmlp.__version__}, MPI: "
          f"{subprocess.run(['mpirun', '--version'], capture_output=True, text=True).stdout.splitlines()[0]}"
          + (f", torch {__import__('torch').__version__} (gloo)" if have_torch else ", no torch"))
    print(f"| batch per rank x ranks | cmlp samples/s | PyTorch DDP samples/s | ratio | cmlp 1 process "
          f"({a.ranks} threads, batch x {a.ranks}) | PyTorch 1 process |")
    print("|---|---:|---:|---:|---:|---:|")
    met = True
    for b in batches:
        r = best[b]
        ratio = r["cmlp"] / r["torch"] if r["torch"] else float("nan")
        met = met and (not have_torch or ratio >= 1.0)
        print(f"| {b} x {a.ranks} | {r['cmlp']:,.0f} | {r['torch']:,.0f} | {ratio:.2f}x | {r['cmlp1']:,.0f} | "
              f"{r['torch1']:,.0f} |")
    print(f"target: cmlp data-parallel >= PyTorch DDP at every batch: {'met' if met else 'MISSED'}")
    print()
    print("sharded optimizer state (ZeroRedundancyOptimizer):")
    print("| batch per rank x ranks | cmlp samples/s | PyTorch ZeRO + DDP samples/s | ratio | cmlp unsharded |")
    print("|---|---:|---:|---:|---:|")
    for b in batches:
        r = best[b]
        ratio = r["zcmlp"] / r["ztorch"] if r["ztorch"] else float("nan")
        met = met and (not have_torch or ratio >= 1.0)
        print(f"| {b} x {a.ranks} | {r['zcmlp']:,.0f} | {r['ztorch']:,.0f} | {ratio:.2f}x | {r['cmlp']:,.0f} |")
    n = sum(i * o + o for i, o in zip(SIZES, SIZES[1:]))
    part = 2 * 4 * -(-(-(-n // a.ranks)) // 64) * 64
    print(f"largest Adam state on a rank: cmlp {memory['cmlp', False][0]:,} B unsharded, "
          f"{memory['cmlp', True][0]:,} B sharded (1/{a.ranks} in parts of 64 floats: {part:,} B)"
          + (f"; PyTorch {memory['torch', False][0]:,} B unsharded, {memory['torch', True][0]:,} B sharded "
             "(whole tensors per rank)" if have_torch else ""))
    print(f"cmlp peak allocated on rank 0: {memory['cmlp', False][1]:,} B unsharded, {memory['cmlp', True][1]:,} B "
          "sharded")
    met = met and memory["cmlp", True][0] == part
    print(f"targets: cmlp >= PyTorch at every batch, sharded or not; sharded state = 1/{a.ranks}: "
          f"{'met' if met else 'MISSED'}")


if __name__ == "__main__":
    main()
