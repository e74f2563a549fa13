"""End to end: one epoch of the reference setup (MLP 784-512-256-10 seed 0, Adam lr 1e-3,
batch 32, shuffled with seed 0) on the full Fashion-MNIST reaches at least 80 % test accuracy
(PyTorch's loop on the same setup reaches 82.2 % after epoch 1).
"""

import numpy as np
import pytest

import cmlp


@pytest.fixture(scope="module")
def fashion():
    try:
        return cmlp.datasets.fashion_mnist()
    except FileNotFoundError:
        pytest.skip("Fashion-MNIST is not installed")


def test_one_epoch_of_the_reference_setup(fashion):
    (x_train, y_train), (x_test, y_test) = fashion
    assert x_train.shape == (60000, 784) and x_test.shape == (10000, 784)
    model = cmlp.MLP([784, 512, 256, 10], seed=0)
    opt = cmlp.optim.Adam(model, lr=1e-3)
    trainer = cmlp.Trainer(model, opt, batch_size=32, shuffle=True, seed=0)
    before = model.evaluate(x_test, y_test)["accuracy"]
    history = trainer.fit(x_train, y_train, epochs=1, validation_data=(x_test, y_test), progress=False)
    h = history[0]
    assert before < 0.3
    assert h["val_accuracy"] >= 0.80, h
    assert h["loss"] < 0.7 and h["val_loss"] < 0.7, h
    assert opt.state_dict()["state"][0]["step"] == 1875.0
    ev = model.evaluate(x_test, y_test)
    assert ev["accuracy"] == pytest.approx(h["val_accuracy"], abs=1e-12)
    assert np.mean(model.predict(x_test) == y_test) == pytest.approx(ev["accuracy"], abs=1e-12)
