"""Pure-NumPy float64 reference for cmlp: the test oracle.

RefMLP (forward, cross-entropy loss, backward), RefAdam and RefSGD follow the facts in
PyTorch's nn.Linear / CrossEntropyLoss / Adam / SGD semantics.
Everything is float64 so that cmlp's float32 results can be compared with stated tolerances.
"""

import numpy as np


def layer_names(num_layers):
    """Parameter names in PyTorch's order: fc1.weight, fc1.bias, fc2.weight, ..."""
    names = []
    for i in range(1, num_layers + 1):
        names += ["fc%d.weight" % i, "fc%d.bias" % i]
    return names


def rel_err(a, b):
    """Norm-wise relative error ||a - b|| / ||b|| in float64 (||a|| when b is all zeros)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError("shape mismatch: %s vs %s" % (a.shape, b.shape))
    nb = np.linalg.norm(b)
    diff = np.linalg.norm(a - b)
    return diff / nb if nb > 0 else np.linalg.norm(a)


def log_softmax(z):
    """Row-wise log-softmax, computed stably by subtracting the row maximum."""
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


class RefMLP:
    """Linear layers y = x W^T + b with ReLU between them and none after the last."""

    def __init__(self, sizes, params):
        self.sizes = tuple(int(s) for s in sizes)
        if len(self.sizes) < 2:
            raise ValueError("sizes needs at least an input and an output size")
        self.names = layer_names(len(self.sizes) - 1)
        missing = set(self.names) - set(params)
        extra = set(params) - set(self.names)
        if missing or extra:
            raise ValueError("parameter names: missing %s, unexpected %s"
                             % (sorted(missing), sorted(extra)))
        self.params = {}
        for i in range(len(self.sizes) - 1):
            fan_in, fan_out = self.sizes[i], self.sizes[i + 1]
            w = np.array(params["fc%d.weight" % (i + 1)], dtype=np.float64)
            b = np.array(params["fc%d.bias" % (i + 1)], dtype=np.float64)
            if w.shape != (fan_out, fan_in) or b.shape != (fan_out,):
                raise ValueError("layer %d: got weight %s bias %s, expected %s and %s"
                                 % (i + 1, w.shape, b.shape, (fan_out, fan_in), (fan_out,)))
            self.params["fc%d.weight" % (i + 1)] = w
            self.params["fc%d.bias" % (i + 1)] = b

    @classmethod
    def random(cls, sizes, rng):
        """nn.Linear's initialisation: weight and bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
        params = {}
        for i in range(len(sizes) - 1):
            bound = 1.0 / np.sqrt(sizes[i])
            params["fc%d.weight" % (i + 1)] = rng.uniform(-bound, bound, (sizes[i + 1], sizes[i]))
            params["fc%d.bias" % (i + 1)] = rng.uniform(-bound, bound, sizes[i + 1])
        return cls(sizes, params)

    @property
    def num_layers(self):
        return len(self.sizes) - 1

    @property
    def classes(self):
        return self.sizes[-1]

    def state_dict(self):
        return {k: v.copy() for k, v in self.params.items()}

    def _w(self, i):
        return self.params["fc%d.weight" % (i + 1)], self.params["fc%d.bias" % (i + 1)]

    def _forward(self, x):
        """Returns (logits, inputs of every layer, hidden pre-activations)."""
        h = np.asarray(x, dtype=np.float64)
        if h.ndim != 2 or h.shape[1] != self.sizes[0]:
            raise ValueError("x: expected shape [N, %d], got %s" % (self.sizes[0], h.shape))
        inputs, pre = [], []
        for i in range(self.num_layers):
            w, b = self._w(i)
            inputs.append(h)
            z = h @ w.T + b
            if i < self.num_layers - 1:
                pre.append(z)
                h = np.maximum(z, 0.0)
            else:
                h = z
        return h, inputs, pre

    def forward(self, x):
        return self._forward(x)[0]

    __call__ = forward

    def preactivations(self, x):
        """The hidden layers' pre-activations (inputs to each ReLU), one [N, width] each."""
        return self._forward(x)[2]

    def relu_margin(self, x):
        """Per sample, the smallest |pre-activation| over all hidden units (inf with none).

        A float32 implementation can only disagree with this reference about which ReLUs are
        active where this is of the order of float32 rounding, so tests keep it well above.
        """
        n = np.asarray(x).shape[0]
        margin = np.full(n, np.inf)
        for z in self.preactivations(x):
            margin = np.minimum(margin, np.abs(z).min(axis=1))
        return margin

    def _targets(self, y, n, label_smoothing):
        y = np.asarray(y)
        if y.shape != (n,):
            raise ValueError("y: expected shape [%d], got %s" % (n, y.shape))
        if y.size and (y.min() < 0 or y.max() >= self.classes):
            raise ValueError("y: labels must lie in [0, %d)" % self.classes)
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError("label_smoothing must lie in [0, 1]")
        q = np.full((n, self.classes), label_smoothing / self.classes)
        q[np.arange(n), y.astype(np.int64)] += 1.0 - label_smoothing
        return q

    def per_sample_losses(self, x, y, label_smoothing=0.0):
        logits = self.forward(x)
        q = self._targets(y, logits.shape[0], label_smoothing)
        return -(q * log_softmax(logits)).sum(axis=1)

    def loss(self, x, y, label_smoothing=0.0):
        """Mean cross-entropy (PyTorch's reduction='mean')."""
        return float(self.per_sample_losses(x, y, label_smoothing).mean())

    def loss_and_grads(self, x, y, label_smoothing=0.0, loss_scale=1.0, reduction="mean"):
        """Returns (loss, grads): loss is the mean (or sum) cross-entropy, unscaled; grads is the
        gradient of loss_scale * loss with respect to every parameter, keyed like params.

        reduction="sum" gives the sum of the per-sample losses and of their gradients, the
        building block of exact gradient accumulation.
        """
        if reduction not in ("mean", "sum"):
            raise ValueError("reduction must be 'mean' or 'sum'")
        logits, inputs, pre = self._forward(x)
        n = logits.shape[0]
        if n == 0:
            raise ValueError("empty batch")
        q = self._targets(y, n, label_smoothing)
        logp = log_softmax(logits)
        losses = -(q * logp).sum(axis=1)
        # d(sum of losses)/d logits = softmax - q per row.
        weight = loss_scale / n if reduction == "mean" else loss_scale
        delta = (np.exp(logp) - q) * weight
        grads = {}
        for i in reversed(range(self.num_layers)):
            w, _ = self._w(i)
            grads["fc%d.weight" % (i + 1)] = delta.T @ inputs[i]
            grads["fc%d.bias" % (i + 1)] = delta.sum(axis=0)
            if i > 0:
                delta = (delta @ w) * (pre[i - 1] > 0)
        loss = losses.mean() if reduction == "mean" else losses.sum()
        return float(loss), {k: grads[k] for k in self.names}

    def per_sample_grad_sum(self, x, y, label_smoothing=0.0):
        """(sum of per-sample losses, sum of per-sample gradients)."""
        return self.loss_and_grads(x, y, label_smoothing=label_smoothing, reduction="sum")

    def evaluate(self, x, y):
        """{"loss": mean cross-entropy, "accuracy": fraction of argmax(logits) == y}."""
        logits = self.forward(x)
        y = np.asarray(y)
        q = self._targets(y, logits.shape[0], 0.0)
        loss = float(-(q * log_softmax(logits)).sum(axis=1).mean())
        return {"loss": loss, "accuracy": float(np.mean(logits.argmax(axis=1) == y))}


class RefAdam:
    """torch.optim.Adam: L2 weight decay added to the gradient, or with decoupled_weight_decay
    (torch.optim.AdamW) the parameters multiplied by 1 - lr * weight_decay before the update;
    amsgrad: the denominator made of the running maximum of exp_avg_sq; maximize: the gradient's
    sign flipped first."""

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled_weight_decay=False,
                 amsgrad=False, maximize=False):
        if lr < 0:
            raise ValueError("Invalid learning rate: %r" % lr)
        if eps < 0:
            raise ValueError("Invalid epsilon value: %r" % eps)
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError("Invalid beta parameters: %r" % (betas,))
        if weight_decay < 0:
            raise ValueError("Invalid weight_decay value: %r" % weight_decay)
        self.lr = lr
        self.betas = tuple(betas)
        self.eps = eps
        self.weight_decay = weight_decay
        self.decoupled_weight_decay = decoupled_weight_decay
        self.amsgrad = amsgrad
        self.maximize = maximize
        self.t = 0
        self.exp_avg = None
        self.exp_avg_sq = None
        self.max_exp_avg_sq = None

    def step(self, params, grads):
        """Updates the float64 arrays in params in place from grads (same keys)."""
        b1, b2 = self.betas
        if self.exp_avg is None:  # state is created at the first step
            self.exp_avg = {k: np.zeros_like(p, dtype=np.float64) for k, p in params.items()}
            self.exp_avg_sq = {k: np.zeros_like(p, dtype=np.float64) for k, p in params.items()}
        if self.amsgrad and self.max_exp_avg_sq is None:
            self.max_exp_avg_sq = {k: np.zeros_like(p, dtype=np.float64) for k, p in params.items()}
        self.t += 1
        bc1 = 1.0 - b1 ** self.t
        bc2 = 1.0 - b2 ** self.t
        for k, p in params.items():
            g = np.asarray(grads[k], dtype=np.float64)
            if self.maximize:
                g = -g
            if self.decoupled_weight_decay:
                p *= 1.0 - self.lr * self.weight_decay
            elif self.weight_decay != 0:
                g = g + self.weight_decay * p
            m = self.exp_avg[k]
            v = self.exp_avg_sq[k]
            m *= b1
            m += (1.0 - b1) * g
            v *= b2
            v += (1.0 - b2) * g * g
            if self.amsgrad:
                np.maximum(self.max_exp_avg_sq[k], v, out=self.max_exp_avg_sq[k])
                v = self.max_exp_avg_sq[k]
            denom = np.sqrt(v) / np.sqrt(bc2) + self.eps
            p -= (self.lr / bc1) * m / denom


class RefSGD:
    """torch.optim.SGD with momentum, dampening, nesterov, L2 weight decay and maximize."""

    def __init__(self, lr=0.01, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0, maximize=False):
        if lr < 0:
            raise ValueError("Invalid learning rate: %r" % lr)
        if momentum < 0:
            raise ValueError("Invalid momentum value: %r" % momentum)
        if weight_decay < 0:
            raise ValueError("Invalid weight_decay value: %r" % weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        self.lr = lr
        self.momentum = momentum
        self.dampening = dampening
        self.nesterov = nesterov
        self.weight_decay = weight_decay
        self.maximize = maximize
        self.momentum_buffer = None

    def step(self, params, grads):
        """Updates the float64 arrays in params in place from grads (same keys)."""
        mu = self.momentum
        first = self.momentum_buffer is None
        if mu != 0 and first:
            self.momentum_buffer = {}
        for k, p in params.items():
            g = np.asarray(grads[k], dtype=np.float64)
            if self.maximize:
                g = -g
            if self.weight_decay != 0:
                g = g + self.weight_decay * p
            if mu != 0:
                if first:
                    buf = g.copy()  # the buffer starts as g itself, no dampening
                    self.momentum_buffer[k] = buf
                else:
                    buf = self.momentum_buffer[k]
                    buf *= mu
                    buf += (1.0 - self.dampening) * g
                g = g + mu * buf if self.nesterov else buf
            p -= self.lr * g


def finite_difference(fun, params, name, index, h):
    """Central difference (fun(p + h e) - fun(p - h e)) / 2h at params[name][index].

    fun maps a dict of arrays to a scalar; params is left unchanged. The step is taken in
    float64 exactly as given.
    """
    p = {k: np.array(v, dtype=np.float64) for k, v in params.items()}
    base = p[name][index]
    p[name][index] = base + h
    f_plus = fun(p)
    p[name][index] = base - h
    f_minus = fun(p)
    return (f_plus - f_minus) / (2.0 * h)


def numerical_grads(fun, params, h=1e-6):
    """Central-difference gradient of fun with respect to every entry of every array."""
    out = {}
    for name, value in params.items():
        g = np.zeros(np.shape(value), dtype=np.float64)
        for index in np.ndindex(g.shape):
            g[index] = finite_difference(fun, params, name, index, h)
        out[name] = g
    return out


def draw_batch(ref, rng, n, margin, scale=1.0):
    """n float32 inputs ~ N(0, scale^2) and int64 labels, redrawing any sample whose ReLU
    pre-activations (under ref) come within margin of zero, so float32 and float64 agree on
    every ReLU's state. Returns (x float32 [n, in], y int64 [n])."""
    x = (scale * rng.standard_normal((n, ref.sizes[0]))).astype(np.float32)
    for _ in range(1000):
        bad = ref.relu_margin(x) < margin
        if not bad.any():
            break
        x[bad] = (scale * rng.standard_normal((int(bad.sum()), ref.sizes[0]))).astype(np.float32)
    else:
        raise RuntimeError("could not draw a batch with ReLU margin %g" % margin)
    y = rng.integers(0, ref.classes, size=n).astype(np.int64)
    return x, y
