"""Bad knobs and unsupported reduce ops explain themselves: the error names the knob (or the
op) and its value, at the first use, instead of an assertion deep in PyTorch, a silent run
on another backend, or a number. And reduce-scatters with bitwise ops, which odc does not
reduce itself, are served by the inner backend (CPU: gloo). A good ODC_DEFAULT_BACKEND is
tested in tests/integrations/test_zero_code_change.py."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed

INSTALLED = any(e.name == "odc" for e in entry_points(group="torch.backends"))


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (one rank, a HashStore group), without the caller's
    ODC_* variables."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ODC_")}
    prelude = textwrap.dedent("""
        import datetime, torch, torch.distributed as dist
        def init(backend=None):
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=20))
    """)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                          env={**base, **env}, capture_output=True, text=True, timeout=120)


BAD_DEFAULT_WARNING = "RuntimeWarning: torch_odc_backend: ODC_DEFAULT_BACKEND='banana'"


def _last_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0, f"expected a failure, got rc 0:\n{proc.stdout}\n{proc.stderr}"
    return proc.stderr.strip().splitlines()[-1]


@pytest.mark.skipif(not INSTALLED, reason="needs the installed package (its torch.backends entry "
                    "point): pip install --no-build-isolation --no-deps -e .")
@pytest.mark.parametrize("backend", [None, "cpu:odc"], ids=["no-backend", "cpu:odc"])
def test_bad_default_backend_raises_at_the_first_group_naming_the_knob(backend):
    proc = _run(f"init({backend!r})", {"ODC_DEFAULT_BACKEND": "banana", "TORCH_DEVICE_BACKEND_AUTOLOAD": "1"})
    # no warning before it: the error is the one message
    assert proc.stderr.count(BAD_DEFAULT_WARNING) == 0, proc.stderr
    err = _last_error(proc)
    assert err.startswith("ValueError: ODC_DEFAULT_BACKEND='banana'"), err
    assert "expected cuda, cpu or cpu,cuda" in err, err


def test_bad_default_backend_raises_without_autoload_too():
    proc = _run("import torch_odc_backend\ninit('cpu:odc')",
                {"ODC_DEFAULT_BACKEND": "banana", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    err = _last_error(proc)
    assert err.startswith("ValueError: ODC_DEFAULT_BACKEND='banana'"), err


def _bad_default_env(autoload: str = "1") -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ODC_")}
    return {**base, "ODC_DEFAULT_BACKEND": "banana", "TORCH_DEVICE_BACKEND_AUTOLOAD": autoload,
            "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("autoload", ["1", "0"])
def test_bad_default_backend_is_silent_at_the_package_import(autoload):
    """Neither `import torch` (the autoload hook) nor `import torch_odc_backend` says anything,
    however often registration runs: the first group's error is the one message."""
    code = ("import torch, importlib, torch_odc_backend, _torch_odc_backend_autoload as hook\n"
            "hook.autoload(); importlib.reload(torch_odc_backend)")
    proc = subprocess.run([sys.executable, "-c", code], env=_bad_default_env(autoload),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "banana" not in proc.stderr, proc.stderr


def test_bad_default_backend_is_silent_at_import_torch():
    """What torchrun's launcher runs, and every process with the package installed."""
    proc = subprocess.run([sys.executable, "-c", "import torch, torch.distributed as dist; "
                           "print(dist.Backend.default_device_backend_map['cpu'])"],
                          env=_bad_default_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr
    # the hook still ran (installed package): odc is the default, so the first group raises
    assert proc.stdout.strip() == ("odc" if INSTALLED else "gloo"), proc.stdout


def test_bad_default_backend_under_torchrun_says_it_once_per_group(tmp_path):
    """torchrun with 2 workers: the launcher and the imports say nothing; each worker's first
    group raises the error once."""
    script = tmp_path / "worker.py"
    # one write of the whole line (atomic on a pipe): the two workers' lines never interleave
    script.write_text("import os\nimport torch_odc_backend\nimport torch.distributed as dist\n"
                      "try:\n    dist.init_process_group('cpu:odc')\n"
                      "except ValueError as e:\n    os.write(1, f'raised: {e}\\n'.encode())\n")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script)], env=_bad_default_env(), capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("banana") == 2 and out.count("raised: ODC_DEFAULT_BACKEND='banana'") == 2, out[-3000:]


def test_unwritable_stats_dir_is_named_at_the_first_group(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    folder = str(blocker / "stats")  # under a regular file: cannot be created, even as root
    proc = _run("import torch_odc_backend\ninit('cpu:odc')", {"ODC_STATS_DIR": folder})
    err = _last_error(proc)
    assert err.startswith(f"ValueError: ODC_STATS_DIR={folder!r}: cannot create that folder"), err


def test_unsupported_reduce_op_is_named():
    proc = _run("""
        import torch_odc_backend
        init('cpu:odc')
        dist.all_reduce(torch.ones(4, dtype=torch.int64), op=dist.ReduceOp.BAND)
    """, {"ODC_SELF_SERVE": "1"})
    err = _last_error(proc)
    assert "all_reduce: unsupported reduce op BAND" in err, err
    assert "ODC_SELF_SERVE=0" in err, err


def _bitwise_worker(rank, world):
    out = {}
    for name, op in (("BAND", dist.ReduceOp.BAND), ("BOR", dist.ReduceOp.BOR), ("BXOR", dist.ReduceOp.BXOR)):
        x = torch.tensor([[1 << rank, 3 + rank, 7 * rank]] * world, dtype=torch.int64).flatten()
        y = torch.empty(3, dtype=torch.int64)
        dist.reduce_scatter_tensor(y, x, op=op)
        out[name] = y.tolist()
    if "odc" in dist.get_backend():
        from torch_odc_backend import backend_stats

        out["stats"] = backend_stats()
    return out


def test_reduce_scatter_with_bitwise_ops_is_served():
    """The values gloo gives (its own test, with backend="gloo", gives the same lists)."""
    world, backend = 2, "cpu:odc"
    res = run_distributed(_bitwise_worker, world, backend=backend, deadline_s=120)
    rows = [[1 << r, 3 + r, 7 * r] for r in range(world)]
    want = {
        "BAND": [rows[0][i] & rows[1][i] for i in range(3)],
        "BOR": [rows[0][i] | rows[1][i] for i in range(3)],
        "BXOR": [rows[0][i] ^ rows[1][i] for i in range(3)],
    }
    for rank in range(world):
        for name, values in want.items():
            assert res[rank][name] == values, (backend, rank, name, res[rank][name])
        assert res[rank]["stats"].get("delegated_ops", 0) >= 3, res[rank]["stats"]


# --- every knob's error names the values it takes ------------------------------------------

def _expected_values(message: str) -> list[str]:
    """The values an error lists after 'expected ' ("auto, 1 or 0" -> ["auto", "1", "0"])."""
    listed = message.split(": expected ", 1)[1]
    return [v.strip() for part in listed.split(", ") for v in part.split(" or ") if v.strip()]


def _clean_knobs(monkeypatch):
    from torch_odc_backend import config

    for knob in config.KNOBS:
        monkeypatch.delenv(knob.env, raising=False)
    return config


def test_match_check_yes_says_0_or_1(monkeypatch):
    config = _clean_knobs(monkeypatch)
    monkeypatch.setenv("ODC_MATCH_CHECK", "yes")
    with pytest.raises(ValueError) as e:
        config.knobs()
    assert str(e.value) == "ODC_MATCH_CHECK='yes': expected 0 or 1"


def _knob_names():
    from torch_odc_backend import config

    return [k.env for k in config.KNOBS]


@pytest.mark.parametrize("env", _knob_names())
def test_every_knob_error_lists_what_it_takes(env, monkeypatch):
    """A bad value of any backend knob names the knob, the value and what it takes; each
    listed value is taken (flags and choices), and an integer's bounds are the ones enforced."""
    config = _clean_knobs(monkeypatch)
    monkeypatch.setenv(env, "yes")
    with pytest.raises(ValueError) as e:
        config.knobs()
    msg = str(e.value)
    assert msg.startswith(f"{env}='yes': expected "), msg
    if "byte count" in msg:  # sizes: "a byte count such as 4096, 512K or 32M"
        for example in ("4096", "512K", "32M"):
            monkeypatch.setenv(env, example)
            config.knobs()
        return
    bounds = re.fullmatch(r".*: expected an integer from (\d+) to (\d+)", msg)
    if bounds:
        lo, hi = int(bounds.group(1)), int(bounds.group(2))
        for good in (lo, hi):
            monkeypatch.setenv(env, str(good))
            config.knobs()
        for bad in (lo - 1, hi + 1):
            monkeypatch.setenv(env, str(bad))
            with pytest.raises(ValueError, match=re.escape(f"{env}='{bad}': expected an integer from")):
                config.knobs()
        return
    values = _expected_values(msg)
    assert len(values) >= 2, msg
    for value in values:  # every value the message lists is one the knob takes
        monkeypatch.setenv(env, value)
        config.knobs()


@pytest.mark.parametrize("env, read", [("ODC_FSDP_REGISTERED_MEMORY", "fsdp_registered_devices"),
                                       ("ODC_VERL_BALANCE", "verl_balance"),
                                       ("ODC_VERL_ROLES", "verl_roles")])
def test_process_wide_knob_errors_list_what_they_take(env, read, monkeypatch):
    from torch_odc_backend import config

    monkeypatch.setenv(env, "yes")
    with pytest.raises(ValueError) as e:
        getattr(config, read)()
    msg = str(e.value)
    assert msg.startswith(f"{env}='yes': expected "), msg
    if env == "ODC_VERL_ROLES":  # "'none' or a comma-separated subset of actor, critic, reference"
        assert all(role in msg for role in config.VERL_ROLES) and "none" in msg, msg
        return
    for value in _expected_values(msg):
        monkeypatch.setenv(env, value)
        getattr(config, read)()
