"""The classic out-of-memory story, told with cmlp under a memory limit on the CPU.

The usual PyTorch answer to "CUDA out of memory" is by hand:

    try:
        output = model(input)
    except RuntimeError as e:
        if 'out of memory' in str(e):
            torch.cuda.empty_cache()
            input = torch.randn(16, 3, 224, 224).cuda()   # half the batch, then retry
            output = model(input)

Here the same batch that does not fit, three ways:
  (a) it fails: the OutOfMemoryError says what was asked, what is held, what is free, and the
      memory history (torch's _record_memory_history) says what held the memory and which call
      ran out (--history PATH also writes it for https://pytorch.org/memory_viz);
  (b) the usual catch-and-halve: it runs, but on half the samples, so it is another update;
  (c) cmlp.Trainer(auto_microbatch=True): the same batch as accumulated micro-batches, the same
      weights as a run without the limit, and the planner's breakdown says why it fits.

Run: python examples/oom_story.py [--batch-size 8192] [--limit 64MB] [--history PATH]
"""
import argparse
import gc
import time
import warnings

import numpy as np

import cmlp

M = cmlp.memory
DEV = "cpu"
LAYERS = [784, 512, 256, 10]


def load(n):
    """The first n Fashion-MNIST training images (uint8) if installed, else random images."""
    try:
        (x, y), _ = cmlp.datasets.fashion_mnist()
        return x[:n], y[:n], "Fashion-MNIST"
    except FileNotFoundError:
        rng = np.random.default_rng(0)
        return rng.integers(0, 256, (n, 784), dtype=np.uint8), rng.integers(0, 10, n), "random images"


def fresh():
    """A new model and optimizer (same seed every time) on an allocator with nothing cached."""
    gc.collect()
    M.empty_cache(DEV)
    M.reset_peak_memory_stats(DEV)  # each part's peaks its own
    model = cmlp.MLP(LAYERS, device=DEV, seed=0)
    return model, cmlp.optim.Adam(model, lr=1e-3)


def header(title):
    print(f"\n{'=' * 78}\n{title}\n{'=' * 78}")


def max_rel_diff(a, b):
    return max(float(np.linalg.norm(a[k] - b[k]) / np.linalg.norm(b[k])) for k in b)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=8192)
    ap.add_argument("--limit", type=M.parse_size, default=M.parse_size("64MB"), help="the memory cap, e.g. 64MB")
    ap.add_argument("--steps", type=int, default=2, help="steps of the run (the first is (a)'s and (b)'s)")
    ap.add_argument("--history", default=None, help="write (a)'s memory snapshot and history here (.pickle)")
    args = ap.parse_args()
    if args.batch_size < 1 or args.steps < 2:
        ap.error("--batch-size must be >= 1 and --steps >= 2")
    batch, limit = args.batch_size, args.limit
    x, y, source = load(batch * args.steps)
    started = time.perf_counter()

    header(f"The setting: MLP {'-'.join(map(str, LAYERS))}, Adam, batch {batch}, {args.steps} steps on "
           f"{source}, memory limit {M._fmt(limit)}")
    plan = M.plan(LAYERS, batch, "adam")
    print(plan)
    print(f"largest batch that fits in {M._fmt(limit)}: {M.max_batch_size(LAYERS, limit, 'adam')}")

    # the references: the same training without a limit, after its first step and at the end
    model, opt = fresh()
    trainer = cmlp.Trainer(model, opt, batch_size=batch, shuffle=False)
    trainer.step(x[:batch], y[:batch])
    first_step = model.state_dict()
    trainer.fit(x[batch:], y[batch:], epochs=1, progress=False)
    reference = model.state_dict()
    del trainer, model, opt

    try:
        header("(a) The batch does not fit: cmlp.OutOfMemoryError")
        model, opt = fresh()
        M.set_memory_limit(limit, DEV)
        M._record_memory_history(device=DEV, clear_history=True)
        trainer = cmlp.Trainer(model, opt, batch_size=batch, shuffle=False, auto_microbatch=False)
        before = model.state_dict()
        try:
            trainer.step(x[:batch], y[:batch])
            print("it fitted after all: raise --batch-size or lower --limit")
        except cmlp.OutOfMemoryError as e:
            print(f"{type(e).__name__}: {e}")
            print("\nthe memory history, in words (cmlp.memory.snapshot_report):")
            print(M.snapshot_report(M._snapshot(DEV), top=3), end="")
            if args.history:
                M._dump_snapshot(args.history, device=DEV)
                print(f"written to {args.history}: open it at https://pytorch.org/memory_viz")
        M._record_memory_history(None, device=DEV)
        after = model.state_dict()
        print(f"the model is unchanged: {all(np.array_equal(before[k], after[k]) for k in before)}")
        del trainer, model, opt
        M.set_memory_limit(None, DEV)

        header("(b) The usual fix: catch, empty_cache(), halve the batch, retry")
        model, opt = fresh()
        M.set_memory_limit(limit, DEV)
        n = batch
        while True:
            try:
                opt.zero_grad()
                model.forward_backward(x[:n], y[:n])
                opt.step()
                break
            except cmlp.OutOfMemoryError:
                print(f"out of memory with a batch of {n}: empty_cache() and retry with {n // 2}")
                cmlp.empty_cache()
                n //= 2
                if n == 0:
                    raise
        print(f"it ran, on {n} of the {batch} samples: the gradient is another batch's, so the update differs")
        print(f"max relative difference from the first step of the unlimited run: "
              f"{max_rel_diff(model.state_dict(), first_step):.2e}")
        del model, opt
        M.set_memory_limit(None, DEV)

        header("(c) cmlp's automatic handling: Trainer(auto_microbatch=True)")
        model, opt = fresh()
        M.set_memory_limit(limit, DEV)
        trainer = cmlp.Trainer(model, opt, batch_size=batch, shuffle=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", cmlp.MemoryWarning)
            history = trainer.fit(x, y, epochs=1, progress=False)
        for w in caught:
            print(f"{w.category.__name__}: {w.message}")
        h = history[0]
        reserved = M.max_memory_reserved(DEV)
        where = f"under the limit of {M._fmt(limit)}" if reserved <= limit else \
            f"over the limit of {M._fmt(limit)}: the model's own segment was reserved before the limit was set"
        print(f"trained {args.steps} steps of {batch} samples in micro-batches of {h['microbatch_size']}; "
              f"peak allocated {M._fmt(h['peak_memory_bytes'])}, peak reserved {M._fmt(reserved)} {where}")
        print(f"max relative difference from the unlimited run: {max_rel_diff(model.state_dict(), reference):.2e} "
              f"(the same update, summed in another order)")
        print("\nwhat the planner says one micro-batch needs:")
        print(M.plan(LAYERS, h["microbatch_size"], opt))
    finally:
        M.set_memory_limit(None, DEV)
    print(f"\n{time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
