"""The classic PyTorch MNIST loop, written with cmlp.

PyTorch (the original):

    model = SimpleMLP()                                  # 784-512-256-10, ReLU
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(5):
        for data, target in train_loader:                # batch 32, Normalize((0.5,), (0.5,))
            optimizer.zero_grad()
            loss = criterion(model(data), target)
            loss.backward()
            optimizer.step()

Below, the same loop step by step with cmlp, then the same training with the C epoch loop
(Trainer.fit), which is what you would normally write. Gradient accumulation is shown the
correct way: four DISTINCT micro-batches of 8 whose gradients add up to one batch of 32 (the
common recipe reruns one batch four times).

Run: python examples/train_fashion_mnist.py [--epochs 5]
"""
import argparse

import numpy as np

import cmlp


def manual_loop(x, y, xte, yte, epochs):
    model = cmlp.MLP([784, 512, 256, 10], seed=0)
    optimizer = cmlp.optim.Adam(model, lr=1e-3)
    rng = np.random.default_rng(0)
    for epoch in range(epochs):
        order = rng.permutation(len(x))
        for start in range(0, len(x), 32):
            idx = order[start:start + 32]
            optimizer.zero_grad()
            # accumulation over 4 distinct micro-batches: each contributes (its samples / 32)
            for part in np.array_split(idx, 4):
                if len(part):
                    model.forward_backward(x[part], y[part], loss_scale=len(part) / len(idx))
            optimizer.step()
        print(f"manual loop, epoch {epoch + 1}: test accuracy {model.evaluate(xte, yte)['accuracy']:.4f}")
    return model


def trainer_loop(x, y, xte, yte, epochs):
    model = cmlp.MLP([784, 512, 256, 10], seed=0)
    optimizer = cmlp.optim.Adam(model, lr=1e-3)
    trainer = cmlp.Trainer(model, optimizer, batch_size=32)
    for h in trainer.fit(x, y, epochs=epochs, validation_data=(xte, yte)):
        print(f"Trainer.fit, epoch {h['epoch']}: loss {h['loss']:.4f}, test accuracy {h['val_accuracy']:.4f}, "
              f"{h['samples_per_second']:,.0f} samples/s, peak memory {h['peak_memory_bytes'] / 2**20:.1f} MiB")
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--manual-samples", type=int, default=6000,
                    help="training samples for the step-by-step loop (it is Python-driven, so slower)")
    args = ap.parse_args()
    if args.epochs < 1 or args.manual_samples < 1:
        ap.error("--epochs and --manual-samples must be >= 1")
    (x, y), (xte, yte) = cmlp.datasets.fashion_mnist()
    manual_loop(x[:args.manual_samples], y[:args.manual_samples], xte, yte, args.epochs)
    trainer_loop(x, y, xte, yte, args.epochs)
    print(cmlp.memory.memory_summary("cpu"))


if __name__ == "__main__":
    main()
