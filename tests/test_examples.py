"""The examples run as users run them (small sizes), and say what they claim."""
import os
import re
import subprocess
import sys

import cmlp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_PYTHON = os.path.dirname(os.path.dirname(os.path.abspath(cmlp.__file__)))


def run(script, *args, cwd):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_PYTHON + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def test_the_oom_story(tmp_path):
    r = run("oom_story.py", "--batch-size", "2048", "--limit", "16MB", "--history", "h.pickle", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "OutOfMemoryError: " in out and "out of memory: 1 request failed" in out
    assert re.search(r"\d+\.\d\d MiB for activations; \d+\.\d\d [KMG]?i?B was free", out), out
    assert "the model is unchanged: True" in out
    same = float(re.search(r"from the unlimited run: ([0-9.e+-]+)", out).group(1))
    other = float(re.search(r"first step of the unlimited run: ([0-9.e+-]+)", out).group(1))
    assert same < 1e-5 < 1e-3 < other, (same, other)
    report = cmlp.memory.snapshot_report(tmp_path / "h.pickle")
    assert "out of memory: 1 request failed" in report
