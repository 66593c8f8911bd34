"""Check that an environment built by scripts/setup.sh holds what an image promises.

Run by the Dockerfiles' builder stage right after setup.sh, with the Dockerfile's
version ARGs, so an image whose contents drifted from its labels fails to build:

    python docker/verify_image.py --expect torch==2.13.0 --expect horovod==0.28.1 \\
        --torch-cuda none --horovod-build PyTorch,TensorFlow,MPI,Gloo \\
        --deepspeed-ops deepspeed_shm_comm

Every failed check prints one line naming what was expected and what was found;
exit status 1 if any failed, 0 otherwise. Uses only the standard library and
subprocesses, and imports neither framework, so it also runs in a bare venv.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata as metadata
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

TORCH_CUDA_PROBE = "import torch; print(torch.version.cuda or 'none')"


def public_version(version: str) -> str:
    """``2.13.0+cpu`` -> ``2.13.0``: local labels name the build, not the release."""
    return version.split("+", 1)[0]


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_expected_versions(expected: list[str]) -> list[str]:
    problems = []
    for item in expected:
        name, sep, want = item.partition("==")
        if not sep or not name or not want:
            problems.append(f"--expect {item!r}: use NAME==VERSION")
            continue
        found = installed_version(name)
        if found is None:
            problems.append(f"{name}: expected {want}, not installed")
        elif public_version(found) != want:
            problems.append(f"{name}: expected {want}, found {found}")
    return problems


def check_forbidden(names: list[str]) -> list[str]:
    return [f"{name}: must not be installed, found {installed_version(name)}" for name in names
            if installed_version(name) is not None]


def check_torch_cuda(want: str) -> list[str]:
    """``want`` is ``none`` (a CPU build) or a CUDA major version such as ``13``."""
    result = subprocess.run([sys.executable, "-c", TORCH_CUDA_PROBE], capture_output=True, text=True,
                            timeout=300)
    if result.returncode != 0:
        return [f"torch: import failed: {last_line(result.stderr)}"]
    found = result.stdout.strip().splitlines()[-1]
    if want == "none":
        return [] if found == "none" else [f"torch: expected a CPU build, found a CUDA {found} build"]
    if found == "none" or found.split(".")[0] != want:
        return [f"torch: expected a CUDA {want}.x build, found CUDA {found}"]
    return []


def horovod_build_items(report: str) -> set[str]:
    """The items ``horovodrun --check-build`` marks ``[X]`` (frameworks, controllers, tensor ops)."""
    return {match.group(1).strip() for match in re.finditer(r"\[X\]\s*(.+)", report)}


def check_horovod_build(wanted: list[str]) -> list[str]:
    horovodrun = Path(sys.executable).parent / "horovodrun"
    if not horovodrun.exists():
        return [f"horovod: {horovodrun} not found"]
    env = dict(os.environ, PATH=f"{horovodrun.parent}{os.pathsep}{os.environ.get('PATH', '')}",
               TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([str(horovodrun), "--check-build"], capture_output=True, text=True, env=env,
                            timeout=300)
    if result.returncode != 0:
        return [f"horovod: horovodrun --check-build failed: {last_line(result.stderr)}"]
    built = horovod_build_items(result.stdout)
    missing = [item for item in wanted if item not in built]
    if missing:
        return [f"horovod: built without {', '.join(missing)} (has: {', '.join(sorted(built)) or 'nothing'})"]
    return []


def deepspeed_installed_ops() -> dict[str, bool] | None:
    """DeepSpeed's record of its ahead-of-time ops, read without importing deepspeed (and torch)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return None
    record = Path(next(iter(spec.submodule_search_locations)), "git_version_info_installed.py")
    if not record.is_file():
        return None
    for node in ast.parse(record.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "installed_ops" for t in node.targets):
            return {name: bool(built) for name, built in ast.literal_eval(node.value).items()}
    return None


def check_deepspeed_ops(wanted: list[str]) -> list[str]:
    ops = deepspeed_installed_ops()
    if ops is None:
        return ["deepspeed: not installed, or installed without a record of its ops"]
    missing = [op for op in wanted if not ops.get(op)]
    if missing:
        return [f"deepspeed: ops not compiled ahead of time: {', '.join(missing)} "
                "(they would need a compiler at run time)"]
    return []


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def comma_list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--expect", action="append", default=[], metavar="NAME==VERSION",
                        help="an installed distribution and its release (local +labels ignored); repeatable")
    parser.add_argument("--forbid", action="append", default=[], metavar="NAME",
                        help="a distribution that must not be installed; repeatable")
    parser.add_argument("--torch-cuda", metavar="none|MAJOR", help="torch must be a CPU build or this CUDA major")
    parser.add_argument("--horovod-build", type=comma_list, default=[], metavar="ITEM,...",
                        help="items horovodrun --check-build must mark, e.g. PyTorch,TensorFlow,MPI,Gloo,NCCL")
    parser.add_argument("--deepspeed-ops", type=comma_list, default=[], metavar="OP,...",
                        help="DeepSpeed ops that must be compiled ahead of time, e.g. deepspeed_shm_comm")
    args = parser.parse_args(argv)

    problems = check_expected_versions(args.expect) + check_forbidden(args.forbid)
    if args.torch_cuda:
        problems += check_torch_cuda(args.torch_cuda)
    if args.horovod_build:
        problems += check_horovod_build(args.horovod_build)
    if args.deepspeed_ops:
        problems += check_deepspeed_ops(args.deepspeed_ops)
    for problem in problems:
        print(f"verify_image: {problem}", file=sys.stderr)
    if not problems:
        print("verify_image: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
