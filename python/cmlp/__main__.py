"""The command line: `python -m cmlp train` trains the reference MLP (784-512-256-10, Adam
lr 1e-3, batch 32, 5 epochs) on Fashion-MNIST and reports each epoch; `python -m cmlp plan`
predicts a run's memory (and, given a budget, the largest batch that fits) before anything is
allocated; `python -m cmlp snapshot PATH` describes a memory snapshot; `python -m cmlp info` prints
what this build is made of. Under mpirun, `python -m cmlp train --distributed` trains
data-parallel, one rank per process."""
import argparse
import json
import os
import re
import sys
import tempfile
import warnings
from typing import Any, Callable, List, Optional, Tuple

from . import MLP, Trainer, _cmlp, build_info, cuda, datasets, distributed, memory, optim
from .optim import lr_scheduler
from .optim._groups import _FLT_MAX


def _layers(text: str) -> List[int]:
    try:
        sizes = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints such as 784,512,256,10, got {text!r}")
    if len(sizes) < 2:
        raise argparse.ArgumentTypeError(f"expected an input and an output size at least, such as 784,10, got "
                                         f"{text!r}")
    bad = [v for v in sizes if not 1 <= v <= 1 << 24]
    if bad:
        raise argparse.ArgumentTypeError(f"expected sizes in [1, 2**24], got {bad[0]} in {text!r}")
    return sizes


def _device(text: str) -> str:
    """"cpu" (or "cpu:0"), "cuda" or "cuda:N", checked as written (whether the GPU is there is said
    when it is opened)."""
    if not re.fullmatch(r"cpu(:0)?|cuda(:\d{1,2})?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def _bounded(convert: Callable[[str], float], what: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    """An argparse type: text converted, then checked (a bad one is an argparse error saying what)."""
    def parse(text: str) -> float:
        try:
            v = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v
    return parse


_count = _bounded(int, "an int >= 1", lambda v: v >= 1)  # epochs, batch size, accumulation steps
_epochs = _bounded(int, "an int in [1, 2**31 - 1]", lambda v: 1 <= v <= 2**31 - 1)  # as Trainer.fit's
_steps = _bounded(int, "an int >= 0", lambda v: v >= 0)  # warm-up steps
_rows = _bounded(int, "an int in [0, 2**56)", lambda v: 0 <= v < 2**56)  # a data set's samples
# lr, momentum, weight decay: the optimizers take them finite in float32
_rate = _bounded(float, "a finite number >= 0 (in float32's range)", lambda v: 0.0 <= v <= _FLT_MAX)
_positive = _bounded(float, "a number > 0", lambda v: v > 0.0)  # max grad norm


def _output(flag: str, example: str) -> Callable[[str], str]:
    """An argparse type for a file written after training, checked before it: not a directory,
    in a writable one that exists."""
    def check(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError(f"{flag} needs a file name, e.g. {example}")
        if os.path.isdir(text) or text.endswith(os.sep):
            what = "is a directory" if os.path.isdir(text) else "names a directory"
            raise argparse.ArgumentTypeError(f"{flag} {text!r} {what}; give a file name in it, e.g. "
                                             f"{os.path.join(text, example)}")
        target = os.path.realpath(text)  # what the save writes: a link's target, in its directory
        parent = os.path.dirname(target)
        try:
            too_long = len(os.fsencode(os.path.basename(target))) > os.pathconf(parent, "PC_NAME_MAX")
        except (OSError, ValueError):
            too_long = False
        if too_long:
            raise argparse.ArgumentTypeError(f"{flag}: the file name {os.path.basename(target)!r} is too long")
        if not os.path.isdir(parent):
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: the directory {parent!r} does not exist")
        try:  # a file made there and removed, as the save makes its own: os.access says yes to root anywhere
            fd, trial = tempfile.mkstemp(prefix=".cmlp-trial-", dir=parent)
            os.close(fd)
            os.unlink(trial)
        except OSError as e:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: cannot write in the directory {parent!r} "
                                             f"({e.strerror or e})") from None
        return text
    return check


def _size(text: str) -> int:
    """A number of bytes > 0, or a size such as 256MB."""
    try:
        n = memory.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a size > 0 such as 256MB, got {text!r}")
    return n


def _capability(text: str) -> int:
    """A compute capability such as 9.0 (or 9): its major number."""
    match = re.fullmatch(r"(\d{1,2})(?:\.\d{1,2})?", text.strip())
    if not match or int(match.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"expected a compute capability such as 8.0 or 9.0, got {text!r}")
    return int(match.group(1))


class _Help(argparse.HelpFormatter):
    """Help that shows each option's default where it has one and the text does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is not None and action.default is not False and action.default != argparse.SUPPRESS \
                and "default" not in text:
            shown = ",".join(map(str, action.default)) if isinstance(action.default, list) else action.default
            text += f" (default: {shown})"
        return text


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose --help raises where its output fails (argparse's own drops the
    error: the command would end with status 0 having written nothing)."""

    def print_help(self, file: Any = None) -> None:
        file = sys.stdout if file is None else file
        if file is not None:  # (none: pythonw, or stdout closed with >&-, where argparse prints nothing either)
            file.write(self.format_help())


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m cmlp", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train an MLP on (Fashion-)MNIST and report each epoch", formatter_class=_Help)
    t.add_argument("--dataset", choices=["fashion-mnist", "mnist"], default="fashion-mnist", help="the data set")
    t.add_argument("--data-dir", default=None,
                   help="directory with the four IDX files (default: fashion-mnist in $CMLP_DATA_DIR, ./data or "
                        "~/.cache/cmlp, then where Debian's dataset-fashion-mnist puts it; mnist: ./data)")
    t.add_argument("--epochs", type=_epochs, default=5, help="passes over the training set")
    t.add_argument("--batch-size", type=_count, default=32,
                   help="samples computed at once (the micro-batch; split further where --memory-limit needs it)")
    t.add_argument("--accumulation-steps", type=_count, default=1,
                   help="micro-batches (each of distinct samples) whose gradients add up to one optimizer step")
    t.add_argument("--amp", choices=["fp16", "bf16"], default=None,
                   help="mixed precision with fp32 master weights (fp16: with dynamic loss scaling) (default: fp32)")
    t.add_argument("--recompute", action="store_true",
                   help="keep no hidden activations for the backward pass: recompute them (less memory, more time)")
    t.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N")
    t.add_argument("--optimizer", choices=["adam", "adamw", "sgd"], default="adam", help="the optimizer")
    t.add_argument("--weight-decay", type=_rate, default=None, help="default: 0, and 1e-2 for adamw")
    t.add_argument("--no-bias-decay", action="store_true",
                   help="weight decay on the weights only: the biases in a param group of their own without it")
    t.add_argument("--lr", type=_rate, default=None, help="default: 1e-3 for adam and adamw, 0.01 for sgd")
    t.add_argument("--momentum", type=_rate, default=0.0, help="sgd only (default: 0)")
    t.add_argument("--amsgrad", action="store_true", help="adam and adamw: AMSGrad (torch's amsgrad=True)")
    t.add_argument("--layers", type=_layers, default=[784, 512, 256, 10], help="the layer sizes, input first")
    t.add_argument("--memory-limit", type=_size, default=None,
                   help="cap the memory the device's allocator may reserve, e.g. 256MB (the trainer fits its steps "
                        "under it in micro-batches)")
    t.add_argument("--max-grad-norm", type=_positive, default=None,
                   help="clip each step's gradients to this L2 norm (torch's clip_grad_norm_)")
    t.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant",
                   help="the rate over the run, stepped with every optimizer step: constant, or cosine decay "
                        "(CosineAnnealingLR over the steps after the warm-up: 0 once the last step is taken)")
    t.add_argument("--warmup-steps", type=_steps, default=0,
                   help="raise the rate linearly over this many first steps (from lr / N to lr)")
    t.add_argument("--seed", type=_bounded(int, "an int in [0, 2**64)", lambda v: 0 <= v < 2**64), default=0,
                   help="the initial weights' and the shuffle's seed")
    t.add_argument("--save", type=_output("--save", "model.npz"), default=None,
                   help="write the trained model here (.npz)")
    t.add_argument("--memory-history", type=_output("--memory-history", "snapshot.pickle"), default=None,
                   metavar="PATH",
                   help="record what the device's allocator does and write the snapshot with its history here "
                        "when training ends or fails (PyTorch's format: open it at https://pytorch.org/memory_viz); "
                        "data-parallel, each rank writes PATH with .rankN before its extension")
    t.add_argument("--no-progress", action="store_true",
                   help="no progress bars (to a file or a pipe, the bars are whole lines: each 30 s and at each "
                        "epoch's end)")
    t.add_argument("--distributed", action="store_true",
                   help="data-parallel over the ranks mpirun started (MPI on the CPU, NCCL on GPUs: --device cuda "
                        "takes the GPU of the rank's place on its machine); --batch-size is per rank")
    t.add_argument("--zero", action="store_true",
                   help="with --distributed: each rank keeps the optimizer's state for its part of the parameters "
                        "only (cmlp.distributed.optim.ZeroRedundancyOptimizer, ZeRO stage 1)")
    pl = sub.add_parser("plan", help="predict a training run's memory, by category, before allocating anything",
                        formatter_class=_Help)
    pl.add_argument("--layers", type=_layers, default=[784, 512, 256, 10], help="the layer sizes, input first")
    pl.add_argument("--batch-size", type=_count, default=32, help="rows computed at once (the micro-batch)")
    pl.add_argument("--accumulation-steps", type=_count, default=1,
                    help="micro-batches of --batch-size a step accumulates (train's --accumulation-steps)")
    pl.add_argument("--amp", choices=["fp16", "bf16"], default=None, help="mixed precision (default: fp32)")
    pl.add_argument("--recompute", action="store_true", help="activations recomputed in the backward pass")
    pl.add_argument("--optimizer", choices=["adam", "adamw", "sgd"], default="adam", help="the optimizer")
    pl.add_argument("--momentum", type=_rate, default=0.0, help="sgd only: a momentum buffer when not 0 (default: 0)")
    pl.add_argument("--amsgrad", action="store_true", help="adam and adamw: AMSGrad's third state buffer")
    pl.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N")
    pl.add_argument("--gpu-capability", type=_capability, default=None, metavar="MAJOR.MINOR",
                    help="with --device cuda: plan for a GPU of this compute capability (e.g. 9.0) that need not be "
                         "here, as cmlp.memory.plan's device_properties (the workspace a GPU holds once open depends "
                         "on it)")
    pl.add_argument("--gpu-memory", type=_size, default=None,
                    help="with --gpu-capability: that GPU's memory, e.g. 80GB (default: no bound)")
    pl.add_argument("--optimizer-shards", type=_count, default=1, metavar="RANKS",
                    help="the optimizer's state sharded over this many ranks (train --distributed --zero)")
    pl.add_argument("--validation-rows", type=_rows, default=0, metavar="N",
                    help="the run also evaluates N uint8 samples after each epoch (train's 10,000 test images): "
                         "plan their buffers too")
    pl.add_argument("--data-rows", type=_rows, default=0, metavar="N",
                    help="the fit's training samples (train's 60,000), which on a GPU it keeps on the device for the "
                         "run where the step keeps its room under --budget, or else stages batch by batch: plan them "
                         "too (the CPU reads them in place)")
    pl.add_argument("--data-dtype", choices=["uint8", "float32"], default=None,
                    help="with --data-rows: the samples' type (default uint8, as images)")
    pl.add_argument("--epochs", type=_epochs, default=None,
                    help="with --validation-rows, the run's epochs (default 5, as train's): each validation gives the step's buffers back "
                         "and the next epoch takes them again (the --budget search counts one: at a limit, what "
                         "later epochs add to the cache is given back)")
    pl.add_argument("--budget", type=_size, default=None,
                    help="e.g. 2GB, as a --memory-limit would be: also print the largest batch whose run fits "
                         "(beside what the device holds once open); the exit status is 1 where the run as planned does "
                         "not fit")
    sn = sub.add_parser("snapshot", help="describe a memory snapshot (--memory-history, cmlp.memory._dump_snapshot, "
                                         "or PyTorch's): its peak, what held it, what ran out of memory",
                        formatter_class=_Help)
    sn.add_argument("path", help="the pickled snapshot")
    sn.add_argument("--device", type=_steps, default=None, help="the device index (default: the longest history)")
    sn.add_argument("--top", type=_steps, default=5, help="blocks and failed requests shown (default 5)")
    sub.add_parser("info", help="print the build: version, BLAS, CUDA, devices")
    return p


def _schedule(opt: optim.Optimizer, kind: str, warmup: int, steps: int) -> Optional[lr_scheduler.LRScheduler]:
    """The rate over `steps` optimizer steps: `warmup` first steps from lr / warmup up to lr,
    then constant or cosine decay to 0 by the last step (None: the rate stays as it is)."""
    parts: List[lr_scheduler.LRScheduler] = []
    milestones: List[int] = []
    if warmup:
        parts.append(lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / warmup)))
    if kind == "cosine":
        if parts:
            milestones.append(warmup)
        parts.append(lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, steps - warmup)))
    if len(parts) <= 1:
        return parts[0] if parts else None
    return lr_scheduler.SequentialLR(opt, parts, milestones=milestones)


_PIXELS, _CLASSES = 28 * 28, 10  # both data sets' images and classes
_HISTORY_ENTRIES = 100_000  # --memory-history keeps the newest actions (a fit makes a few dozen)


def _train(a: argparse.Namespace) -> int:
    rank, ranks = 0, 1
    _momentum_is_sgds(a)
    if a.save and a.memory_history and os.path.realpath(a.save) == os.path.realpath(a.memory_history):
        raise ValueError(f"--save and --memory-history name the same file ({a.save}): the snapshot would "
                         "replace the model")
    if a.zero and not a.distributed:
        raise ValueError("--zero shards the optimizer's state over the ranks of a --distributed run")
    decay = a.weight_decay if a.weight_decay is not None else 1e-2 if a.optimizer == "adamw" else 0.0
    if a.no_bias_decay and not decay:
        raise ValueError(f"--no-bias-decay takes the biases out of a weight decay {a.optimizer} does not have here "
                         "(--weight-decay to give it one)")
    if a.distributed:  # on GPUs, NCCL sums the gradients, one GPU per rank of a machine
        on_gpu = a.device.startswith("cuda")
        distributed.init_process_group("nccl" if on_gpu else "mpi")
        rank, ranks = distributed.get_rank(), distributed.get_world_size()
        if a.device == "cuda":
            a.device = f"cuda:{distributed.get_local_rank()}"
    if a.memory_history is None:
        return _run(a, rank, ranks)
    path = a.memory_history
    if ranks > 1:
        root, ext = os.path.splitext(path)
        path = f"{root}.rank{rank}{ext}"
    memory._record_memory_history(max_entries=_HISTORY_ENTRIES, device=a.device)
    try:
        code = _run(a, rank, ranks)
    except BaseException:  # the run's own error is the one to report; the snapshot is a help
        try:
            _write_history(path, a.device)
        except BrokenPipeError:  # written; only the line that says so found no reader
            pass
        except Exception as e:
            print(f"warning: the memory history could not be written to {path}: {e}", file=sys.stderr)
        raise
    _write_history(path, a.device)
    return code


def _write_history(path: str, device: str) -> None:
    try:
        memory._dump_snapshot(path, device=device)
    finally:
        memory._record_memory_history(None, device=device)
    print(f"memory history written to {path} (open it at https://pytorch.org/memory_viz, or read it with "
          f"python -m cmlp snapshot {path})", flush=True)


def _run(a: argparse.Namespace, rank: int, ranks: int) -> int:

    def say(text: str) -> None:  # data-parallel, the first rank speaks for all
        if rank == 0:
            print(text, flush=True)

    # the options first (the layers against the data's shapes, the device, the memory limit), then the data
    if a.layers[0] != _PIXELS or a.layers[-1] < _CLASSES:
        raise ValueError(f"--layers {','.join(map(str, a.layers))}: {a.dataset} needs {_PIXELS} inputs (28x28 pixels) "
                         f"and at least {_CLASSES} outputs (one per class), e.g. {_PIXELS},512,256,{_CLASSES}")
    if a.memory_limit is not None:
        memory.set_memory_limit(a.memory_limit, a.device)
    model = MLP(a.layers, device=a.device, seed=a.seed)
    lr, wd = a.lr, a.weight_decay
    kind: Any
    if a.optimizer == "adam":
        kind, kw = optim.Adam, dict(lr=1e-3 if lr is None else lr, weight_decay=wd or 0.0, amsgrad=a.amsgrad)
    elif a.optimizer == "adamw":
        kind, kw = optim.AdamW, dict(lr=1e-3 if lr is None else lr, weight_decay=1e-2 if wd is None else wd,
                                     amsgrad=a.amsgrad)
    else:
        kind, kw = optim.SGD, dict(lr=0.01 if lr is None else lr, momentum=a.momentum, weight_decay=wd or 0.0)
    if a.no_bias_decay:
        names = list(model.state_dict())
        kw["param_groups"] = [{"params": [n for n in names if n.endswith(".weight")]},
                              {"params": [n for n in names if n.endswith(".bias")], "weight_decay": 0.0}]
    opt: optim.Optimizer = distributed.optim.ZeroRedundancyOptimizer(model, kind, **kw) if a.zero else kind(model, **kw)
    trainer = Trainer(model, opt, batch_size=a.batch_size, accumulation_steps=a.accumulation_steps, amp=a.amp,
                      seed=a.seed, distributed=a.distributed, max_grad_norm=a.max_grad_norm, recompute=a.recompute)
    if a.dataset == "fashion-mnist":
        (xtr, ytr), (xte, yte) = datasets.fashion_mnist(root=a.data_dir)
    else:
        (xtr, ytr), (xte, yte) = datasets.mnist(root=a.data_dir or "data")
    steps = a.epochs * -(-len(xtr) // (a.batch_size * a.accumulation_steps * ranks))
    sched = _schedule(opt, a.lr_schedule, a.warmup_steps, steps)
    group = f" x {_count_of(ranks, 'rank')} ({distributed.library_version()})" if a.distributed else ""
    if a.zero:
        group += ", optimizer state sharded over the ranks"
    clip = ", activations recomputed" if a.recompute else ""
    clip += f", gradient norm clipped to {a.max_grad_norm:g}" if a.max_grad_norm else ""
    if a.no_bias_decay:
        clip += f", weight decay {kw['weight_decay']:g} on the weights only"
    if sched is not None:
        clip += f", {a.lr_schedule} schedule" + (f" after {a.warmup_steps} warm-up steps" if a.warmup_steps else "")
    say(f"cmlp {build_info()['version']}: MLP {'-'.join(map(str, a.layers))} ({model.num_parameters():,} "
        f"parameters) on {model.device}, {a.optimizer}{' (AMSGrad)' if a.amsgrad else ''} lr {kw['lr']:g}, "
        f"batch {a.batch_size} x {a.accumulation_steps}{group}, {_count_of(a.epochs, 'epoch')}, "
        f"{a.amp or 'fp32'}{clip}, {a.dataset} {len(xtr):,} train / {len(xte):,} test")
    history = []
    for epoch in range(1, a.epochs + 1):
        trainer._bar_epochs = (epoch, a.epochs)  # each fit's bar says which of the run's epochs it is
        h = trainer.fit(xtr, ytr, epochs=1, validation_data=(xte, yte), progress=not a.no_progress, scheduler=sched,
                        scheduler_interval="step")[0]
        h["epoch"] = epoch
        history.append(h)
        say(f"epoch {epoch}/{a.epochs}  loss {h['loss']:.4f}  test loss {h['val_loss']:.4f}  "
            f"test accuracy {100 * h['val_accuracy']:.2f}%  {h['samples_per_second']:,.0f} samples/s  "
            f"peak memory {memory._fmt(h['peak_memory_bytes'])}  {h['seconds']:.1f} s"
            + (f"  lr {h['lr']:.3g} at its first step" if sched is not None else "")
            + (f"  skipped steps {h['skipped_steps']}" if h["skipped_steps"] else "")
            + (f"  mean gradient norm {h['grad_norm']:.4g}" if h["grad_norm"] is not None else ""))
    say(f"final test accuracy: {100 * history[-1]['val_accuracy']:.2f}%")
    if a.save is not None and rank == 0:  # the ranks hold the same parameters
        model.save(a.save)
        say(f"saved to {a.save}")
    return 0


def _count_of(n: int, thing: str) -> str:
    return f"{n} {thing}" + ("" if n == 1 else "s")


def _momentum_is_sgds(a: argparse.Namespace) -> None:
    if a.momentum and a.optimizer != "sgd":
        raise ValueError(f"--momentum is SGD's; {a.optimizer} has betas (--optimizer sgd to use it)")
    if a.amsgrad and a.optimizer == "sgd":
        raise ValueError("--amsgrad is Adam's and AdamW's (--optimizer adam or adamw to use it)")


def _plan(a: argparse.Namespace) -> int:
    _momentum_is_sgds(a)
    if a.epochs is not None and not a.validation_rows:
        raise ValueError("--epochs counts the validations after the epochs, which only a plan with --validation-rows "
                         "has (the steps' memory is the same in each epoch)")
    a.epochs = 5 if a.epochs is None else a.epochs
    if a.data_dtype is not None and not a.data_rows:
        raise ValueError("--data-dtype is the type of --data-rows' samples: give their number too")
    a.data_dtype = a.data_dtype or "uint8"
    optimizer = "sgd_momentum" if a.optimizer == "sgd" and a.momentum else a.optimizer
    optimizer += "_amsgrad" if a.amsgrad else ""
    if a.gpu_memory is not None and a.gpu_capability is None:
        raise ValueError("--gpu-memory describes a GPU with --gpu-capability (plan on the GPU that is here without "
                         "either)")
    a.gpu = None
    if a.gpu_capability is not None:  # a GPU described, not opened
        if not a.device.startswith("cuda"):
            raise ValueError("--gpu-capability describes a GPU to plan for: use it with --device cuda")
        a.gpu = {"major": a.gpu_capability, "total_memory": a.gpu_memory or 0}
    # the budget counts all the device reserves, as a memory limit does: what it holds from the
    # moment it opens (on CUDA, the GEMM workspace) and the run on top, which the plan counts
    held = 0
    if a.budget is not None:
        held = memory.memory_reserved(a.device) if a.gpu is None else \
            memory.plan([1, 1], 1, device=a.device, device_properties=a.gpu).standing_reserved_bytes
    room = a.budget - held if a.budget is not None else 0
    p = memory.plan(a.layers, a.batch_size, optimizer, a.amp, a.recompute, device=a.device,
                    accumulation_steps=a.accumulation_steps, optimizer_shards=a.optimizer_shards,
                    validation_rows=a.validation_rows, epochs=a.epochs, data_rows=a.data_rows,
                    data_dtype=a.data_dtype, device_properties=a.gpu, _budget=max(0, min(room, 1 << 62)))
    text = str(p)
    if a.accumulation_steps > 1:  # the plan is of a micro-batch: say how many make a step
        text = text.replace(f", batch {a.batch_size},", f", batch {a.batch_size} x {a.accumulation_steps},", 1)
    print(text)
    if a.budget is not None:
        n = memory.max_batch_size(a.layers, room, optimizer, a.amp, a.recompute, device=a.device,
                                  accumulation_steps=a.accumulation_steps, optimizer_shards=a.optimizer_shards,
                                  validation_rows=a.validation_rows, data_rows=a.data_rows,
                                  data_dtype=a.data_dtype, device_properties=a.gpu) if room > 0 else 0
        why = f" (as a micro-batch, {a.accumulation_steps} to a step)" if a.accumulation_steps > 1 else ""
        why += f" ({p.device} holds {memory._fmt(held)} of it once open)" if held else ""
        if n == 0:
            one = _reserved(a, optimizer, a.amp, a.recompute, 1, a.accumulation_steps, room)
            why += f" (one sample needs {memory._fmt(one)} reserved on top)"
        if n >= 1 << 24:  # max_batch_size's search ends there
            why += " (or more: the search stops at 2**24)"
        mine = _reserved(a, optimizer, a.amp, a.recompute, a.batch_size, a.accumulation_steps, room)
        if 0 < a.batch_size < n and mine > room:
            # reserved memory is in whole segments: a smaller batch can need one more
            why += f" (not every smaller one: batch {a.batch_size} reserves {memory._fmt(mine)}, in its segments)"
        print(f"largest batch that fits in {memory._fmt(a.budget)}: {n}{why}")
        if room > 0:
            _options(a, optimizer, room)
        if mine > room:  # the status a script tests before it trains
            print(f"the run as planned (batch {p.batch_size}) does not fit in {memory._fmt(a.budget)}: it reserves "
                  f"{memory._fmt(mine + held)}")
            return 1
    return 0


def _options(a: argparse.Namespace, optimizer: str, room: int) -> None:
    """What each way of saving memory lets a step (--batch-size x --accumulation-steps samples)
    do in the budget: the largest micro-batch, and how many of them the step takes (what the
    trainer's automatic micro-batching starts from under that memory limit)."""
    rows = [(amp, recompute, *_split(a, optimizer, amp, recompute, room))
            for recompute in (False, True) for amp in (None, "fp16", "bf16")]
    if not any(k for *_, k in rows):
        return
    print(f"ways to train steps of {a.batch_size * a.accumulation_steps} samples in it (micro-batches accumulate to "
          "the same update):")
    print(f"  {'precision':<10}{'recompute':<11}{'micro-batch':>12}{'micro-batches a step':>22}")
    for amp, recompute, micro, k in rows:
        mark = "  <- as planned above" if amp == a.amp and recompute == a.recompute else ""
        print(f"  {amp or 'fp32':<10}{'yes' if recompute else 'no':<11}{micro or 'none fits':>12}{k or '-':>22}{mark}")
    if not all(k for *_, k in rows) and not memory.get_config()["expandable_segments"]:
        large = memory.get_config()["large_segment_size_mb"]
        print(f"reserved memory comes in whole segments ({large} MiB for requests from 1 to 10 MiB, 2 MiB for "
              "smaller ones); expandable_segments:True in CMLP_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF maps 2 MiB pages "
              "instead")


def _split(a: argparse.Namespace, optimizer: str, amp: Optional[str], recompute: bool, room: int) -> Tuple[int, int]:
    """The fewest equal micro-batches, each of at most --batch-size (the trainer never runs
    larger ones), that a step of --batch-size x --accumulation-steps samples can be cut into
    within room: their size and count. A step of several micro-batches needs more memory than
    one of the same size alone, so the largest micro-batch is asked for k at a time. Reserved
    memory comes in whole segments and does not grow steadily with the batch (a smaller one can
    take a segment more), so each answer is planned itself. (0, 0) when none fits."""
    step = a.batch_size * a.accumulation_steps

    def largest(k: int) -> int:
        return memory.max_batch_size(a.layers, room, optimizer, amp, recompute, device=a.device,
                                     accumulation_steps=k, optimizer_shards=a.optimizer_shards,
                                     validation_rows=a.validation_rows, data_rows=a.data_rows,
                                     data_dtype=a.data_dtype, device_properties=a.gpu)

    def fits(micro: int) -> bool:  # in as many micro-batches as that size makes of the step
        return _reserved(a, optimizer, amp, recompute, micro, -(-step // micro), room) <= room

    k = a.accumulation_steps
    if fits(a.batch_size):
        return a.batch_size, k
    k += 1
    while k <= step:  # the largest micro-batch shrinks with k only a little, if at all
        n = largest(k)
        if n == 0:
            return 0, 0
        k = max(k, -(-step // n))
        micro = -(-step // k)
        if fits(micro):
            return micro, -(-step // micro)
        k += 1
    return 0, 0


def _reserved(a: argparse.Namespace, optimizer: str, amp: Optional[str], recompute: bool, micro: int, k: int,
              room: int) -> int:
    """What a run in micro-batches of `micro`, k to a step, reserves in one epoch under a memory
    limit of room (a memory limit's view, as max_batch_size's). A fit on a GPU keeps its data set
    on the device or, where that leaves the step no room, stages it: the less of the two."""
    def reserved(rows: int) -> int:
        b, n = (a.data_rows, 1) if 0 < a.data_rows <= micro else (micro, k)  # a step of the whole data set
        return memory.plan(a.layers, b, optimizer, amp, recompute, device=a.device, accumulation_steps=n,
                           optimizer_shards=a.optimizer_shards, validation_rows=a.validation_rows, epochs=1,
                           data_rows=rows, data_dtype=a.data_dtype, device_properties=a.gpu,
                           _budget=max(0, min(room, 1 << 62))).reserved_bytes

    kept = reserved(a.data_rows)
    return min(kept, reserved(0)) if a.data_rows and kept > room else kept


def _info() -> int:
    info = build_info()
    info["cuda_available"] = cuda.is_available()
    info["cuda_device_count"] = cuda.device_count()
    if info["cuda_available"]:
        info["cuda_devices"] = [cuda.get_device_properties(i)._asdict() for i in range(info["cuda_device_count"])]
    info["mpi_available"] = distributed.is_mpi_available()
    print(json.dumps(info, indent=2))
    return 0


def _warning_line(message: Any, category: type, filename: str, lineno: int, file: Any = None,
                  line: Optional[str] = None) -> None:
    """A warning as the command line's other messages are: one line, without the source."""
    print(f"warning: {message}", file=sys.stderr if file is None else file, flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    try:
        a = _parser().parse_args(argv)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
        return _flushed()  # --help: what it printed reaches its reader, or the status says why not
    except BrokenPipeError:
        return _reader_gone()
    except OSError as e:  # --help's output failed (a full disk, say)
        print(f"error: {e}", file=sys.stderr)
        return 2
    shown, warnings.showwarning = warnings.showwarning, _warning_line
    try:
        return _command(a)
    finally:
        warnings.showwarning = shown


def _reader_gone() -> int:
    """The reader went away (| head): stop, as a program killed by SIGPIPE would, and let nothing
    write to the pipe again, not even the interpreter's last flush."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
    return 141


def _flushed() -> int:
    """0 once what was printed is written; else the status of a command whose output failed."""
    try:
        if sys.stdout is not None:  # (none: stdout closed with >&-)
            sys.stdout.flush()
    except BrokenPipeError:
        return _reader_gone()
    except OSError as e:  # a full disk, say
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _command(a: argparse.Namespace) -> int:
    try:
        if a.command == "train":
            return _train(a)
        if a.command == "snapshot":
            print(memory.snapshot_report(a.path, device=a.device, top=a.top), end="")
            return 0
        return _plan(a) if a.command == "plan" else _info()
    except BrokenPipeError:
        _end_the_group(141)
        return _reader_gone()
    except (ValueError, TypeError, OSError, RuntimeError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        _end_the_group(2)
        return 2
    except MemoryError as e:  # (host memory: a file's or an array's too large for this process)
        print(f"error: out of host memory{f' ({e})' if str(e) else ''}", file=sys.stderr)
        _end_the_group(2)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: a line, and the status of a program SIGINT ended (--save wrote nothing)
        print("interrupted", file=sys.stderr)
        _end_the_group(130)
        return 130


def _end_the_group(code: int) -> None:
    """A rank of a group of several that fails alone ends the whole job (MPI_Abort): the other
    ranks would wait for it in their next collective forever."""
    state = _cmlp.dist_state()
    if state[0] and state[2] > 1 and not state[6]:  # not a child forked from a rank
        sys.stderr.write(f"cmlp: rank {state[1]} ends the job of {state[2]} ranks, which would wait for it\n")
        sys.stderr.flush()
        _cmlp.dist_abort(code)


if __name__ == "__main__":
    sys.exit(main())
