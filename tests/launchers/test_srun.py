import sys

import pytest

from polytrain.errors import LaunchError
from polytrain.launchers import LaunchRequest, SlurmOptions, build_command, emit_sbatch, srun

PY = sys.executable


def req(**kw):
    kw.setdefault("launcher", "srun")
    kw.setdefault("nproc", 8)
    kw.setdefault("nnodes", 2)
    kw.setdefault("program", (PY, "-m", "polytrain.cli", "train", "spec.yaml"))
    return LaunchRequest(**kw)


def test_srun_command():
    assert build_command(req()) == [
        "srun", "--nodes=2", "--ntasks=8", "--ntasks-per-node=4", "--kill-on-bad-exit=1",
        PY, "-m", "polytrain.cli", "train", "spec.yaml",
    ]


def test_srun_with_hosts_gpus_and_extra_args():
    r = req(nnodes=None, hosts=[("g1", 4), ("g2", 4)], slurm=SlurmOptions(gpus_per_node=4), extra_args=("--exclusive",))
    assert build_command(r)[:8] == [
        "srun", "--nodes=2", "--ntasks=8", "--ntasks-per-node=4", "--nodelist=g1,g2",
        "--gpus-per-node=4", "--kill-on-bad-exit=1", "--exclusive",
    ]


def test_srun_env_goes_to_srun_itself():
    assert srun.LAUNCHER.launcher_env(req(env={"A": "1"}, master_port=1234)) == {"MASTER_PORT": "1234", "A": "1"}


def test_uneven_tasks_are_an_error():
    with pytest.raises(LaunchError, match="-np 7 does not divide evenly over 2 nodes"):
        build_command(req(nproc=7))


def test_emit_sbatch():
    script = emit_sbatch(
        req(
            env={"GLOO_SOCKET_IFNAME": "eth0", "NOTE": "a b"},
            slurm=SlurmOptions(job_name="mlp", time="01:30:00", partition="gpu", account="proj42", gpus_per_node=2),
        )
    )
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert lines[1:7] == [
        "#SBATCH --job-name=mlp",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=2",
        "#SBATCH --time=01:30:00",
        "#SBATCH --partition=gpu",
    ]
    assert "#SBATCH --account=proj42" in lines
    assert 'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in lines
    assert "export MASTER_PORT=$((10000 + SLURM_JOB_ID % 20000))" in lines
    assert "export GLOO_SOCKET_IFNAME=eth0" in lines and "export NOTE='a b'" in lines
    assert lines[-1] == (
        f"srun --nodes=2 --ntasks=8 --ntasks-per-node=4 --gpus-per-node=2 --kill-on-bad-exit=1 "
        f"{PY} -m polytrain.cli train spec.yaml"
    )
    assert script.index("set -euo pipefail") < script.index("export MASTER_ADDR") < script.index("srun ")


def test_emit_sbatch_minimal_with_fixed_master():
    script = emit_sbatch(req(nproc=2, nnodes=1, master_addr="n0", master_port=6000))
    assert "#SBATCH --time" not in script and "#SBATCH --partition" not in script
    assert "export MASTER_ADDR=n0\nexport MASTER_PORT=6000\n" in script


def test_emit_sbatch_rejects_spaces():
    with pytest.raises(LaunchError, match="--partition must be one word"):
        emit_sbatch(req(slurm=SlurmOptions(partition="gpu\n#SBATCH --evil")))


def test_emit_sbatch_for_another_launcher_uses_srun():
    r = LaunchRequest(launcher="local", nproc=2, program=(PY, "t.py"), max_restarts=0)
    assert emit_sbatch(r).rstrip().endswith(f"srun --nodes=1 --ntasks=2 --ntasks-per-node=2 --kill-on-bad-exit=1 {PY} t.py")


def test_a_requeued_sbatch_passes_the_schedulers_signals_on_and_resumes(tmp_path):
    """--requeue --signal USR1@90: the directives, the batch shell passing TERM and USR1 on to srun and ending with
    its code, and a spec run with the preemption table (added: the spec has none) that resumes by itself."""
    script = emit_sbatch(req(slurm=SlurmOptions(requeue=True, signal="SIGUSR1@90")))
    lines = script.splitlines()
    assert "#SBATCH --requeue" in lines and "#SBATCH --signal=B:USR1@90" in lines
    assert f"{PY} -m polytrain.cli train spec.yaml --set preemption.requeue=auto --resume auto &" in script
    assert lines[-5:] == [
        "srun_pid=$!",
        "trap 'kill -TERM \"$srun_pid\" 2>/dev/null || true' TERM",
        "trap 'kill -USR1 \"$srun_pid\" 2>/dev/null || true' USR1",
        'while kill -0 "$srun_pid" 2>/dev/null; do wait "$srun_pid" || true; done',
        'wait "$srun_pid"',
    ]
    spec = tmp_path / "spec.yaml"
    spec.write_text("preemption: {requeue: never}\n")  # the spec's own table is left as it is
    program = (PY, "-m", "polytrain.cli", "train", str(spec), "--resume=auto")
    assert srun.preemptible_program(program, True, "USR2") == (
        *program, "--set", "preemption.signals=[SIGTERM,SIGUSR1,SIGUSR2]")
    assert srun.preemptible_program((PY, "loop.py"), True, "USR1") == (PY, "loop.py")  # a script handles its own
    with pytest.raises(LaunchError, match="--requeue with --resume ckpt: the requeued job would start from that"):
        srun.preemptible_program((PY, "-m", "polytrain.cli", "train", "spec.yaml", "--resume", "ckpt"), True, None)
    only_signal = emit_sbatch(req(slurm=SlurmOptions(signal="TERM@30")))
    assert "#SBATCH --requeue" not in only_signal and "--set preemption.requeue=never &" in only_signal


@pytest.mark.parametrize("text", ["KILL@30", "USR1", "USR1@0", "USR1@x", "INT@10"])
def test_a_bad_signal_is_one_line(text):
    with pytest.raises(LaunchError, match=f"--signal must be NAME@SECONDS .*got '{text}'"):
        emit_sbatch(req(slurm=SlurmOptions(signal=text)))
