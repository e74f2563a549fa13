"""Data parallelism: jobs of 2 and 3 ranks started with mpirun (tests/dist_worker.py is one
rank), each checked against one process training on the same samples: over MPI on the CPU, and
over NCCL on the CUDA backend where it runs on the emulated CUDA runtime, whose NCCL is MPI
underneath (tests/emu/cuda_runtime_emu.cpp: the all-reduce queued on the stream, captured in
the training step's graph and replayed with it). Tolerances: fp32
parameters within 1e-5 of the largest parameter after 2 epochs of Adam (the ranks' gradients are
summed in another order than one process sums them); fp16 within 2e-3 (each rank's micro-batches
round their half-precision activations differently); losses within 1e-6 relative (fp32)."""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import cmlp

D = cmlp.distributed
HERE = os.path.dirname(os.path.abspath(__file__))
REPO_PYTHON = os.path.dirname(os.path.dirname(os.path.abspath(cmlp.__file__)))
MPIRUN = shutil.which("mpirun")
SIZES = [784, 48, 10]  # tests/dist_worker.py's model

needs_mpi = pytest.mark.skipif(not (MPIRUN and D.is_available()),
                               reason="needs mpirun and cmlp's MPI module (apt-get install libopenmpi-dev openmpi-bin)")


ROOT = os.path.dirname(HERE)
EMULATOR = os.path.join(ROOT, "build", "emu", "_cmlp_cuda_emu.so")
CUDA_HEADERS = os.path.join(os.environ.get("CUDA_HOME") or "/usr/local/cuda", "include", "cuda_runtime.h")
EMULATED_NCCL_OK = (MPIRUN and D.is_available() and os.path.exists(CUDA_HEADERS) and cmlp.build_info()["cuda_compiled"]
                    and not cmlp.cuda.is_available())
needs_emulated_nccl = pytest.mark.skipif(
    not EMULATED_NCCL_OK, reason="needs mpirun, the MPI module, a CUDA build and no GPU (the emulator runs)")


def job_env(emulated_gpu=False):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_PYTHON + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",  # CI machines run as root
               OMPI_MCA_rmaps_base_oversubscribe="1",  # 3 ranks on 2 cores
               OMPI_MCA_btl_vader_single_copy_mechanism="none",  # containers forbid cross-process reads
               OPENBLAS_NUM_THREADS="1")
    if emulated_gpu:
        env.update(CMLP_CUDA_LIBRARY=EMULATOR, CMLP_NCCL_LIBRARY=EMULATOR, CMLP_EMU_BLOCK_ORDER="reverse")
    return env


def run_job(ranks, case, opts=None, timeout=120, emulated_gpu=False):
    """Rank 0's report of one job; a job that hangs fails the test after `timeout` seconds."""
    cmd = [MPIRUN, "-np", str(ranks), sys.executable, os.path.join(HERE, "dist_worker.py"), case,
           json.dumps(opts or {})]
    p = subprocess.run(cmd, capture_output=True, text=True, env=job_env(emulated_gpu), timeout=timeout)
    assert p.returncode == 0, f"mpirun exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_mpi_module_is_built_where_mpi_is_installed():
    # a build that silently left MPI out would skip every job below
    if shutil.which("mpicc") and os.environ.get("CMLP_MPI") != "0":
        assert D.is_available() and D.is_mpi_available()


def test_nccl_is_looked_for_in_the_wheels_layouts(tmp_path, monkeypatch):
    monkeypatch.delenv("CMLP_NCCL_LIBRARY", raising=False)
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    assert D._nccl_library() == "libnccl.so.2"  # none there: by name
    later = tmp_path / "nvidia" / "cu13" / "lib"
    later.mkdir(parents=True)
    (later / "libnccl.so.2").write_bytes(b"")
    assert D._nccl_library() == str(later / "libnccl.so.2")
    first = tmp_path / "nvidia" / "nccl" / "lib"
    first.mkdir(parents=True)
    (first / "libnccl.so.2").write_bytes(b"")
    assert D._nccl_library() == str(first / "libnccl.so.2")
    monkeypatch.setenv("CMLP_NCCL_LIBRARY", "/where/it/is.so")
    assert D._nccl_library() == "/where/it/is.so"


def test_processes_torchrun_started_are_told_to_use_mpirun():
    """torchrun's WORLD_SIZE > 1 with no MPI launcher: MPI would make each process a group of one,
    training alone; init_process_group refuses and says how to start the job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "MPI_"))}
    env.update(WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", PYTHONPATH=REPO_PYTHON)
    code = ("import cmlp\n"
            "try:\n    cmlp.distributed.init_process_group()\nexcept RuntimeError as e:\n    print(e)\n"
            "print(cmlp.distributed.is_initialized())")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "WORLD_SIZE=2 says this process is one of 2" in r.stdout and "mpirun -np 2" in r.stdout, r.stdout
    assert r.stdout.strip().endswith("False")
    env["WORLD_SIZE"] = "1"  # a group of one is one
    r = subprocess.run([sys.executable, "-c", "import cmlp; cmlp.distributed.init_process_group(); "
                        "print(cmlp.distributed.get_world_size())"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "1", r.stderr


def test_without_a_process_group_every_call_says_what_to_do():
    assert not D.is_initialized()
    for call in (D.get_rank, D.get_world_size, D.get_local_rank, D.get_backend, D.barrier, D.destroy_process_group,
                 lambda: D.all_reduce(np.zeros(2)), lambda: D.broadcast(np.zeros(2))):
        with pytest.raises(ValueError, match="init_process_group"):
            call()
    with pytest.raises(ValueError, match="backend"):
        D.init_process_group("gloo")
    model = cmlp.MLP([4, 3, 2])
    with pytest.raises(RuntimeError, match="init_process_group"):
        cmlp.Trainer(model, cmlp.optim.SGD(model), distributed=True)
    with pytest.raises(TypeError, match="distributed"):
        cmlp.Trainer(model, cmlp.optim.SGD(model), distributed=1)
    assert cmlp.Trainer(model, cmlp.optim.SGD(model)).distributed is False
    with pytest.raises(RuntimeError, match="init_process_group"):
        D.optim.ZeroRedundancyOptimizer(model, cmlp.optim.Adam)


@pytest.mark.skipif(cmlp.cuda.device_count() > 0, reason="a GPU is here: NCCL may be used")
def test_nccl_is_refused_without_a_gpu_and_says_why():
    """As torch's ProcessGroupNCCL: a group that would sum gradients on GPUs where there is none
    is refused at once, with CUDA's reason, and no group is made."""
    with pytest.raises(RuntimeError, match=r"backend 'nccl' (sums gradients on GPUs|needs cmlp's CUDA backend)"):
        D.init_process_group("nccl")
    assert not D.is_initialized()


@needs_mpi
def test_a_child_forked_from_a_rank_takes_part_in_no_collective_and_leaves_mpi_alone():
    # the child's collectives (its own, a trainer's) and a new group are refused instead of
    # waiting for ranks that will never come; its normal exit does not finalize the parent's MPI
    out = run_job(2, "fork")
    child = out["child"]
    assert child["rank"] == 0 and child["initialized"] is True
    for name in ("all_reduce", "barrier", "broadcast", "step", "init"):
        assert "forked from a rank of a process group" in child[name], (name, child[name])
    assert child["destroy"] == "ran" and np.isfinite(child["cpu"])
    assert out["max_child_exit"] == 0.0 and out["spread"] == 0.0
    assert out["uncaught"] == [1, True, False]  # its traceback, then its own exit; no MPI_Abort of the job


@needs_mpi
def test_collectives():
    out = run_job(2, "collectives")
    for dt in ("float32", "float64", "int64"):
        assert out[dt] == [[1, 3, 5, 7, 9], [0, 2, 4, 6, 8], [-1, 0, 1, 2, 3]]
    assert out["broadcast"] == [[1.0] * 3] * 2  # rank 1's
    # non-contiguous, int32, an unknown op, src out of range, a list, a second init, big-endian, objects
    # (a second init: torch's ValueError, and the RuntimeError cmlp raised before)
    assert out["errors"] == ["ValueError", "TypeError", "ValueError", "ValueError", "TypeError",
                             "ValueError/RuntimeError", "ValueError", "TypeError", "TypeError"]
    # torch's avg (of floats), product and bitwise reductions (of int64), each with a Work that has completed
    assert out["reduced"] == {"avg": [[1.5, 3.0], True, True], "product": [[54, 40, 180], True, True],
                              "band": [[6 & 9, 5 & 8, 12 & 15], True, True],
                              "bor": [[6 | 9, 5 | 8, 12 | 15], True, True],
                              "bxor": [[6 ^ 9, 5 ^ 8, 12 ^ 15], True, True]}, out["reduced"]
    assert out["group_none"] == [0, 2, "mpi", None, None, True, True]
    errors = out["group_errors"]
    for e in errors[:4] + errors[-1:]:
        assert e.startswith("ValueError: ") and "one process group" in e, errors
    assert errors[4].startswith("TypeError: all_reduce: band is a bitwise reduction, of int64 arrays"), errors
    assert errors[5].startswith("TypeError: all_reduce: avg takes float32 or float64 arrays, got int64"), errors
    assert errors[6].startswith("TypeError: async_op must be a bool"), errors
    assert errors[7].startswith("TypeError: device_ids must be None or a list"), errors
    assert out["longlong"] == [0, 2, 4]
    assert (out["rank"], out["world"]) == (0, 2)
    other = "other arguments (op, src, an output list)"
    fields = ["element count, shape", "dtype", other, "element count, shape", other, "element count, shape, C-contiguity"]
    assert [e and e.split("differ in their ")[1].split(":")[0] for e in out["differ"]] == fields, out["differ"]
    assert out["after_differ"] == [2.0, 2.0, 2.0]
    assert out["all_gather"] == [0.5, 1.5]
    assert out["all_gather_object"] == [{"rank": 0, "name": "r0"}, {"rank": 1, "name": "r1"}]
    assert out["broadcast_object_list"] == [{"lr": 0.1}, "text", 3]
    errors = out["gather_errors"]  # rank 0's: every rank raised, and none waits
    assert errors[0].startswith("ValueError: all_gather_object: the ranks' arguments differ"), errors
    assert errors[1].startswith("RuntimeError: all_gather_object: rank 1 could not pickle its object"), errors
    assert errors[2].startswith(("PicklingError", "AttributeError")), errors  # rank 0's own pickling error
    assert errors[3].startswith("ValueError: all_gather: the ranks' arguments differ"), errors
    assert out["after_gather"] == [4.0, 4.0, 4.0]
    other_args = "other arguments (op, src, an output list)"
    other = ("another rank was given a world_size, rank or device_id it cannot take, so no rank made the group "
             "(cmlp's ranks are the launcher's)")
    assert out["launcher"] == ["world_size=3, but the launcher made this process rank 0 of 2: cmlp's ranks are the "
                               "launcher's", "rank=1, but the launcher made this process rank 0 of 2: cmlp's ranks "
                               "are the launcher's",  # and rank=0 everywhere: rank 1's is wrong, and rank 0 raises too
                               other, other]  # (device_id="cpu" on rank 1 alone)
    # rank 0's: the ranks' arguments differ
    assert out["alone"] == ["ValueError"] * 5, out["alone"]
    assert out["avg_big"] == [float(np.float32(3e38))] * 3
    call = "call (all_reduce, broadcast, ...)"
    assert out["differ2"] == ["alignment", "dtype", other_args, call, "being an array, dtype, element count, shape, "
                              "C-contiguity, writability, alignment, " + call], out["differ2"]
    assert out["unpickle"] == "ran" and out["unpickled_on"] == 1  # (rank 0's; rank 1 raised, and the group goes on)


def test_init_process_group_refuses_torchs_arguments_it_cannot_honour_before_it_starts_anything():
    import datetime

    for kw, error, match in ((dict(init_method="tcp://10.0.0.1:23456"), ValueError, "init_method must be None"),
                             (dict(timeout=30), TypeError, "timeout must be a datetime.timedelta"),
                             (dict(timeout=datetime.timedelta(0)), ValueError, "timeout must be longer than 0"),
                             (dict(world_size=-2), ValueError, "world_size must be an int >= 0"),
                             (dict(rank="0"), ValueError, "rank must be an int >= 0")):
        with pytest.raises(error, match=match):
            D.init_process_group(**kw)
        assert not D.is_initialized()


def check_fit(out, ranks, tol, loss_rtol):
    """tol: the norm-wise relative error of the parameters' change against one process's. An
    element-wise bound would not hold: where a gradient element nearly cancels over the samples,
    or a ReLU input is within rounding of 0, the order of the sums decides it, and Adam's first
    steps move such an element by up to lr whatever its size (measured in fp32: 1e-5 of the
    largest parameter on one CPU, 2e-6 on another; norm-wise 1.5e-7 to 2.4e-6 on both)."""
    assert out["world"] == ranks and out["distributed"]
    assert out["rank_spread"] == 0.0  # every rank holds the same parameters, bit for bit
    assert out["update_err"] <= tol, out
    np.testing.assert_allclose(out["loss"], out["ref_loss"], rtol=loss_rtol)
    assert out["skipped"] == out["ref_skipped"]


@needs_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_fit_equals_one_process_on_the_same_samples(ranks):
    # batch 16 per rank against one process at 16 * ranks; 600 samples leave a short last step
    check_fit(run_job(ranks, "fit"), ranks, 1e-5, 1e-6)


@needs_mpi
@pytest.mark.parametrize("val", [1001, 2])
def test_validation_is_shared_between_the_ranks(val):
    # each rank evaluates its share of the rows (3 ranks, 1001 rows; 2 rows leave a rank none)
    out = run_job(3, "fit", {"val": val, "epochs": 1})
    check_fit(out, 3, 1e-5, 1e-6)
    (loss, acc), (ref_loss, ref_acc) = out["val"][0], out["ref_val"][0]
    assert abs(loss - ref_loss) <= 1e-5 * ref_loss and abs(acc - ref_acc) <= 1.0 / val


@needs_mpi
def test_ranks_without_a_sample_in_the_last_step_add_nothing():
    # 10 samples, batch 1 on 3 ranks: the last step has one sample, ranks 1 and 2 none
    check_fit(run_job(3, "fit", {"batch": 1, "n": 10, "epochs": 1}), 3, 1e-5, 1e-6)


@needs_mpi
def test_the_ranks_calls_into_the_epoch_loop_grow_together_and_shrink_after_one_slow_rank():
    # 600 steps a rank: the calls start at 600 // 200 = 3 steps and double while quick (under
    # 0.05 s: 24 steps by the 4th call, unless the machine is very busy); the 4th call lasts over
    # 0.4 s on rank 1 alone, and every rank halves the 5th
    out = run_job(2, "calls", {"slow_call": 4, "slow_seconds": 0.5})
    assert out["count_spread"] == out["asked_spread"] == out["rank_spread"] == 0.0, out  # the same calls
    asked = out["asked"]
    assert asked[0] == 3 and max(asked[:4]) > 3 and asked[4] == asked[3] // 2, asked
    assert sum(asked[:-1]) < 600 <= sum(asked), asked


@needs_mpi
@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_a_per_step_schedule_steps_every_rank_alike(opt):
    # OneCycleLR moves the rate (and Adam's beta1, SGD's momentum) at every step; 2400 samples in
    # steps of 2 * 4 make calls that grow from 1 step to MAX_RATES on every rank alike. At a peak
    # rate of 1e-2, 300 steps of Adam on random labels drive a hidden unit across a ReLU's 0 where
    # the order of the sums decides it, on some CPUs (one unit's 784 weights off by 5e-4, 4e-4
    # norm-wise); at 2e-3 no unit is near one (3e-7), and a schedule 1% off still gives 1e-1
    out = run_job(2, "fit", {"sched": True, "opt": opt, "batch": 4, "n": 2400, "epochs": 1, "max_lr": 2e-3})
    check_fit(out, 2, 1e-5, 1e-6)


@needs_mpi
def test_accumulation_sgd_momentum_and_no_shuffle():
    check_fit(run_job(2, "fit", {"accum": 3, "opt": "sgd", "shuffle": False, "n": 500}), 2, 1e-5, 1e-6)


@needs_mpi
@pytest.mark.parametrize("amp", [None, "fp16", "bf16"])
def test_gradient_clipping_sees_the_groups_summed_gradients(amp):
    # every rank clips the all-reduced (and unscaled) gradients by their norm: the update of one
    # process. Measured update differences against it: fp32 9e-7, bf16 7e-8, fp16 6e-6 after one
    # epoch (a second epoch of fp16 rounding drifts further, as unclipped runs can)
    out = run_job(2, "fit", {"clip": 0.05, "amp": amp, "accum": 2, "epochs": 1 if amp == "fp16" else 2})
    check_fit(out, 2, 1e-5 if amp is None else 2e-3, 1e-6 if amp is None else 1e-3)
    np.testing.assert_allclose(out["grad_norm"], out["ref_grad_norm"], rtol=1e-5 if amp is None else 1e-4)
    assert all(g > 0.05 for g in out["grad_norm"])  # the clipping was active


@needs_mpi
@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_mixed_precision(amp):
    check_fit(run_job(2, "fit", {"amp": amp, "accum": 2}), 2, 2e-3 if amp == "fp16" else 1e-2, 1e-3)


@needs_mpi
def test_every_rank_skips_the_same_fp16_steps():
    # a scale of 2**24 overflows the half-precision gradients: the first steps are skipped (by every
    # rank, as by the one process), the scale backs off, and the later steps are taken
    out = run_job(2, "fit", {"amp": "fp16", "init_scale": 2.0**24})
    # fp16 gradients summed over two ranks part from one process's in their last bits; Adam's
    # normalised step turns that into up to lr (1e-3) per step on an element whose gradient is
    # near 0 (measured: 1.8e-5 of the update)
    check_fit(out, 2, 5e-3, 1e-3)
    assert out["skipped"][0] > 0 and sum(out["skipped"]) < 2 * 19


@needs_mpi
def test_one_rank_under_a_memory_limit_micro_batches_alone():
    # rank 1 computes its share in micro-batches (its cache has room for half a batch, and its
    # limit allows no new segment); the update is the same
    out = run_job(2, "fit", {"limit_rank": 1})
    check_fit(out, 2, 1e-5, 1e-6)
    assert out["micro_spread"] > 0  # the ranks compute with different micro-batches
    # batch_size is per rank: a rank cuts its own 24 rows of a step into the fewest equal
    # micro-batches its room fits (3 of 8; halving would give 4 of 6)
    out = run_job(2, "fit", {"limit_rank": 1, "batch": 24, "room": 8})
    assert out["micro_least"] == 8, out
    check_fit(out, 2, 1e-5, 1e-6)  # measured 2.4e-6: the reference sums 48 rows at once
    # under amp the room holds the half-precision weights too, which the first step makes
    out = run_job(2, "fit", {"limit_rank": 1, "amp": "bf16"})
    check_fit(out, 2, 2e-3, 1e-3)
    assert out["micro_spread"] > 0 and out["micro_least"] == 8, out


@needs_mpi
@pytest.mark.parametrize("ranks, rows", [(2, 100), (3, 100)])
def test_under_a_limit_a_rank_plans_its_share_of_a_small_data_set(ranks, rows):
    """Every rank has the whole data set, and a step of it is shared out: under a limit that fits
    a rank's share in one micro-batch but not the batch asked for, every rank starts whole."""
    out = run_job(ranks, "small_data", {"rows": rows})
    assert out["world"] == ranks and out["share_rows"] == -(-rows // ranks)
    assert out["share_reserved"] < out["whole_reserved"]
    assert out["micro"] == 4096 and out["ooms"] == 0, out


@needs_mpi
def test_step_takes_each_ranks_own_batch():
    out = run_job(3, "step")  # batches of 5, 8 and 11 samples: one step on all 24
    np.testing.assert_allclose(out["losses"], out["ref_losses"], rtol=1e-6)
    assert out["update_err"] <= 1e-5 and out["rank_spread"] == 0.0, out


@needs_mpi
def test_a_rank_out_of_memory_fails_the_step_everywhere_and_nothing_hangs():
    out = run_job(2, "failure")
    assert out["failed"] == 2
    assert out["errors"][1].startswith("OutOfMemoryError") and "micro-batch of 1 sample" in out["errors"][1]
    assert "sharded over the 2 ranks" in out["errors"][1] and "ZeroRedundancyOptimizer" in out["errors"][1]
    assert out["errors"][0].startswith("RuntimeError") and "rank 1" in out["errors"][0]
    assert out["unchanged"]  # the step was taken by no rank
    assert out["rank_spread"] == 0.0 and np.isfinite(out["after_loss"])  # and the group trains on


@needs_mpi
def test_a_ctrl_c_on_one_rank_stops_every_rank_at_the_same_step_and_the_group_goes_on():
    out = run_job(2, "interrupts")
    other = "RuntimeError: rank 1 of the process group was interrupted (KeyboardInterrupt), so every rank stopped"
    for key in ("steps", "epoch_end", "step_before"):  # in fit's steps, at an epoch's end, before a step
        assert out[key][0].startswith(other) and out[key][1] == "KeyboardInterrupt: ", out[key]
    assert out["steps_epochs"] == 1 and out["epoch_end_epochs"] == 1  # no rank went on to a second epoch
    assert out["steps_state"] == 0.0  # the same steps taken everywhere
    assert not out["step_before_taken"] and out["step_after_taken"]
    assert out["step_after"] == ["returned", "KeyboardInterrupt: "]  # after the ranks agreed: taken, then raised
    for key in ("steps", "epoch_end", "step_before", "step_after"):  # and the group trains on in step
        assert out[key + "_spread"] == 0.0, key
    for key in ("scaler_init", "scaler_update"):  # scalers that differ: found before fit's first step
        assert "differ in the loss scaler" in out[key] and out[key + "_unchanged"], out


def test_a_debug_level_torch_does_not_know_is_refused_before_the_group_is_made(monkeypatch):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "LOUD")
    with pytest.raises(ValueError, match="TORCH_DISTRIBUTED_DEBUG must be OFF, INFO or DETAIL, got 'LOUD'"):
        D.init_process_group()
    assert not D.is_initialized()


@needs_mpi
def test_with_torchs_detail_debug_level_ranks_whose_collectives_differ_all_raise():
    out = run_job(2, "checked_calls", {"debug": "DETAIL"})
    # a trainer's call on one rank, a collective of the user's on the other: both raise, naming their own call
    mine, other = out["fit_vs_all_reduce"]
    assert mine.startswith("ValueError: the ranks of the process group made different collective calls "
                           "(TORCH_DISTRIBUTED_DEBUG=DETAIL checks them): this rank's is all_reduce of 1 int64"), mine
    assert "this rank's is all_reduce of 18 int64 elements (max), and another rank's differs in its size" in other
    for key in ("broadcast_vs_barrier", "sizes", "ops"):  # the user's collectives: their own check says which
        assert all(e.startswith("ValueError: ") and "the ranks' arguments differ" in e for e in out[key]), out[key]
    assert out["unchanged"] and out["spread"] == 0.0  # no step taken, and the group trains on in step


@needs_mpi
def test_ranks_that_disagree_all_raise():
    out = run_job(2, "mismatch")
    assert out["min_errors"] == 30  # on both ranks, 21 errors, a run and eight readings, no hang
    assert "fit's validation set (its labels, and rows spread over it)" in out["validation_contents"], out
    assert out["epoch_raised"].startswith("RuntimeError: rank 1 of the process group raised in its schedule's "
                                          "step after the epoch"), out["epoch_raised"]
    assert out["epoch_raised_epochs"] == 1  # no rank went on to a second epoch
    assert out["split_warned"].startswith("RuntimeError: rank 1 of the process group raised in its warning that it "
                                          "computes its steps in micro-batches"), out["split_warned"]
    assert out["split_warned_epochs"] == 1
    # rank 1's interrupt, caught there: on rank 0 (the one reported) the error naming rank 1
    assert out["interrupt_epoch"].startswith("RuntimeError: rank 1 of the process group raised in its schedule's "
                                             "step after the epoch"), out["interrupt_epoch"]
    assert out["interrupt_step"].startswith("RuntimeError: rank 1's schedule raised after the epoch's step 5"), out
    assert out["interrupt_epoch_spread"] == 0.0 and out["interrupt_step_spread"] == 0.0
    assert "data set's contents" in out["contents"]
    assert out["rates"].startswith("ValueError: the ranks' schedules give different rates or momenta for the "
                                   "epoch's step 4"), out["rates"]
    assert out["rates_steps"] <= 3 and out["rates_spread"] == 0.0  # no step at rates that differ, on any rank
    # rank 1's own error there; on rank 0 (the one reported), the error that names rank 1
    assert out["raised"].startswith("RuntimeError: rank 1's schedule raised after the epoch's step 5"), out["raised"]
    assert out["raised_steps"] == 5 and out["raised_spread"] == 0.0
    assert "over 2**62 samples a step" in out["group_batch"]
    assert out["negative_zero"] == "trained"
    assert "fit's epochs (from 1 to 2)" in out["epochs"]
    assert "fit's validation samples (-1: none) (from -1 to 64)" in out["validation"]
    assert "batch_size (from 8 to 9)" in out["batch"]
    assert out["argument"].startswith("RuntimeError") and "rank 1" in out["argument"]
    assert out["step"].startswith("RuntimeError") and "rank 1" in out["step"]
    assert "sample count (from 63 to 64)" in out["data"]
    assert out["labels"].startswith("RuntimeError") and "rank 1" in out["labels"]  # rank 1's labels were bad
    assert "label_smoothing" in out["smoothing"] and "mean" in out["normalize"] or "std" in out["normalize"]
    assert "the optimizer" in out["lr"] and "(from" not in out["lr"]  # hashes: their values say nothing
    assert "differ in the model's layer sizes: every rank" in out["layers"]
    assert "the call" in out["call"]


def check_changed(out, device="cpu"):
    """changed_case's report (see there)."""
    assert out["device"] == device
    some, every = "on some ranks only", "on every rank, to different values"
    # rank 0's load before the Trainer is every rank's start, as DistributedDataParallel's
    assert out["before_trainer"] == "trained" and out["before_trainer_spread"] == 0.0 and out["from_rank_0"] == 0.0
    for key, what, how in (("one_rank", "parameters", some), ("one_rank_again", "parameters", some),
                           ("every_rank_own", "parameters", every),
                           ("own_step", "parameters and optimizer states", every),
                           ("state", "optimizer states", every),
                           ("both", "parameters and optimizer states", every),
                           ("both_again", "parameters and optimizer states", every),
                           ("after_trainer", "parameters", some), ("local", "parameters and optimizer states", every),
                           ("second_trainer", "optimizer states", every)):
        assert out[key].startswith(f"ValueError: the ranks' {what} differ after a change made outside this "
                                   "data-parallel trainer (load_state_dict, optimizer.step(), a Trainer of one rank) "
                                   f"{how}: every rank must hold the same ones"), (key, out[key])
    assert out["one_rank_unchanged"]  # the call that raised took no step, and began no epoch
    assert out["every_rank_same"] == out["fixed"] == out["fixed_again"] == "trained"
    assert out["checkpoint"] == "trained" and out["checkpoint_spread"] == 0.0 and out["epochs"] == 2
    # a trainer's calls compare its own optimizer's state; AMSGrad's marks of a group not started
    # are one mark however they are written (C's bytes, or -1 from a state_dict)
    assert out["sgd"] == out["second"] == out["first_trainer"] == out["amsgrad_reloaded"] == "trained", out
    assert out["sgd_reloaded"] == "trained", out
    assert out["spread_at_end"] == 0.0


@needs_mpi
def test_parameters_changed_on_some_ranks_stop_the_next_call_on_every_rank():
    check_changed(run_job(2, "changed"))


@needs_emulated_nccl
def test_parameters_changed_on_some_gpus_stop_the_next_call_on_every_rank():
    check_changed(run_job(2, "changed", dict(backend="nccl", device="cuda"), timeout=300, emulated_gpu=True),
                  "cuda:0")


@needs_mpi
def test_an_evaluation_out_of_memory_on_one_rank_gives_the_groups_result():
    out = run_job(2, "evaluation")
    assert out["raised"] == 0 and out["rows"] < 1000, out  # rank 1 evaluated in smaller chunks
    assert out["rank_spread"] == 0.0
    assert out["val"][0] == pytest.approx(out["want"][0], rel=1e-6) and out["val"][1] == out["want"][1], out


@needs_mpi
def test_an_uncaught_exception_on_one_rank_ends_the_job():
    cmd = [MPIRUN, "-np", "2", sys.executable, os.path.join(HERE, "dist_worker.py"), "uncaught"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=job_env(), timeout=120)
    assert p.returncode != 0
    assert "rank 1 fails alone" in p.stderr and "ends the job" in p.stderr


@needs_mpi
def test_a_rank_that_exits_while_another_waits_for_it_ends_the_job_at_the_groups_timeout():
    # sys.exit skips the excepthook: rank 1 waits at its end for rank 0, which waits in a barrier
    # for rank 1 until the group's timeout (torch's: it bounds a collective's wait) ends the job
    # (the barrier is an all-reduce of the ranks' word on its arguments)
    cmd = [MPIRUN, "-np", "2", sys.executable, os.path.join(HERE, "dist_worker.py"), "exit_early",
           json.dumps({"timeout": 2})]
    start = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=job_env(), timeout=120)
    assert p.returncode != 0 and time.monotonic() - start < 60
    assert "rank 0 waited 2 s in MPI_Allreduce for the other ranks (the process group's timeout)" in p.stderr, p.stderr


@needs_mpi
@pytest.mark.parametrize("keep_group", [True, False])
def test_a_rank_that_ends_first_waits_for_the_others_whatever_the_timeout(keep_group):
    # rank 0 ends 11 s after rank 1, beyond the timeout, in no collective: nothing ends the job;
    # where the group is still there, rank 1 says that it waits
    cmd = [MPIRUN, "-np", "2", sys.executable, os.path.join(HERE, "dist_worker.py"), "collectives",
           json.dumps({"linger": 11, "timeout": 2, "keep_group": keep_group})]
    p = subprocess.run(cmd, capture_output=True, text=True, env=job_env(), timeout=120)
    assert p.returncode == 0, p.stderr
    assert ("rank 1 has ended and waits for the other ranks to end" in p.stderr) == keep_group, p.stderr


@needs_mpi
def test_a_process_started_without_mpirun_is_a_group_of_one():
    cmd = [sys.executable, os.path.join(HERE, "dist_worker.py"), "fit", json.dumps({"epochs": 1, "n": 100})]
    p = subprocess.run(cmd, capture_output=True, text=True, env=job_env(), timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["world"] == 1 and out["max_diff"] == 0.0 and out["loss"] == out["ref_loss"]


@pytest.fixture(scope="module")
def emulator():
    build = subprocess.run(["make", "-s", "emu-cuda", f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True,
                           text=True, timeout=900)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    nm = subprocess.run(["nm", "-D", EMULATOR], capture_output=True, text=True)
    if "ncclAllReduce" not in nm.stdout:
        pytest.skip("the emulator was built without MPI (no Open MPI mpicc): it has no NCCL")
    return EMULATOR


@needs_emulated_nccl
@pytest.mark.parametrize("opts", [{"timeout": 10, "idle": 11}, {"amp": "fp16", "accum": 2, "opt": "sgd"},
                                  {"amp": "bf16", "shuffle": False}, {"clip": 0.05}],
                         ids=["fp32-watched", "fp16-accumulation-sgd", "bf16", "fp32-clipping"])
def test_on_gpus_nccl_sums_the_gradients_inside_the_captured_step(emulator, opts):
    # 2 ranks on the emulated CUDA backend: full steps replay a graph holding the all-reduce. With
    # the group's timeout the device collectives are watched, and the ranks then idle past it:
    # each watch ended when its collective passed (one left would end the job)
    out = run_job(2, "fit", dict(opts, backend="nccl", device="cuda", n=300), timeout=300, emulated_gpu=True)
    check_fit(out, 2, 1e-5 if "amp" not in opts else 2e-3, 1e-6 if "amp" not in opts else 1e-3)
    assert out["nccl_graph_register"] == "0"  # the caching allocator's buffers are not NCCL's to register


@needs_emulated_nccl
def test_on_gpus_a_sharded_optimizer_steps_the_param_groups_parts_of_its_part(emulator):
    # 3 ranks' parts cut across the param groups' parts of the flat parameters, on the device; with
    # the group's timeout the device collectives are watched, and each one passed ends its watch
    out = run_job(3, "zero", {"opt": "adamw-groups", "device": "cuda", "backend": "nccl", "timeout": 10},
                  timeout=300, emulated_gpu=True)
    check_zero(out, 3, emulated=True)


@needs_emulated_nccl
@pytest.mark.parametrize("stall, what", [("1:1", "an all-reduce (NCCL)"),
                                         ("0:2", "a captured training step's collectives (NCCL, in a CUDA graph)")],
                         ids=["first-sum-on-rank-1", "captured-sum-on-rank-0"])
def test_on_gpus_a_collective_that_never_ends_ends_the_job_at_the_groups_timeout(emulator, stall, what):
    # a rank's device stuck in NCCL's sum (the emulated NCCL's n-th collective on rank r never
    # ends): the host queued it and went on, so no host collective's wait sees it; the watch of
    # the device's collectives ends the job at the group's timeout, on the stuck rank or the one
    # that waits for it, naming what it waited for (the second sum is recorded in a graph: the
    # first step runs eagerly, the second is captured, and the graph's launch runs it)
    cmd = [MPIRUN, "-np", "2", sys.executable, os.path.join(HERE, "dist_worker.py"), "fit",
           json.dumps({"backend": "nccl", "device": "cuda", "n": 300, "timeout": 3})]
    env = dict(job_env(emulated_gpu=True), CMLP_EMU_NCCL_STALL=stall)
    start = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode != 0 and time.monotonic() - start < 120, (p.returncode, p.stderr[-3000:])
    said = re.findall(r"rank [01] waited 3 s for (.+?) on cuda:0 for the other ranks \(the process group's timeout\): "
                      r"one has ended or is stuck; ending the job \(MPI_Abort\)", p.stderr)
    assert said and set(said) == {what}, p.stderr[-3000:]


@needs_emulated_nccl
def test_on_gpus_a_collective_queued_on_a_stuck_device_ends_the_job_at_the_groups_timeout(emulator):
    # as on a GPU: the collective is queued and the host goes on (to its next wait for the device,
    # which never ends); its fence never passes, and the watch's monitor ends the job at the
    # timeout, whatever the thread asking the device about fences is stuck in
    cmd = [MPIRUN, "-np", "1", sys.executable, os.path.join(HERE, "dist_worker.py"), "fit",
           json.dumps({"backend": "nccl", "device": "cuda", "n": 300, "timeout": 2})]
    env = dict(job_env(emulated_gpu=True), CMLP_EMU_NCCL_STALL="0:1:queued")
    start = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode != 0 and time.monotonic() - start < 120, (p.returncode, p.stderr[-3000:])
    assert ("rank 0 waited 2 s for an all-reduce (NCCL) on cuda:0 for the other ranks (the process group's timeout): "
            "one has ended or is stuck; ending the job (MPI_Abort)") in p.stderr, p.stderr[-3000:]


@needs_emulated_nccl
def test_on_gpus_short_steps_and_ranks_without_samples(emulator):
    out = run_job(3, "fit", {"backend": "nccl", "device": "cuda", "n": 10, "batch": 1, "epochs": 1}, timeout=300,
                  emulated_gpu=True)
    check_fit(out, 3, 1e-5, 1e-6)


@needs_emulated_nccl
def test_on_gpus_a_per_step_schedule_steps_every_rank_alike(emulator):
    # each step's rate from the call's table on the device, in the captured step with NCCL's sum
    out = run_job(2, "fit", {"sched": True, "batch": 4, "n": 2400, "epochs": 1, "backend": "nccl", "device": "cuda"},
                  timeout=300, emulated_gpu=True)
    check_fit(out, 2, 1e-5, 1e-6)


@needs_emulated_nccl
def test_on_gpus_a_rank_that_micro_batches_from_host_memory_makes_every_rank_run_eagerly(emulator):
    # rank 1 computes micro-batches under a limit that leaves its data set in host memory, whose
    # steps no graph holds: NCCL's all-reduce must be captured on every rank or on none (the
    # emulated NCCL aborts the job on a mix), so the ranks agree on the path of each step and all
    # run eagerly; the update is the same. The epoch's calls grow to several steps, with a
    # collective still queued on one rank's stream when it enters the next step's host collective
    # (the emulator runs a collective when queued, as a GPU does)
    out = run_job(2, "fit", {"backend": "nccl", "device": "cuda", "n": 200, "limit_rank": 1},
                  timeout=300, emulated_gpu=True)
    check_fit(out, 2, 1e-5, 1e-6)
    assert out["micro_spread"] > 0 and out["graphs"] == [0, 0, 0]


@needs_emulated_nccl
def test_on_gpus_a_rank_below_its_micro_batch_captures_its_steps_with_every_rank(emulator):
    # rank 1 starts at micro-batches of 5 of its 16 rows (as after an out-of-memory retry) and
    # grows back every 2 good steps: its growth trials run every rank's step eagerly, the steps
    # between are captured and replayed on all, at whatever micro-batch each rank holds
    out = run_job(2, "fit", {"backend": "nccl", "device": "cuda", "n": 400, "epochs": 3, "start_micro_rank": 1,
                             "start_micro": 5, "grow": 2}, timeout=300, emulated_gpu=True)
    check_fit(out, 2, 1e-5, 1e-6)
    assert out["graphs"][0] >= 3 and out["graphs"][1] > 0 and out["graph_spread"] == 0, out["graphs"]


@needs_emulated_nccl
@pytest.mark.parametrize("opts", [{"clip": 0.05}, {"zero": True}], ids=["adam-clipping", "zero"])
def test_on_gpus_a_kernel_one_rank_cannot_load_fails_the_step_on_every_rank(emulator, opts):
    # CUDA loads a kernel at its first launch: rank 1, its memory in use, cannot load the
    # update's kernels (Adam's, clipping's). They are loaded before the ranks agree on the step,
    # so every rank raises and none took the step (the update used to fail on rank 1 alone, after
    # the others had taken it; with ZeRO the job hung); with the memory back, all step alike
    out = run_job(2, "late_launch", dict(opts, backend="nccl"), timeout=300, emulated_gpu=True)
    assert all(out["errors"]) and "CUDA out of memory at a launch" in out["errors"][1], out["errors"]
    assert "rank 1" in out["errors"][0] and out["unchanged"], out
    assert out["stepped"] and out["rank_spread"] == 0.0


@needs_emulated_nccl
def test_a_gpu_model_in_a_group_made_for_the_cpu_is_refused_by_every_rank(emulator):
    out = run_job(2, "backend", {"device": "cuda"}, timeout=300, emulated_gpu=True)
    assert out["ranks_raising"] == 2 and 'init_process_group("nccl")' in out["error"]
    assert out["backend"] == "mpi" and out["local"] == [0, 2]


_SOLO_SCRIPT = r"""
import json, sys
import numpy as np
import cmlp
D = cmlp.distributed
try:
    D.init_process_group("mpi")
except RuntimeError as e:
    print(json.dumps({"error": str(e)}))
    sys.exit(0)
x = np.random.default_rng(0).integers(0, 256, (100, 784), dtype=np.uint8)
y = np.random.default_rng(1).integers(0, 10, 100)
params = []
for distributed in (True, False):
    m = cmlp.MLP([784, 16, 10], seed=0)
    cmlp.Trainer(m, cmlp.optim.Adam(m), batch_size=8, distributed=distributed).fit(x, y, epochs=1, progress=False)
    params.append(m._c.get_params())
a = np.arange(3.0)
D.all_reduce(a)
print(json.dumps({"world": D.get_world_size(), "version": D.library_version(), "same": bool(np.array_equal(*params)),
                  "sum": a.tolist(), "available": D.is_available()}))
"""


def test_without_the_mpi_module_a_process_is_a_group_of_one(tmp_path):
    # the package without its MPI module, as a build where no MPI was found
    pkg = tmp_path / "cmlp"
    shutil.copytree(os.path.join(REPO_PYTHON, "cmlp"), pkg, ignore=shutil.ignore_patterns("_cmlp_mpi.so"))
    env = {k: v for k, v in job_env().items() if not k.startswith(("OMPI_", "PMI", "SLURM_"))}
    env["PYTHONPATH"] = str(tmp_path)
    env.pop("CMLP_MPI_LIBRARY", None)
    p = subprocess.run([sys.executable, "-c", _SOLO_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out == {"world": 1, "version": "none (a group of one, without MPI)", "same": True, "sum": [0.0, 1.0, 2.0],
                   "available": False}
    # started by an MPI launcher, the missing module is an error that says so
    env["OMPI_COMM_WORLD_SIZE"] = "2"
    p = subprocess.run([sys.executable, "-c", _SOLO_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "has no MPI support" in json.loads(p.stdout.strip().splitlines()[-1])["error"]


_NCCL_FIT_SCRIPT = r"""
import json
import numpy as np
import cmlp
D = cmlp.distributed
available = D.is_nccl_available()
D.init_process_group("nccl")
model = cmlp.MLP([64, 32, 5], device="cuda", seed=0)
before = model._c.get_params()
x, y = np.ones((64, 64), np.float32), np.arange(64) % 5
free = cmlp.memory.mem_get_info("cuda")[0]
try:
    cmlp.Trainer(model, cmlp.optim.SGD(model, lr=0.1), batch_size=16).fit(x, y, epochs=1, progress=False)
    out = {"error": None}
except RuntimeError as e:
    out = {"error": str(e)}
out["unchanged"] = bool(np.array_equal(before, model._c.get_params()))
out["available"] = available
out["taken"] = free - cmlp.memory.mem_get_info("cuda")[0]  # (device memory outside the allocator)
print(json.dumps(out))
"""


def _nccl_fit(**env):
    """_NCCL_FIT_SCRIPT's report, in a group of one on the emulated GPU and NCCL with env set."""
    env = dict(job_env(emulated_gpu=True), **env)
    p = subprocess.run([sys.executable, "-c", _NCCL_FIT_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@needs_emulated_nccl
@pytest.mark.parametrize("version", [2804, 20905, 21207])
def test_an_nccl_too_old_for_graph_capture_is_refused_with_its_version(emulator, version):
    # the step holds NCCL's collectives inside a CUDA graph, which NCCL supports from 2.9.6 on,
    # and runs eager ones beside its replays, which it supports from 2.13 on
    out = _nccl_fit(CMLP_EMU_NCCL_VERSION=str(version))
    shown = {2804: "2.8.4", 20905: "2.9.5", 21207: "2.12.7"}[version]
    assert f"NCCL {shown} (" in out["error"] and "older than 2.13.0" in out["error"], out
    assert out["unchanged"] and out["available"] is False


@needs_emulated_nccl
@pytest.mark.parametrize("connect", [100 << 20, 1 << 40])
def test_nccl_buffers_that_find_no_device_memory_are_named_in_the_error(emulator, connect):
    """NCCL makes its connections' buffers at a communicator's first collectives, in device memory
    outside the caching allocator (the emulated NCCL: CMLP_EMU_NCCL_CONNECT_BYTES). Where they fit
    they take that memory; where they do not, the step's all-reduce fails with NCCL's error, which
    says what it most likely is and what leaves room, and the model is as it was."""
    out = _nccl_fit(CMLP_EMU_MEMORY=str(512 << 20), CMLP_EMU_NCCL_CONNECT_BYTES=str(connect))
    if connect == 100 << 20:
        assert out["error"] is None and out["taken"] == connect and not out["unchanged"], out
    else:
        assert out["error"].startswith("ncclAllReduce of ") and "(NCCL result 1)" in out["error"], out
        assert "most likely NCCL's own buffers" in out["error"] and "NCCL_RUNTIME_CONNECT=0" in out["error"], out
        assert out["unchanged"] and out["taken"] == 0, out


@needs_emulated_nccl
def test_on_gpus_a_group_made_again_gives_the_trainer_a_new_communicator(emulator):
    out = run_job(2, "regroup", {"device": "cuda", "backend": "nccl"}, timeout=300, emulated_gpu=True)
    assert out["rank_spread"] == 0.0 and out["epochs"] == 2 and out["update_err"] <= 1e-5, out


def _have_fashion():
    try:
        cmlp.datasets.fashion_mnist()
    except FileNotFoundError:
        return False
    return True


@needs_mpi
@pytest.mark.skipif(not _have_fashion(), reason="Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)")
def test_the_command_line_trains_data_parallel(tmp_path):
    save = tmp_path / "model.npz"
    cmd = [MPIRUN, "-np", "2", sys.executable, "-m", "cmlp", "train", "--distributed", "--epochs", "1", "--layers",
           "784,32,10", "--no-progress", "--save", str(save)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=job_env(), timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    lines = p.stdout.strip().splitlines()
    assert "batch 32 x 1 x 2 ranks" in lines[0]  # one report, from rank 0
    assert sum(line.startswith("epoch 1/1") for line in lines) == 1
    accuracy = float(lines[-2].split(": ")[1].rstrip("%")) if lines[-1].startswith("saved") else None
    assert accuracy is not None and accuracy > 70.0, lines
    assert cmlp.MLP.load(str(save)).layer_sizes == (784, 32, 10)


def check_zero(out, ranks, clipping=False, emulated=False):
    """A ZeroRedundancyOptimizer's run against the same run with the whole optimizer on every rank.
    Its gradients are summed by a reduce-scatter (each rank needs its part only), the whole
    optimizer's by an all-reduce: on 2 ranks both sums are a + b, and the runs are equal bit for
    bit; on more ranks the two collectives may add the ranks' terms in different orders, and the
    runs differ by that rounding (held to the 1e-5 of the other data-parallel comparisons). Every
    rank holds the same parameters either way: each part is summed once, by its owner."""
    assert out["world"] == ranks
    assert out["rank_spread"] == 0.0
    assert out["skipped"] == out["ref_skipped"]
    assert out["local_state"]  # opt.state: the rank's own, with the whole optimizer's entries
    # with clipping the norm is the norm of the parts' float norms: the unsharded run's within
    # float rounding, so the scaled gradients and the updates are too (not bit for bit)
    exact = ranks == 2 and not clipping
    if clipping:
        assert out["norm_diff"] <= 1e-6, out
    # the last step's gradients: rank 0's part summed as the whole optimizer's were; the rest
    # undefined (NaN from the emulated NCCL, part of it the clipping's scratch)
    if exact:
        assert out["grad_part_same"], out
    else:
        assert out["grad_part_pattern"] and out["grad_part_diff"] <= 1e-5 * out["grad_scale"], out
    if not clipping and out["rest_nan"] is not None:  # a rank's other parts are its own sums
        assert out["rest_nan"] if emulated else not out["rest_same"]
    if exact:  # the same update, element by element
        assert out["same_params"] and out["loss"] == out["ref_loss"]
        assert out["same_state"]  # consolidated: the whole optimizer's state_dict
        assert out["resumed"]  # a checkpoint loaded into a sharded optimizer trains on the same
    else:
        assert out["param_diff"] <= 1e-5 * out["scale"] and out["resumed_diff"] <= 1e-5 * out["scale"], out
        assert out["loss"] == pytest.approx(out["ref_loss"], rel=1e-5)
        assert out["state_diff"] <= 1e-3, out  # relative to each tensor's largest value
    n, (lo, hi) = out["n"], out["shard"]
    chunk = -(-(-(-n // ranks)) // 64) * 64  # n / ranks rounded up to 64 floats
    assert (lo, hi) == (0, min(n, chunk))  # rank 0's part
    whole, part = out["held"]
    buffers = whole // (4 * n)
    assert buffers in (1, 2, 3) and whole == buffers * n * 4
    assert part == buffers * (hi - lo) * 4  # the state of rank 0's part only
    assert "consolidate_state_dict" in out["refused"]  # on the ranks it was not sent to
    return part


@needs_mpi
@pytest.mark.parametrize("ranks,opts", [(2, {}), (3, {}), (2, {"opt": "sgd", "accum": 2}), (3, {"opt": "adamw"}),
                                        (2, {"amp": "fp16", "clip": 0.05, "init_scale": 2.0**24}),
                                        (3, {"amp": "bf16", "accum": 3}), (3, {"clip": 0.05}),
                                        (3, {"opt": "adamw-groups"}), (3, {"opt": "adam-amsgrad"}),
                                        (3, {"opt": "adam-amsgrad-groups"}), (2, {"opt": "sgd-groups"})],
                         ids=["adam-2", "adam-3", "sgd-accumulation-2", "adamw-3", "fp16-clipping-skips-2", "bf16-3",
                              "clipping-3", "param-groups-3", "amsgrad-3", "amsgrad-groups-3", "sgd-groups-2"])
def test_zero_redundancy_optimizer_keeps_a_part_of_the_state_and_updates_the_same(ranks, opts):
    out = run_job(ranks, "zero", opts)
    part = check_zero(out, ranks, clipping="clip" in opts)
    if opts.get("init_scale"):
        assert out["skipped"][0] > 0  # steps skipped by every rank alike
    optimizer = {"sgd": "sgd_momentum", "sgd-groups": "sgd_momentum", "adam-amsgrad": "adam_amsgrad",
                 "adam-amsgrad-groups": "adam_amsgrad"}.get(opts.get("opt"), "adam")
    planned = cmlp.memory.plan(SIZES, 16, optimizer, amp=opts.get("amp"), optimizer_shards=ranks)
    assert planned.breakdown["optimizer_state"] == part  # the plan is the first rank's



@needs_mpi
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_sharded_step_whose_inf_is_in_one_part_is_skipped_by_every_rank(device, request):
    # each rank unscales and checks only its own part: the verdicts are shared, or one rank
    # would step (and grow its scale) while the other skipped
    if device == "cuda":
        if not EMULATED_NCCL_OK:
            pytest.skip("needs the emulated CUDA backend with NCCL")
        request.getfixturevalue("emulator")
    opts = {"device": device, "backend": "nccl" if device == "cuda" else "mpi"}
    out = run_job(2, "zero_partial_inf", opts, timeout=300, emulated_gpu=device == "cuda")
    assert max(out["parts"]) > 1.2 * min(out["parts"])  # one part overflows, the other does not
    assert out["unchanged"] and out["spread"] == 0.0
    assert out["scale_spread"] == 0.0 and out["scale_after"] == np.float32(out["scale"] * 0.5)


@needs_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_zero_redundancy_optimizer_run_peaks_where_the_planner_says(ranks):
    (whole, planned_whole), (sharded, planned_sharded) = run_job(ranks, "zero_plan")["peaks"]
    assert whole == planned_whole and sharded == planned_sharded  # exactly, on the rank holding the most
    assert whole - sharded > 0


@needs_mpi
@pytest.mark.parametrize("clip", [None, 0.05])
def test_zero_redundancy_optimizer_with_parts_left_empty(clip):
    # 23 parameters over 3 ranks in parts of 64: ranks 1 and 2 keep no state (and clipping's norm
    # is then the whole gradients', all-reduced)
    check_zero(run_job(3, "zero", {"sizes": [4, 3, 2], "n": 64, "clip": clip}), 3, clipping=clip is not None)


@needs_mpi
def test_zero_redundancy_optimizer_refuses_what_it_cannot_do():
    out = run_job(2, "zero_errors")
    assert out["class"].startswith("TypeError") and "optimizer_class" in out["class"]
    assert out["nested"].startswith("TypeError")
    assert out["group"].startswith("ValueError") and "process_group" in out["group"]
    assert out["overlap"].startswith("ValueError") and "overlap_with_ddp" in out["overlap"]
    assert out["bucket"].startswith("TypeError")
    assert out["setting"].startswith("ValueError") and "learning rate" in out["setting"]
    assert out["alone"].startswith("ValueError") and "data-parallel" in out["alone"]
    assert out["to"].startswith("ValueError") and "[0, 2)" in out["to"]
    assert out["unconsolidated"].startswith("RuntimeError") and "consolidate_state_dict" in out["unconsolidated"]
    assert "before its first step" in out["after_step"]
    assert len(out["standalone"]) == 4 and all("data-parallel" in e for e in out["standalone"]), out["standalone"]
    assert out["unchanged"]
    assert out["regroup_spread"] == 0.0
    assert out["consolidated_lr"] == 0.025 and "consolidate_state_dict" in out["after_load"]
    assert "no longer exists" in out["no_group"] and "init_process_group" in out["no_group"]
    assert "the ranks' optimizer states differ" in out["mismatched"]  # on rank 0 too; no rank waits
    assert out["isinstance"] == [True, True, "ZeroRedundancyOptimizer[SGD]"]
    assert out["world_rank"] == [2, 0]


@needs_emulated_nccl
@pytest.mark.parametrize("ranks,opts", [(2, {}), (3, {"amp": "fp16", "accum": 2, "opt": "sgd"}),
                                        (3, {"sizes": [4, 3, 2], "n": 64}),
                                        (2, {"amp": "fp16", "clip": 0.05, "init_scale": 2.0**24}),
                                        (3, {"clip": 0.05}), (3, {"sizes": [4, 3, 2], "n": 64, "clip": 0.05})],
                         ids=["fp32-2", "fp16-accumulation-sgd-3", "parts-left-empty-3", "fp16-clipping-skips-2",
                              "clipping-3", "clipping-parts-left-empty-3"])
def test_on_gpus_zero_redundancy_optimizer_gathers_the_parts_inside_the_captured_step(emulator, ranks, opts):
    # NCCL broadcasts from each part's owner, captured with the step and replayed with it
    out = run_job(ranks, "zero", dict(opts, backend="nccl", device="cuda", n=opts.get("n", 200)), timeout=300,
                  emulated_gpu=True)
    check_zero(out, ranks, clipping="clip" in opts, emulated=True)


@needs_mpi
@pytest.mark.skipif(not _have_fashion(), reason="Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)")
def test_the_command_line_shards_the_optimizer_state(tmp_path):
    runs = {}
    for zero in (False, True):
        cmd = [MPIRUN, "-np", "2", sys.executable, "-m", "cmlp", "train", "--distributed", "--epochs", "1",
               "--layers", "784,64,10", "--no-progress"] + (["--zero"] * zero)
        p = subprocess.run(cmd, capture_output=True, text=True, env=job_env(), timeout=300, cwd=tmp_path)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        runs[zero] = p.stdout.strip().splitlines()
    assert "optimizer state sharded over the ranks" in runs[True][0]
    epoch = {z: runs[z][1].split() for z in runs}
    assert epoch[True][3] == epoch[False][3] and runs[True][-1] == runs[False][-1]  # the same loss and accuracy
    units = {"B": 1, "KiB": 1024, "MiB": 1024**2}
    peak = {z: float(epoch[z][epoch[z].index("memory") + 1]) * units[epoch[z][epoch[z].index("memory") + 2]]
            for z in runs}
    # Adam's state: 2 x 50,890 floats on one rank; sharded, rank 0 keeps 2 x 25,472 (in parts of 64)
    assert abs(peak[False] - peak[True] - 2 * (50_890 - 25_472) * 4) <= 1024, peak  # printed to 0.01 KiB
    p = subprocess.run([sys.executable, "-m", "cmlp", "train", "--zero"], capture_output=True, text=True,
                       env=job_env(), timeout=60)
    assert p.returncode == 2 and "--distributed" in p.stderr
