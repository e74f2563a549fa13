"""The reference MLP trained data-parallel: one process per rank, started by mpirun.

    mpirun -np 2 python examples/train_distributed.py [--epochs 5] [--device cuda] [--zero]

Every rank loads the same data set and makes the same model and trainer; the Trainer made while
the process group exists splits each step's samples between the ranks (batch 32 per rank) and
sums their gradients before the update, so the ranks hold identical parameters throughout, and
the update equals one process training on all the step's samples. On GPUs (--device cuda) each
rank takes the GPU of its place on its machine and NCCL sums the gradients; on the CPU, MPI.
With --zero each rank keeps Adam's state for its part of the parameters only
(cmlp.distributed.optim.ZeroRedundancyOptimizer): the same updates, less memory per rank.
Rank 0 reports.
"""
import argparse

import cmlp


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--zero", action="store_true", help="shard the optimizer's state over the ranks")
    a = p.parse_args()
    if a.epochs < 1:
        p.error("--epochs must be >= 1")
    dist = cmlp.distributed
    dist.init_process_group("nccl" if a.device == "cuda" else "mpi")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{dist.get_local_rank()}" if a.device == "cuda" else "cpu"

    (x, y), (xte, yte) = cmlp.datasets.fashion_mnist()
    model = cmlp.MLP([784, 512, 256, 10], device=device, seed=0)
    opt: cmlp.optim.Optimizer
    if a.zero:
        opt = dist.optim.ZeroRedundancyOptimizer(model, cmlp.optim.Adam, lr=1e-3)
    else:
        opt = cmlp.optim.Adam(model, lr=1e-3)
    trainer = cmlp.Trainer(model, opt, batch_size=32)
    if rank == 0:
        print(f"{world} ranks ({dist.get_backend()}, {dist.library_version()}), batch 32 per rank: "
              f"{32 * world} samples per step" + (", optimizer state sharded" if a.zero else ""))
    for epoch in range(1, a.epochs + 1):
        h = trainer.fit(x, y, epochs=1, validation_data=(xte, yte), progress=rank == 0)[0]
        if rank == 0:
            held = cmlp.memory.memory_breakdown(device).get("optimizer state", 0)
            print(f"epoch {epoch}: loss {h['loss']:.4f}, test accuracy {100 * h['val_accuracy']:.2f}%, "
                  f"{h['samples_per_second']:,.0f} samples/s over all ranks, optimizer state on rank 0 "
                  f"{held / 2**20:.2f} MiB, peak {h['peak_memory_bytes'] / 2**20:.2f} MiB", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
