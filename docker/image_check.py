"""Build a polytrain image with podman and run the jobs a team runs in it (issue 34). Standard library only:
it runs on the host's python3, before any venv exists.

    python3 docker/image_check.py                 # base image, Dockerfile.cpu, then every check in a container
    python3 docker/image_check.py --only info,torchrun
    python3 docker/image_check.py --variant cuda  # Dockerfile.cuda on the same base, toolkit from PyPI, on the CPU

Where no registry is reachable the base comes from Debian's packages: `mmdebstrap` writes a minimal bookworm
with Python 3.11 (cached as a tar under the cache directory) and `podman import` makes it an image, passed to the
Dockerfile as PYTHON_IMAGE. The build sees the host's pip configuration (index, find-links, CA bundle, constraints;
written to a private file, the local directories it names mounted read-only), and the Horovod wheel scripts/setup.sh
built on this host seeds the build's cache mount. Every container runs with no network but its own loopback, as
uid 1000, under a label this run alone uses; all of them are removed at the end, also after a failure or Ctrl-C.
Exit status: 0 when every check passed, 1 when one failed, 2 when podman or mmdebstrap cannot run here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("POLYTRAIN_CACHE", Path.home() / ".cache" / "polytrain"))
BASE_TAG = "localhost/polytrain-base:bookworm"
LIMITS = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768"]  # at or below the host's
DEBIAN_PACKAGES = "python3,python3-venv,python3-pip,python3-dev,ca-certificates"
FLOOR = 0.9  # digits reaches ~0.97 in 15 epochs on any layout; a broken image trains to ~0.1 or not at all


class CheckFailed(Exception):
    """One check's one-line reason."""


class Podman:
    """podman as root with runc and its own storage under the cache directory (cached layers survive runs)."""

    def __init__(self, cache: Path) -> None:
        self.store = cache / "podman"
        self.tmp = self.store / "tmp"  # buildah keeps RUN cache mounts under $TMPDIR/buildah-cache
        self.label = f"polytrain-image-check={os.getpid()}"
        self.prefix = ["podman", "--root", str(self.store / "storage"), "--runroot", "/run/polytrain-podman",
                       "--runtime", "runc"]

    def __call__(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([*self.prefix, *args], text=True, timeout=timeout, start_new_session=True,
                              env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if check and proc.returncode != 0:
            tail = (proc.stdout or "").strip().splitlines()[-15:]
            raise CheckFailed(f"podman {' '.join(args[:2])} exited {proc.returncode}\n" + "\n".join(tail))
        return proc

    def env(self) -> dict[str, str]:
        self.tmp.mkdir(parents=True, exist_ok=True)
        return {**os.environ, "TMPDIR": str(self.tmp)}

    def popen(self, *args: str, **kwargs: object) -> subprocess.Popen[str]:
        """podman in the background, in a session of its own (so that its whole group can be stopped)."""
        return subprocess.Popen([*self.prefix, *args], text=True, env=self.env(), start_new_session=True,
                                **kwargs)  # type: ignore[call-overload]

    def container_options(self) -> list[str]:
        """What every container of the check gets: this run's label, shared memory for MPI, the limits."""
        return ["--label", self.label, "--shm-size", "1g", *LIMITS]

    def clean(self) -> None:
        """Every container and network this run made (by its label)."""
        ids = self("ps", "-aq", "--filter", f"label={self.label}", check=False).stdout.split()
        if ids:
            self("rm", "-f", "-t", "0", *ids, check=False)
        nets = self("network", "ls", "-q", "--filter", f"label={self.label}", check=False).stdout.split()
        if nets:
            self("network", "rm", "-f", *nets, check=False)


def usable() -> str | None:
    """Why the check cannot run here, or None."""
    for tool in ("podman", "mmdebstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: apt-get install podman mmdebstrap runc)"
    if os.geteuid() != 0:
        return "podman runs here as root only (rootless podman needs subordinate uids this machine lacks)"
    probe = subprocess.run([*Podman(CACHE).prefix, "info"], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return "podman info failed: " + (probe.stderr.strip().splitlines() or ["?"])[-1]
    return None


def debian_mirror() -> str:
    """The Debian mirror apt uses here (a deb822 URIs: line or a one-line `deb URL bookworm ...`)."""
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        text = path.read_text() if path.is_file() else ""
        found = re.search(r"^URIs:\s*(\S+/debian)/?\s*$", text, re.M) or \
            re.search(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+/debian)/?\s+bookworm\b", text, re.M)
        if found:
            return found.group(1)
    return "http://deb.debian.org/debian"


def base_image(podman: Podman, cache: Path) -> str:
    """The Debian bookworm base with Python 3.11, made once: tar cached, image imported if missing."""
    tar = cache / "images" / "debian-bookworm-python3.tar"
    if tar.is_dir():  # a folder an earlier version left here (mmdebstrap wrote one for a name without .tar)
        shutil.rmtree(tar)
    if not tar.is_file():
        tar.parent.mkdir(parents=True, exist_ok=True)
        part = tar.with_name(f"part-{os.getpid()}-{tar.name}")
        subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", "--format=tar",
                        f"--include={DEBIAN_PACKAGES}", "bookworm", str(part), debian_mirror()], check=True, timeout=900)
        part.rename(tar)  # an interrupted run never leaves a tar that looks finished
    if podman("image", "exists", BASE_TAG, check=False).returncode != 0:
        podman("import", "--quiet", str(tar), BASE_TAG)
    return BASE_TAG


def pip_settings(private: Path, leave_out: Sequence[str] = ()) -> tuple[list[str], str | None]:
    """podman build volumes that give the build the host's pip configuration (less the ``leave_out`` keys), and the
    host's extra index URLs (for the Dockerfile's TORCH_INDEX_URL, which replaces PIP_EXTRA_INDEX_URL)."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    settings: dict[str, str] = {}
    for line in listed.splitlines():
        found = re.match(r"^(?::env:|global|install)\.([\w-]+)='(.*)'$", line)
        if found and found.group(1) not in leave_out:
            settings[found.group(1)] = found.group(2)
    conf = private / "pip.conf"
    conf.write_text("[global]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
    conf.chmod(0o600)  # an index URL may carry credentials
    volumes = ["-v", f"{conf}:/etc/pip.conf:ro"]
    paths = set()
    for value in settings.values():
        for token in value.split():
            path = token.removeprefix("file://")
            if path.startswith("/") and os.path.exists(path):
                paths.add(str(Path(path).parent) if path.rstrip("/").endswith("/simple") else path)
    for path in sorted(paths):
        volumes += ["-v", f"{path}:{path}:ro"]
    return volumes, settings.get("extra-index-url")


def index_arg(index: str | None) -> list[str]:
    """The build arg that hands the host's extra index to the Dockerfile (TORCH_INDEX_URL). An index URL with
    credentials (user:password@host) is never passed: build args are on podman's command line and in the image's
    history. Then TORCH_INDEX_URL is empty and pip finds torch through the mounted configuration alone."""
    if index is None:
        return []
    if re.search(r"://[^/\s]*@", index):
        return ["--build-arg", "TORCH_INDEX_URL="]
    return ["--build-arg", f"TORCH_INDEX_URL={index}"]


def seed_horovod(podman: Podman, cache: Path) -> list[str]:
    """Put the host's Horovod wheels into the build's cache mount (/var/cache/polytrain): the build then
    installs one instead of compiling Horovod for 15-35 minutes."""
    wheels = sorted((cache / "wheels").glob("horovod-*.whl"))
    target = podman.tmp / "buildah-cache" / "var" / "cache" / "polytrain" / "wheels"
    target.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        if not (target / wheel.name).exists():
            shutil.copy2(wheel, target / f".{wheel.name}.part")
            (target / f".{wheel.name}.part").rename(target / wheel.name)
    return [w.name for w in wheels]


def cuda_args(base: str, archs: str) -> list[str]:
    """Dockerfile.cuda's build args for the local Debian base: no NVIDIA image, the toolkit from PyPI, and the GPU
    generations ``archs`` (``8.0,9.0``) alone, which keeps nvcc's share of the build short."""
    if not re.fullmatch(r"\d+\.\d+(,\d+\.\d+)*", archs):
        raise CheckFailed(f"--cuda-archs: expected compute capabilities like 8.0,9.0, got {archs!r}")
    values = {"CUDA_BUILDER_IMAGE": base, "CUDA_RUNTIME_IMAGE": base, "CUDA_TOOLKIT": "pypi",
              "HOROVOD_CUDA_CC_LIST": archs.replace(".", ""), "TORCH_CUDA_ARCH_LIST": archs.replace(",", ";")}
    return [a for key, value in values.items() for a in ("--build-arg", f"{key}={value}")]


def build(podman: Podman, dockerfile: str, tag: str, base_args: Sequence[str], log: Path,
          variant: str = "cpu") -> float:
    with tempfile.TemporaryDirectory(prefix="polytrain-image-") as private:
        # the CUDA image takes torch's CUDA build from the index: not a CPU wheel a find-links folder holds
        volumes, index = pip_settings(Path(private), leave_out=("find-links",) if variant == "cuda" else ())
        args = [*base_args, *(index_arg(index) if variant == "cpu" else [])]
        started = time.perf_counter()
        with log.open("w") as out:
            proc = podman.popen("build", "--format", "docker", "--layers", *LIMITS, *volumes, *args,
                                "-f", dockerfile, "-t", tag, ".", cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
            try:
                code = proc.wait(timeout=7200)  # the CUDA image compiles Horovod and DeepSpeed's ops with nvcc
            finally:
                stop_build(podman, proc)
        if code != 0:
            tail = log.read_text().strip().splitlines()[-12:]
            raise CheckFailed(f"building {dockerfile} failed (exit {code}; whole log: {log})\n" + "\n".join(tail))
        # unnamed layers over three days old: earlier builds' stages. Not younger ones: a builder stage reused
        # from the cache keeps its creation time and is unnamed too, and it is the next build's cache.
        podman("image", "prune", "-f", "--filter", "until=72h", check=False)
        return time.perf_counter() - started


def stop_build(podman: Podman, proc: subprocess.Popen[str]) -> None:
    """A build cut short (Ctrl-C, SIGTERM, timeout): its whole process group stopped, and the working
    containers it left in the check's storage removed."""
    if proc.poll() is None:
        for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 20)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=grace)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
    sweep_builds(podman)


def sweep_builds(podman: Podman) -> None:
    """Remove the working containers of builds in the check's storage (one killed with SIGKILL leaves them)."""
    left = podman("ps", "-aq", "--external", check=False).stdout.split()
    if left:
        podman("rm", "-f", *left, check=False)


# ---------------------------------------------------------------------------------------------- the checks
class Runner:
    """Runs commands in containers of ``image`` (no network but loopback, uid 1000) with ``runs`` mounted at
    /workspace/runs, where the jobs write."""

    def __init__(self, podman: Podman, image: str, runs: Path, variant: str = "cpu") -> None:
        self.podman, self.image, self.runs, self.count = podman, image, runs, 0
        self.variant = variant

    def __call__(self, *argv: str, timeout: float = 600) -> str:
        self.count += 1
        proc = self.podman("run", "--rm", "--name", f"polytrain-check-{os.getpid()}-{self.count}",
                           "--network", "none", *self.podman.container_options(),
                           "-e", "MASTER_ADDR=127.0.0.1", "-e", "GLOO_SOCKET_IFNAME=lo",
                           "-v", f"{self.runs}:/workspace/runs", self.image, *argv, timeout=timeout, check=False)
        if proc.returncode != 0:
            tail = "\n".join(proc.stdout.strip().splitlines()[-12:])
            raise CheckFailed(f"`{' '.join(argv)}` exited {proc.returncode} in the container:\n{tail}")
        return proc.stdout

    def model(self, name: str) -> dict:
        return json.loads((self.runs / name / "model.json").read_text())


def trained(run: Runner, name: str, launcher: str, framework: str, backend: str, auto: bool = True) -> str:
    """The digits spec on 2 processes under ``launcher``: it must have run on ``backend`` (what `backend: auto`
    picks there, or set) and reach the floor."""
    run("launch", "--launcher", launcher, "-np", "2", "examples/digits.yaml", "--quiet",
        "--set", f"output=runs/{name}", "--set", f"framework={framework}",
        *([] if auto else ["--set", f"backend={backend}"]))
    model = run.model(name)
    got = (model["framework"], model["backend"], model["world_size"])
    if got != (framework, backend, 2):
        raise CheckFailed(f"ran as {got}, expected {(framework, backend, 2)}")
    if not model["val_accuracy"] >= FLOOR:
        raise CheckFailed(f"validation accuracy {model['val_accuracy']:.4f} < {FLOOR}")
    return f"{framework}/{backend} x2: val accuracy {model['val_accuracy']:.4f}"


def check_info(run: Runner) -> str:
    out = run("info")
    wanted = ["[X] PyTorch, [X] TensorFlow", "built with [X] mpi, [X] gloo", "Open MPI v5"]
    if run.variant == "cuda":  # torch's CUDA build and Horovod's NCCL ops, on a host without a GPU
        wanted += ["[X] nccl", "[X] cuda", "cuda / nccl  no GPU"]
        if re.search(r"^\s*torch\s+\S+\+cpu", out, re.M):
            raise CheckFailed(f"the CUDA image has torch's CPU build:\n{out}")
    missing = [w for w in wanted if w not in out]
    if missing:
        raise CheckFailed(f"`polytrain info` lacks {missing}:\n{out}")
    if run.variant == "cuda":
        return "torch (CUDA build), TensorFlow, DeepSpeed, Horovod (PyTorch, TensorFlow; mpi, gloo, nccl, cuda); no GPU"
    return "torch, TensorFlow, DeepSpeed, Horovod (PyTorch, TensorFlow; mpi, gloo), Open MPI 5"


def check_shim(run: Runner) -> str:
    out = run("torchrun", "--nproc_per_node=2", "examples/horovod/pytorch_digits.py")
    found = re.search(r"final val accuracy ([0-9.]+) on 2 workers", out)
    if not found or float(found.group(1)) < FLOOR:
        raise CheckFailed("the Horovod digits script through the shim: " + (found.group(0) if found else out[-400:]))
    return f"examples/horovod/pytorch_digits.py under torchrun: {found.group(0)}"


def check_mixed(run: Runner) -> str:
    """One image, both frameworks: a torch run's model converted to Keras weights and evaluated by TensorFlow
    on the same held-out samples must score exactly what the torch run scored."""
    run("train", "examples/digits.yaml", "--quiet", "--set", "output=runs/mixed", "--set", "framework=torch")
    run("checkpoint", "convert", "runs/mixed", "--to", "keras", "-o", "runs/mixed.weights.h5")
    out = run("python", "/opt/polytrain-src/docker/tf_evaluate.py", "runs/mixed", "runs/mixed.weights.h5")
    scores = json.loads(out.strip().splitlines()[-1])
    if abs(scores["tensorflow_accuracy"] - scores["torch_accuracy"]) > 1e-9 or scores["torch_accuracy"] < FLOOR:
        raise CheckFailed(f"torch model in TensorFlow: {scores}")
    return f"torch-trained, evaluated in TensorFlow: {scores['tensorflow_accuracy']:.4f} (torch: equal)"


def checks() -> dict[str, Callable[[Runner], str]]:
    return {
        "info": check_info,
        "torchrun": lambda run: trained(run, "torchrun", "torchrun", "torch", "ddp"),
        "horovodrun": lambda run: trained(run, "horovodrun", "horovodrun", "torch", "horovod", auto=False),
        "tensorflow": lambda run: trained(run, "tensorflow", "mpirun", "tensorflow", "mpi"),
        "tf-horovod": lambda run: trained(run, "tf-horovod", "horovodrun", "tensorflow", "horovod", auto=False),
        "shim": check_shim,
        "mixed": check_mixed,
        "multi-host": lambda run: __import__("image_cluster").check_multi_host(run),
    }


def image_size(podman: Podman, tag: str) -> int:
    return int(json.loads(podman("image", "inspect", tag).stdout)[0]["Size"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma list of checks (default: all): " + ",".join(checks()))
    parser.add_argument("--no-build", action="store_true", help="check the image already built")
    parser.add_argument("--results", help="also write the results as JSON to this file")
    parser.add_argument("--variant", choices=("cpu", "cuda"), default="cpu",
                        help="which image: Dockerfile.cpu, or Dockerfile.cuda built on the local Debian base with "
                             "NVIDIA's toolkit wheels and run on the CPU (default: %(default)s)")
    parser.add_argument("--cuda-archs", default="9.0",
                        help="with --variant cuda: the GPU generations to compile for, e.g. 8.0,9.0 (default: "
                             "%(default)s; the Dockerfile's own default is every one CUDA 13 supports)")
    args = parser.parse_args(argv)
    table = checks()
    only = args.only.split(",") if args.only else list(table)
    unknown = [name for name in only if name not in table]
    if unknown:
        parser.error(f"--only: unknown check(s) {', '.join(unknown)} (allowed: {', '.join(table)})")
    why = usable()
    if why:
        print(f"image_check: cannot run here: {why}", file=sys.stderr)
        return 2
    podman = Podman(CACHE)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` cleans up when killed
    variant = args.variant
    tag = f"localhost/polytrain:{variant}"
    results: dict[str, object] = {"image": tag}
    failed = 0
    with tempfile.TemporaryDirectory(prefix="polytrain-image-runs-") as runs:
        os.chown(runs, 1000, 1000)  # the image's user
        try:
            if not args.no_build:
                sweep_builds(podman)  # what an earlier check killed mid-build left
                base = base_image(podman, CACHE)
                seeded = seed_horovod(podman, CACHE) if variant == "cpu" else []  # the CUDA image's is NCCL's
                base_args = cuda_args(base, args.cuda_archs) if variant == "cuda" else \
                    ["--build-arg", f"PYTHON_IMAGE={base}"]
                log = CACHE / "logs" / f"image-{variant}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                results["build_s"] = round(build(podman, f"docker/Dockerfile.{variant}", tag, base_args, log,
                                                 variant), 1)
                print(f"build        {results['build_s']} s (Horovod wheels seeded: {', '.join(seeded) or 'none'})")
            results["size_bytes"] = size = image_size(podman, tag)
            print(f"image size   {size / 1e9:.2f} GB  {tag}")
            run = Runner(podman, tag, Path(runs), variant)
            for name in only:
                try:
                    line = table[name](run)
                except (CheckFailed, subprocess.SubprocessError, OSError, ValueError, KeyError) as exc:
                    failed += 1  # a missing model.json, a timeout, output that is not what a check reads
                    exc = exc if isinstance(exc, CheckFailed) else f"{type(exc).__name__}: {exc}"
                    results[name] = {"ok": False, "why": str(exc)}
                    print(f"FAIL {name:<10} {exc}")
                else:
                    results[name] = {"ok": True, "what": line}
                    print(f"ok   {name:<10} {line}")
        except (CheckFailed, subprocess.SubprocessError, OSError) as exc:  # the base, the build, the inspect
            failed += 1
            results["build"] = {"ok": False, "why": str(exc)}
            print(f"FAIL build      {exc}")
        finally:
            podman.clean()
            subprocess.run(["chown", "-R", f"{os.getuid()}:{os.getgid()}", runs], check=False)
    if args.results:
        Path(args.results).write_text(json.dumps(results, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":  # as the module image_cluster imports, so that both raise one CheckFailed
    import image_check

    sys.exit(image_check.main())
