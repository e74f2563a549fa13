"""The command line, run as users run it: `python -m cmlp info` and `python -m cmlp train`, in a
fresh interpreter that imports cmlp from where this process did, in a temporary
working directory.
"""

import functools
import json
import math
import os
import pickle
import re
import signal
import subprocess
import sys

import pytest

import cmlp

# where this process imported cmlp from (an in-place build or site-packages): subprocesses use the same
REPO_PYTHON = os.path.dirname(os.path.dirname(os.path.abspath(cmlp.__file__)))


def run_cli(args, cwd, timeout=120):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_PYTHON + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.run([sys.executable, "-m", "cmlp", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout)


@functools.lru_cache(maxsize=None)
def have_fashion():
    try:
        cmlp.datasets.fashion_mnist()
    except FileNotFoundError:
        return False
    return True


needs_fashion = pytest.mark.skipif(not have_fashion(), reason="Fashion-MNIST is not installed")


def test_info(tmp_path):
    r = run_cli(["info"], tmp_path)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["version"] == cmlp.__version__
    assert isinstance(info["blas"], str) and info["blas"]
    assert "cuda" in info
    assert info["cuda_available"] == cmlp.cuda.is_available()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    if not have_fashion():
        pytest.skip("Fashion-MNIST is not installed")
    cwd = tmp_path_factory.mktemp("cli")
    r = run_cli(["train", "--epochs", "1", "--layers", "784,32,10", "--batch-size", "128", "--no-progress",
                 "--save", "small.npz"], cwd)
    return r, cwd


@needs_fashion
def test_train_reports_each_epoch(trained):
    r, _ = trained
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    out = r.stdout
    assert "epoch 1/1" in out
    assert "test accuracy" in out
    assert "samples/s" in out
    assert "peak memory" in out
    assert "784-32-10" in out
    assert r.stderr == "", "--no-progress must not draw a bar"
    acc = float(re.search(r"epoch 1/1 .*test accuracy ([\d.]+)%", out).group(1))
    assert 70.0 < acc <= 100.0


@needs_fashion
def test_train_progress_bars_count_the_runs_epochs(tmp_path):
    # the command fits one epoch at a time: each bar still says which of the run's epochs it is
    pytest.importorskip("tqdm")
    r = run_cli(["train", "--epochs", "2", "--layers", "784,16,10", "--batch-size", "1024", "--recompute"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "epoch 1/2" in r.stderr and "epoch 2/2" in r.stderr and "epoch 1/1" not in r.stderr, r.stderr
    # stderr is a pipe here, as a log is: whole lines, no carriage returns
    assert "\r" not in r.stderr and r.stderr.count("\n") == 2, r.stderr
    # --recompute reaches the trainer, which recomputes in the backward pass
    assert ", 2 epochs, fp32, activations recomputed, fashion-mnist" in r.stdout, r.stdout


@needs_fashion
def test_train_save_writes_a_loadable_model(trained):
    r, cwd = trained
    assert r.returncode == 0, r.stderr
    path = cwd / "small.npz"
    assert path.is_file()
    model = cmlp.MLP.load(path)
    assert model.layer_sizes == (784, 32, 10)
    _, (xte, yte) = cmlp.datasets.fashion_mnist()
    printed = float(re.search(r"final test accuracy: ([\d.]+)%", r.stdout).group(1))
    assert 100 * model.evaluate(xte, yte)["accuracy"] == pytest.approx(printed, abs=0.006)
    assert [p for p in os.listdir(cwd) if p != "small.npz"] == []


@pytest.mark.parametrize("args,pattern", [
    (["train", "--layers", "784,x"], r"--layers"),
    (["train", "--layers", "784,0,10", "--epochs", "1"], r"--layers: expected sizes in \[1, 2\*\*24\], got 0"),
    (["train", "--layers", "784"], r"--layers: expected an input and an output size at least"),
    (["plan", "--layers", "784,16777217,10"], r"--layers: expected sizes in \[1, 2\*\*24\], got 16777217"),
    (["train", "--seed", "-1"], r"--seed: expected an int in \[0, 2\*\*64\), got '-1'"),
    (["train", "--memory-limit", "0"], r"--memory-limit: expected a size > 0 such as 256MB, got '0'"),
    (["plan", "--budget", "0B"], r"--budget: expected a size > 0"),
    (["plan", "--device", "cuda:x"], r"--device: expected cpu, cuda or cuda:N, got 'cuda:x'"),
    (["train", "--batch-size", "0", "--layers", "784,10"], r"--batch-size: expected an int >= 1, got '0'"),
    # checked before the data set is read or anything trains
    (["train", "--epochs", "0"], r"--epochs: expected an int in \[1, 2\*\*31 - 1\], got '0'"),
    (["train", "--epochs", "-3"], r"--epochs: expected an int in \[1, 2\*\*31 - 1\]"),
    (["train", "--epochs", "2147483648"], r"--epochs: expected an int in \[1, 2\*\*31 - 1\], got .2147483648."),
    (["plan", "--validation-rows", "10", "--epochs", "2147483648"], r"--epochs: expected an int in \[1, 2\*\*31 - 1\]"),
    (["train", "--accumulation-steps", "x"], r"--accumulation-steps: expected an int >= 1"),
    (["train", "--lr", "nan"], r"--lr: expected a finite number >= 0"),
    (["train", "--lr", "1e300"], r"--lr: expected a finite number >= 0 \(in float32's range\), got '1e300'"),
    (["train", "--save", ""], r"--save needs a file name"),
    (["train", "--save", "."], r"--save '\.' is a directory"),
    (["train", "--save", "nowhere/x.npz"], r"the directory .*nowhere' does not exist"),
    (["train", "--memory-history", "."], r"--memory-history '\.' is a directory"),
    (["train", "--memory-history", "nowhere/h.pickle"], r"the directory .*nowhere' does not exist"),
    (["train", "--save", "a.npz/"], r"names a directory"),
    # a directory where nothing can be made, even by root (whom os.access lets write anywhere)
    (["train", "--save", "/proc/x.npz"], r"--save '/proc/x.npz': cannot write in the directory '/proc'"),
    (["train", "--memory-history", "x" * 300 + ".pickle"], r"too long"),
    (["train", "--memory-limit", "0.5B"], r"a number of bytes is a whole number"),
    (["train", "--memory-limit", "1iB"], r"cannot read '1iB' as a size"),
    (["plan", "--optimizer", "sgd", "--momentum", "nan"], r"--momentum: expected a finite number >= 0"),
    (["plan", "--optimizer-shards", "0"], r"--optimizer-shards: expected an int >= 1"),
    (["plan", "--momentum", "0.9"], r"--momentum is SGD's; adam has betas"),
    (["train", "--optimizer", "adamw", "--momentum", "0.9"], r"--momentum is SGD's; adamw has betas"),
    (["train", "--optimizer", "sgd", "--amsgrad"], r"--amsgrad is Adam's and AdamW's"),
    (["train", "--no-bias-decay"], r"--no-bias-decay takes the biases out of a weight decay adam does not have"),
    (["train", "--optimizer", "adamw", "--weight-decay", "0", "--no-bias-decay"], r"adamw does not have here"),
    (["plan", "--epochs", "3"], r"--epochs counts the validations .* --validation-rows"),
    (["plan", "--data-dtype", "float32"], r"--data-dtype is the type of --data-rows' samples: give their number"),
    (["plan", "--data-rows", "-1"], r"--data-rows: expected an int in \[0, 2\*\*56\), got '-1'"),
    (["plan", "--validation-rows", str(2**56)], r"--validation-rows: expected an int in \[0, 2\*\*56\)"),
    (["train", "--zero"], r"--zero shards the optimizer's state over the ranks of a --distributed run"),
    (["train", "--save", "a.pickle", "--memory-history", "./a.pickle"], r"--save and --memory-history name the same"),
    (["train", "--memory-limit", "lots"], r"lots"),
    (["train", "--max-grad-norm", "0"], r"--max-grad-norm: expected a number > 0"),
    (["train", "--weight-decay", "-1"], r"--weight-decay: expected a finite number >= 0"),
    (["train", "--warmup-steps", "-5"], r"--warmup-steps: expected an int >= 0"),
    (["train", "--lr-schedule", "linear"], r"linear"),
    (["train", "--optimizer", "rmsprop"], r"rmsprop"),
    (["train", "--device", "gpu", "--layers", "784,10"], r"--device: expected cpu, cuda or cuda:N, got 'gpu'"),
    (["snapshot", "missing.pickle"], r"No such file"),
    (["snapshot", "x.pickle", "--top", "-1"], r"--top: expected an int >= 0"),
    (["frobnicate"], r"frobnicate"),
    (["plan", "--gpu-capability", "9.0"], r"--gpu-capability describes a GPU to plan for: use it with --device cuda"),
    (["plan", "--device", "cuda", "--gpu-memory", "8GB"], r"--gpu-memory describes a GPU with --gpu-capability"),
    (["plan", "--device", "cuda", "--gpu-capability", "nine"], r"expected a compute capability such as 8\.0"),
    (["plan", "--device", "cuda", "--gpu-capability", "0.5"], r"expected a compute capability such as 8\.0"),
    ([], r"command|usage"),
])
def test_bad_arguments_exit_nonzero_with_a_message(tmp_path, args, pattern):
    r = run_cli(args, tmp_path)
    assert r.returncode != 0
    assert re.search(pattern, r.stderr), r.stderr
    assert "Traceback" not in r.stderr


def test_save_through_a_link_checks_the_links_target_before_training(tmp_path):
    os.symlink(tmp_path / "gone" / "model.npz", tmp_path / "dangling.npz")  # into a directory that is not there
    r = run_cli(["train", "--save", "dangling.npz"], tmp_path)
    assert r.returncode == 2 and re.search(r"--save 'dangling.npz': the directory .*gone' does not exist", r.stderr), \
        r.stderr


@pytest.mark.parametrize("args,pattern", [
    (["--layers", "100,10"], r"--layers 100,10: mnist needs 784 inputs \(28x28 pixels\) and at least 10 outputs"),
    (["--layers", "784,32,5"], r"--layers 784,32,5: mnist needs 784 inputs"),
    (["--memory-limit", "1KB"], r"out of memory"),
] + ([] if cmlp.cuda.is_available() else [(["--device", "cuda"], r"CUDA")]))
def test_options_that_cannot_train_fail_before_the_data_set_is_read(tmp_path, args, pattern):
    # (no data set where it looks: a check made after reading would report the missing files)
    r = run_cli(["train", "--dataset", "mnist", "--data-dir", str(tmp_path), *args], tmp_path)
    assert r.returncode == 2 and re.search(pattern, r.stderr) and "not found" not in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@needs_fashion
def test_a_warning_is_one_line_as_the_other_messages(tmp_path):
    r = run_cli(["train", "--epochs", "1", "--layers", "784,256,10", "--batch-size", "20000", "--no-progress",
                 "--memory-limit", "60MB"], tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: under the memory limit of 60.00 MiB the planner fits "
                                                   "micro-batches of"), r.stderr


@needs_fashion
def test_train_with_adamw_clips_gradients_and_reports_their_norm(tmp_path):
    r = run_cli(["train", "--epochs", "1", "--layers", "784,32,10", "--batch-size", "256", "--no-progress",
                 "--optimizer", "adamw", "--weight-decay", "0.05", "--max-grad-norm", "0.5", "--no-bias-decay",
                 "--amsgrad"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "gradient norm clipped to 0.5" in r.stdout and "adamw (AMSGrad) lr 0.001" in r.stdout
    assert "weight decay 0.05 on the weights only" in r.stdout
    norm = float(re.search(r"mean gradient norm ([0-9.e+-]+)", r.stdout).group(1))
    assert norm > 0


@needs_fashion
def test_train_warms_up_then_decays_the_rate_per_step(tmp_path):
    """--warmup-steps and --lr-schedule cosine: the rate of each epoch's first step, from lr / N
    in the first epoch to its cosine value in the second (60,000 / 1,000 = 60 steps an epoch)."""
    r = run_cli(["train", "--epochs", "2", "--layers", "784,32,10", "--batch-size", "1000", "--no-progress",
                 "--lr", "0.01", "--warmup-steps", "20", "--lr-schedule", "cosine"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "cosine schedule after 20 warm-up steps" in r.stdout
    assert "adam lr 0.01," in r.stdout  # the rate asked for, not the warm-up's first
    lrs = [float(v) for v in re.findall(r"lr ([0-9.e+-]+) at its first step", r.stdout)]
    assert lrs == pytest.approx([0.01 / 20, 0.01 * (1 + math.cos(math.pi * 40 / 100)) / 2], rel=1e-2)


@needs_fashion
@pytest.mark.parametrize("limit", [None, "1MB"])
def test_train_writes_its_memory_history(tmp_path, limit):
    """--memory-history: the snapshot and history in PyTorch's format, written when training ends
    and when it fails (here out of memory under a limit, with the failed request in it)."""
    args = ["train", "--epochs", "1", "--layers", "784,32,10", "--batch-size", "1000", "--no-progress",
            "--memory-history", "h.pickle"]
    r = run_cli(args + (["--memory-limit", limit] if limit else []), tmp_path)
    assert (r.returncode == 0) == (limit is None), r.stderr
    assert "memory history written to h.pickle" in r.stdout
    with open(tmp_path / "h.pickle", "rb") as f:
        data = pickle.load(f)
    trace = data["device_traces"][0]
    held = {e["frames"][0]["name"] for e in trace if e["action"] in ("alloc", "oom")}
    if limit:
        assert "out of memory" in r.stderr and [e["action"] for e in trace].count("oom") == 1
        assert held == {"parameters"}
    else:
        assert {"parameters", "gradients", "activations", "optimizer state"} <= held
        assert data["segments"]
    r = run_cli(["snapshot", "h.pickle", "--top", "2"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "peak allocated (requested bytes) over the history" in r.stdout
    assert ("out of memory: 1 request failed" in r.stdout) == (limit is not None)
    if limit is None:
        assert re.search(r"\d+\.\d\d [KM]iB  parameters  \(1 block\)", r.stdout), r.stdout
    else:
        assert re.search(r"\d+\.\d\d [KM]iB for parameters; \d+\.\d\d [KMG]iB was free on the device", r.stdout), \
            r.stdout


def test_train_without_data_says_where_it_looked(tmp_path):
    r = run_cli(["train", "--dataset", "mnist", "--data-dir", str(tmp_path / "none"), "--epochs", "1"], tmp_path)
    assert r.returncode != 0
    assert "not found" in r.stderr and f"{tmp_path / 'none'} (no such directory)" in r.stderr
    assert "Traceback" not in r.stderr
    (tmp_path / "file").write_bytes(b"")
    r = run_cli(["train", "--dataset", "mnist", "--data-dir", str(tmp_path / "file"), "--epochs", "1"], tmp_path)
    assert r.returncode != 0 and f"{tmp_path / 'file'} (not a directory)" in r.stderr, r.stderr


def test_output_to_a_reader_that_goes_away_ends_quietly(tmp_path):
    """`python -m cmlp plan ... | head -1`: the pipe's reader leaves; the command stops without a
    message or a traceback, with the status of a program SIGPIPE ended (128 + 13)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_PYTHON + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    p = subprocess.Popen([sys.executable, "-m", "cmlp", "plan", "--batch-size", "8000", "--budget", "40MB"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path, env=env)
    p.stdout.close()  # before the interpreter has started: its first write finds no reader
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141 and err == "", err
    if not have_fashion():
        return
    # training: the memory history is still written, and nothing says it was not
    p = subprocess.Popen([sys.executable, "-m", "cmlp", "train", "--layers", "784,16,10", "--epochs", "1",
                          "--batch-size", "1024", "--no-progress", "--memory-history", "h.pickle"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path, env=env)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and err == "", err
    assert pickle.loads((tmp_path / "h.pickle").read_bytes())["device_traces"]


def test_help_whose_output_fails_says_so(tmp_path):
    """--help to a reader that went away: 141, as other output; to a full disk: a line and 2 (argparse's own
    parser drops the error and ends with 0, having written nothing)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_PYTHON + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for args in (["--help"], ["train", "--help"]):
        p = subprocess.Popen([sys.executable, "-m", "cmlp", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             cwd=tmp_path, env=env)
        p.stdout.close()
        err = p.stderr.read().decode()
        assert p.wait(timeout=60) == 141 and err == "", (args, err)
        if os.path.exists("/dev/full"):
            with open("/dev/full", "w") as full:
                r = subprocess.run([sys.executable, "-m", "cmlp", *args], stdout=full, stderr=subprocess.PIPE,
                                   text=True, cwd=tmp_path, env=env, timeout=60)
            assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    r = run_cli(["train", "--help"], tmp_path)
    assert r.returncode == 0 and "--memory-limit" in r.stdout and r.stderr == ""
    # no stdout at all (>&-): nothing to print to, and nothing to say, as argparse's
    r = subprocess.run([sys.executable, "-m", "cmlp", "--help"], stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                       env=env, timeout=60, preexec_fn=lambda: os.close(1))
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_a_bad_allocator_setting_in_the_environment_is_a_line_and_status_2(tmp_path, monkeypatch):
    """Read as cmlp is imported, before the command line runs: still its one-line error."""
    monkeypatch.setenv("CMLP_ALLOC_CONF", "foo:1")
    r = run_cli(["plan"], tmp_path)
    assert r.returncode == 2 and r.stderr == "error: CMLP_ALLOC_CONF='foo:1': Unrecognized CachingAllocator " \
        "option: foo\n", r.stderr
    # imported by a program: the ValueError API.md names
    r = subprocess.run([sys.executable, "-c", "import cmlp"], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": REPO_PYTHON}, timeout=60)
    assert r.returncode == 1 and "ValueError: CMLP_ALLOC_CONF='foo:1'" in r.stderr


@needs_fashion
def test_ctrl_c_ends_training_with_a_line_and_saves_no_model(tmp_path):
    """SIGINT during training: "interrupted" and the status of a program SIGINT ended (128 + 2), no
    traceback; --save writes nothing, and the memory history is still written."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_PYTHON + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    p = subprocess.Popen([sys.executable, "-m", "cmlp", "train", "--layers", "784,64,10", "--epochs", "50",
                          "--batch-size", "32", "--no-progress", "--save", "m.npz", "--memory-history", "h.pickle"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path, env=env, text=True,
                         # (as a terminal's: a job run in the background of a script inherits SIGINT ignored)
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    p.stdout.readline()  # the banner: the data set is read and training starts
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, (out, err)
    assert "interrupted" in err and "Traceback" not in err, err
    assert not (tmp_path / "m.npz").exists() and [f for f in os.listdir(tmp_path) if f != "h.pickle"] == []
    assert pickle.loads((tmp_path / "h.pickle").read_bytes())["device_traces"]


def test_help(tmp_path):
    r = run_cli(["train", "--help"], tmp_path)
    assert r.returncode == 0
    for flag in ("--epochs", "--batch-size", "--accumulation-steps", "--amp", "--device", "--optimizer", "--lr",
                 "--layers", "--memory-limit", "--max-grad-norm", "--seed", "--save", "--memory-history"):
        assert flag in r.stdout, flag
    text = " ".join(r.stdout.split())  # the help wraps its lines
    for said in ("passes over the training set (default: 5)", "(default: 32)", "(default: 784,512,256,10)",
                 "(default: fp32)", "cpu, cuda or cuda:N (default: cpu)", "the shuffle's seed (default: 0)",
                 "default: 1e-3 for adam and adamw, 0.01 for sgd"):
        assert said in text, said
    assert "(default: None)" not in text and "(default: False)" not in text
    r = run_cli(["plan", "--help"], tmp_path)
    assert r.returncode == 0 and "--accumulation-steps" in r.stdout and "--recompute" in r.stdout


def test_a_failed_run_reports_its_own_error_when_the_history_cannot_be_written(tmp_path, monkeypatch, capsys):
    """--memory-history on a run that fails: the run's error is the one reported; a snapshot that
    cannot be written only warns, and recording stops either way."""
    import cmlp.__main__ as cli

    def run(a, rank, ranks):
        raise cmlp.OutOfMemoryError("cpu out of memory (the run's own)")

    def dump(path, device=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli, "_run", run)
    monkeypatch.setattr(cmlp.memory, "_dump_snapshot", dump)
    code = cli.main(["train", "--memory-history", str(tmp_path / "h.pickle")])
    err = capsys.readouterr().err
    assert code == 2
    assert "error: cpu out of memory (the run's own)" in err
    assert "warning: the memory history could not be written" in err and "No space left" in err
    assert cmlp.memory._snapshot("cpu")["device_traces"] == [[]], "recording stopped"


def test_plan_with_the_optimizer_state_sharded(tmp_path):
    # 535,818 parameters over 2 ranks: rank 0 keeps Adam's state of 267,968 (in parts of 64)
    r = run_cli(["plan", "--optimizer-shards", "2"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "adam (state sharded over 2 ranks)" in r.stdout
    assert re.search(r"optimizer state\s+2\.04 MiB", r.stdout), r.stdout
    whole = run_cli(["plan"], tmp_path).stdout
    assert re.search(r"optimizer state\s+4\.09 MiB", whole), whole


def test_plan_for_a_gpu_that_is_not_here(tmp_path):
    """plan --gpu-capability describes the GPU (as plan's device_properties): its budget counts the
    workspace such a GPU holds once open, 34 MiB on compute capability 9.0 and 10 MiB on 8.0."""
    r = run_cli(["plan", "--batch-size", "4096", "--amp", "fp16", "--device", "cuda", "--gpu-capability", "9.0",
                 "--gpu-memory", "80GB", "--budget", "2GB"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "MLP 784-512-256-10, batch 4096, adam, fp16, cuda:0 (described: compute capability 9.x, 80.00 GiB)" \
        in r.stdout
    assert "(cuda:0 holds 34.00 MiB of it once open)" in r.stdout, r.stdout
    r = run_cli(["plan", "--device", "cuda", "--gpu-capability", "8.0", "--budget", "40MB"], tmp_path)
    assert r.returncode == 0 and "(cuda:0 holds 10.00 MiB of it once open)" in r.stdout, r.stdout + r.stderr


def test_plan_with_the_fits_data_set(tmp_path):
    """plan --data-rows counts the data set a fit keeps on a GPU (uint8 images as uint8, float32
    ones as float32; the CPU reads it in place); under --budget a fit whose data set leaves its
    step no room stages it, so the largest batch is max_batch_size's with data_rows, and the
    ways to train a step are those of the staged run. A data set smaller than the batch is one
    micro-batch of it all."""
    gpu = ["--device", "cuda", "--gpu-capability", "9.0"]
    r = run_cli(["plan", "--batch-size", "8192", "--data-rows", "60000", *gpu], tmp_path)
    assert r.returncode == 0 and re.search(r"data\s+45\.55 MiB", r.stdout), r.stdout + r.stderr
    r = run_cli(["plan", "--batch-size", "8192", "--data-rows", "60000", "--data-dtype", "float32", *gpu], tmp_path)
    assert r.returncode == 0 and re.search(r"data\s+180\.13 MiB", r.stdout), r.stdout + r.stderr
    r = run_cli(["plan", "--data-rows", "60000"], tmp_path)
    assert r.returncode == 0 and re.search(r"data\s+0\.00 B", r.stdout), r.stdout + r.stderr

    kept = run_cli(["plan", "--batch-size", "8192", "--data-rows", "60000", *gpu, "--budget", "60MB"], tmp_path)
    staged = run_cli(["plan", "--batch-size", "8192", *gpu, "--budget", "60MB"], tmp_path)
    assert kept.returncode == staged.returncode == 1
    n = cmlp.memory.max_batch_size([784, 512, 256, 10], 26 << 20, device="cuda", data_rows=60000,
                                   device_properties={"major": 9})
    assert n > 0 and f"largest batch that fits in 60.00 MiB: {n} " in kept.stdout, kept.stdout
    table = kept.stdout[kept.stdout.index("largest batch"):]
    assert table == staged.stdout[staged.stdout.index("largest batch"):]

    r = run_cli(["plan", "--batch-size", "1000", "--data-rows", "100", *gpu, "--budget", "60MB"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "batch 100, adam, fp32, cuda:0" in r.stdout and re.search(r"data\s+77\.73 KiB", r.stdout), r.stdout
    assert "largest batch that fits in 60.00 MiB: 100 " in r.stdout, r.stdout
