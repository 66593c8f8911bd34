"""The project's own rules for docker/Dockerfile.{cpu,cuda} and .dockerignore, checked with dockerfile-parse.

No Docker engine runs here, so an image is held to what can be read:
  pinned-base        every FROM is an earlier stage or image:X.Y.Z... (optionally @sha256:...); never
                     untagged, never latest, never a moving tag such as 3.11-slim
  multi-stage        a builder stage, and a final stage that copies the venv /opt/polytrain from it
  builder-toolchain  compilers/cmake/headers/devel bases in the builder only, never in the final stage
  non-root-user      the final stage's last USER is neither root nor 0
  versions           the *_VERSION ARGs equal constraints.txt's pins
  setup-sh           the venv is made by scripts/setup.sh (POLYTRAIN_VENV=/opt/polytrain); no other pip install
  entrypoint         the final stage's ENTRYPOINT (exec form) runs polytrain or docker/entrypoint.sh
  install-cache      no builder COPY before setup.sh sends polytrain's code (polytrain/, adapters/, launchers/,
                     or the whole context), so an edit to it does not reinstall the venv
  dockerignore       .dockerignore keeps .venv, .git and runs/ out of the build context
Each rule is shown to fire by breaking it in a copy of a real Dockerfile.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

dockerfile_parse = pytest.importorskip(
    "dockerfile_parse", reason="dockerfile-parse is not installed: pip install dockerfile-parse==2.0.1")

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = {name: REPO / "docker" / f"Dockerfile.{name}" for name in ("cpu", "cuda")}
VENV = "/opt/polytrain"
# ARG name -> constraints.txt requirement names whose pin it must equal.
VERSION_ARGS = {
    "TORCH_VERSION": ("torch",),
    "TENSORFLOW_VERSION": ("tensorflow", "tensorflow-cpu"),
    "DEEPSPEED_VERSION": ("deepspeed",),
    "HOROVOD_VERSION": ("horovod",),
}
TOOLCHAIN_PACKAGE = re.compile(
    r"^(build-essential|gcc(-\d+)?|g\+\+(-\d+)?|clang(-\d+)?|cmake|make|ninja-build|cuda-nvcc.*|cuda-toolkit.*"
    r"|.*-dev)$")
INSTALL_COMMAND = re.compile(r"\b(apt-get|apt|apk|yum|dnf)\s+(install|add)\b")
PIP_INSTALL = re.compile(r"\b(pip3?|python3?\s+-m\s+pip|uv\s+pip|conda|mamba)\s+install\b")
EXACT_TAG = re.compile(r"\d+\.\d+\.\d+")


@dataclass(frozen=True)
class Violation:
    rule: str
    message: str


@dataclass
class Stage:
    image: str  # the FROM image, ARG defaults substituted
    alias: str | None
    instructions: list[dict]

    def values(self, instruction: str) -> list[str]:
        return [item["value"] for item in self.instructions if item["instruction"] == instruction]


def parse_stages(text: str) -> list[Stage]:
    parser = dockerfile_parse.DockerfileParser(fileobj=io.BytesIO(text.encode()))
    stages: list[Stage] = []
    images = iter(parser.parent_images)
    for item in parser.structure:
        if item["instruction"] == "FROM":
            words = item["value"].split()
            alias = words[2].lower() if len(words) >= 3 and words[1].lower() == "as" else None
            stages.append(Stage(next(images), alias, []))
        elif stages:
            stages[-1].instructions.append(item)
    return stages


def installed_packages(run_value: str) -> list[str]:
    """Package names an apt-get/apk/yum/dnf install in a RUN names (versions stripped)."""
    packages = []
    for command in re.split(r"&&|\|\||;|\|", run_value):
        match = INSTALL_COMMAND.search(command)
        if match:
            words = command[match.end():].split()
            packages += [w.split("=")[0] for w in words if not w.startswith("-")]
    return packages


def constraint_pins(text: str) -> dict[str, set[str]]:
    """Requirement name -> the versions constraints.txt's ``name==version`` lines pin it to."""
    pins: dict[str, set[str]] = {}
    for line in text.splitlines():
        match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s;#]+)", line)
        if match:
            pins.setdefault(match.group(1).lower().replace("_", "-"), set()).add(match.group(2))
    return pins


def check_pinned_bases(stages: list[Stage]) -> list[Violation]:
    problems, aliases = [], set()
    for number, stage in enumerate(stages, 1):
        image = stage.image
        name, _, digest = image.partition("@")
        tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else ""
        if image.lower() in aliases:
            pass
        elif "$" in image:
            problems.append(f"stage {number}: FROM {image} has an ARG without a default")
        elif not tag:
            problems.append(f"stage {number}: FROM {image} has no tag")
        elif tag == "latest":
            problems.append(f"stage {number}: FROM {image} uses latest")
        elif not EXACT_TAG.search(tag):
            problems.append(f"stage {number}: FROM {image}: tag {tag!r} is not an exact X.Y.Z version")
        elif digest and not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            problems.append(f"stage {number}: FROM {image}: malformed digest")
        if stage.alias:
            aliases.add(stage.alias)
    return [Violation("pinned-base", p) for p in problems]


def check_multi_stage(stages: list[Stage]) -> list[Violation]:
    builders = {s.alias for s in stages[:-1] if s.alias}
    if len(stages) < 2 or not builders:
        return [Violation("multi-stage", "needs a named builder stage and a final stage")]
    copies = [c.split() for c in stages[-1].values("COPY")]
    if not any(any(w in {f"--from={b}" for b in builders} for w in c) and VENV in c for c in copies):
        return [Violation("multi-stage", f"the final stage does not COPY --from=<builder> {VENV}")]
    return []


def check_toolchain(stages: list[Stage]) -> list[Violation]:
    problems = []
    final, builders = stages[-1], stages[:-1]
    if final.image.lower() in {s.alias for s in builders} or "devel" in final.image:
        problems.append(f"the final stage starts FROM {final.image}, which carries the build toolchain")
    shipped = sorted({p for run in final.values("RUN") for p in installed_packages(run) if TOOLCHAIN_PACKAGE.match(p)})
    if shipped:
        problems.append(f"the final stage installs build tools: {', '.join(shipped)}")
    has_compiler = any("devel" in s.image for s in builders) or any(
        {"build-essential", "g++"} & set(installed_packages(run)) for s in builders for run in s.values("RUN"))
    if builders and not has_compiler:
        problems.append("no builder stage installs a compiler (build-essential or g++) or uses a devel base")
    return [Violation("builder-toolchain", p) for p in problems]


def check_user(stages: list[Stage]) -> list[Violation]:
    users = stages[-1].values("USER")
    if not users:
        return [Violation("non-root-user", "the final stage sets no USER, so it runs as root")]
    user = users[-1].split(":")[0].strip()
    if user in {"root", "0"}:
        return [Violation("non-root-user", f"the final stage runs as USER {users[-1]}")]
    return []


def check_versions(stages: list[Stage], pins: dict[str, set[str]]) -> list[Violation]:
    problems = []
    declared: dict[str, list[str]] = {}
    for stage in stages:
        for value in stage.values("ARG"):
            name, _, default = value.partition("=")
            declared.setdefault(name.strip(), []).append(default.strip().strip('"'))
    for arg, requirements in VERSION_ARGS.items():
        wanted = set().union(*(pins.get(r, set()) for r in requirements))
        if len(wanted) != 1:
            problems.append(f"constraints.txt pins {'/'.join(requirements)} to {sorted(wanted) or 'nothing'}")
        elif arg not in declared:
            problems.append(f"ARG {arg} is missing (constraints.txt pins {next(iter(wanted))})")
        else:
            for default in declared[arg]:
                if {default} != wanted:
                    problems.append(f"ARG {arg}={default} but constraints.txt pins {next(iter(wanted))}")
    return [Violation("versions", p) for p in problems]


def check_setup_sh(stages: list[Stage]) -> list[Violation]:
    problems = []
    builder_runs = [run for s in stages[:-1] for run in s.values("RUN")]
    if not any(re.search(r"(^|\s)(\./)?scripts/setup\.sh\b", run) for run in builder_runs):
        problems.append("no builder RUN calls scripts/setup.sh")
    venv_set = any(re.search(rf"\bPOLYTRAIN_VENV={re.escape(VENV)}(\s|$)", value)
                   for s in stages[:-1] for value in s.values("ENV") + s.values("RUN"))
    if not venv_set:
        problems.append(f"POLYTRAIN_VENV={VENV} is not set where setup.sh runs")
    for stage in stages:
        for run in stage.values("RUN"):
            if PIP_INSTALL.search(run):
                problems.append(f"installs outside scripts/setup.sh: {PIP_INSTALL.search(run).group(0)}")
    return [Violation("setup-sh", p) for p in problems]


def check_entrypoint(stages: list[Stage]) -> list[Violation]:
    entrypoints = stages[-1].values("ENTRYPOINT")
    try:
        command = json.loads(entrypoints[-1]) if entrypoints else None
    except json.JSONDecodeError:
        command = None
    if not isinstance(command, list) or not command:
        return [Violation("entrypoint", "the final stage needs an exec-form ENTRYPOINT [\"...\"]")]
    program = command[0].rsplit("/", 1)[-1]
    if program == "polytrain":
        return []
    copied_script = any("docker/entrypoint.sh" in c and c.split()[-1].rsplit("/", 1)[-1] == program
                        for c in stages[-1].values("COPY"))
    if program == "polytrain-entrypoint" and copied_script:
        return []
    return [Violation("entrypoint", f"ENTRYPOINT runs {command[0]}, not polytrain or docker/entrypoint.sh")]


SOURCE_TREES = ("polytrain", "adapters", "launchers", ".")


def check_install_cache(stages: list[Stage]) -> list[Violation]:
    problems = []
    for stage in stages[:-1]:
        for item in stage.instructions:
            if item["instruction"] == "RUN" and re.search(r"(^|\s)(\./)?scripts/setup\.sh\b", item["value"]):
                break
            if item["instruction"] != "COPY" or "--from=" in item["value"]:
                continue
            sources = [word for word in item["value"].split()[:-1] if not word.startswith("--")]
            problems += [f"the builder copies {source} before setup.sh" for source in sources
                         if source.rstrip("/") in SOURCE_TREES]
    return [Violation("install-cache", p) for p in problems]


def check_dockerfile(text: str, constraints: str) -> list[Violation]:
    stages = parse_stages(text)
    if not stages:
        return [Violation("multi-stage", "no FROM")]
    return (check_pinned_bases(stages) + check_multi_stage(stages) + check_toolchain(stages) + check_user(stages)
            + check_versions(stages, constraint_pins(constraints)) + check_setup_sh(stages) + check_entrypoint(stages)
            + check_install_cache(stages))


def check_dockerignore(text: str) -> list[Violation]:
    patterns = {line.strip().strip("/") for line in text.splitlines() if line.strip() and not line.startswith("#")}
    missing = [p for p in (".venv", ".git", "runs") if p not in patterns]
    return [Violation("dockerignore", f".dockerignore does not exclude {p}") for p in missing]


# --- the real files ---------------------------------------------------------

CONSTRAINTS = (REPO / "constraints.txt").read_text()


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_real_dockerfile_follows_every_rule(flavour: str) -> None:
    assert check_dockerfile(DOCKERFILES[flavour].read_text(), CONSTRAINTS) == []


def test_real_dockerignore_keeps_local_state_out() -> None:
    assert check_dockerignore((REPO / ".dockerignore").read_text()) == []


def test_version_args_are_the_constraints_pins() -> None:
    """Independent of the checker: the numbers themselves, read two ways."""
    pins = constraint_pins(CONSTRAINTS)
    for path in DOCKERFILES.values():
        args = dict(re.findall(r"^ARG (\w+_VERSION)=(\S+)$", path.read_text(), flags=re.M))
        assert {args["TORCH_VERSION"]} == pins["torch"]
        assert {args["DEEPSPEED_VERSION"]} == pins["deepspeed"]
        assert {args["HOROVOD_VERSION"]} == pins["horovod"]
        assert {args["TENSORFLOW_VERSION"]} == pins.get("tensorflow", set()) | pins["tensorflow-cpu"]


# --- each rule fires when broken --------------------------------------------

BREAKS = [
    # (dockerfile, text to replace, replacement, rule that must fire)
    ("cpu", "python:3.11.13-slim-bookworm", "python:latest", "pinned-base"),
    ("cpu", "python:3.11.13-slim-bookworm", "python", "pinned-base"),
    ("cpu", "python:3.11.13-slim-bookworm", "python:3.11-slim", "pinned-base"),
    ("cuda", "nvidia/cuda:13.0.1-cudnn-devel-ubuntu22.04", "nvidia/cuda:latest", "pinned-base"),
    ("cpu", "COPY --from=builder /opt/polytrain /opt/polytrain\n", "", "multi-stage"),
    ("cpu", "FROM ${PYTHON_IMAGE} AS runtime", "FROM builder AS runtime", "builder-toolchain"),
    ("cpu", "libgomp1 openssh-client", "libgomp1 build-essential openssh-client", "builder-toolchain"),
    ("cuda", "python3 libgomp1", "python3 python3-dev libgomp1", "builder-toolchain"),
    ("cuda", "nvidia/cuda:13.0.1-runtime-ubuntu22.04", "nvidia/cuda:13.0.1-devel-ubuntu22.04", "builder-toolchain"),
    ("cpu", "install -y --no-install-recommends build-essential cmake", "install -y cmake", "builder-toolchain"),
    ("cpu", "USER 1000:1000", "USER root", "non-root-user"),
    ("cuda", "USER 1000:1000", "USER 0:0", "non-root-user"),
    ("cpu", "USER 1000:1000\n", "", "non-root-user"),
    ("cpu", "ARG TORCH_VERSION=2.13.0\n", "ARG TORCH_VERSION=2.12.0\n", "versions"),
    ("cuda", "ARG HOROVOD_VERSION=0.28.1\n", "", "versions"),
    ("cpu", "    scripts/setup.sh \\\n", "    pip install torch tensorflow-cpu \\\n", "setup-sh"),
    ("cuda", "ENV POLYTRAIN_VENV=/opt/polytrain \\\n    POLYTRAIN_CACHE=", "ENV POLYTRAIN_CACHE=", "setup-sh"),
    ("cpu", 'ENTRYPOINT ["polytrain-entrypoint"]', 'ENTRYPOINT ["python"]', "entrypoint"),
    ("cuda", 'ENTRYPOINT ["polytrain-entrypoint"]', "ENTRYPOINT polytrain", "entrypoint"),
    ("cpu", "COPY polytrain/version.py polytrain/", "COPY polytrain/ polytrain/", "install-cache"),
    ("cuda", "COPY scripts/ scripts/", "COPY . ./", "install-cache"),
    ("cpu", "COPY scripts/ scripts/", "COPY scripts/ launchers ./", "install-cache"),
]


@pytest.mark.parametrize(("flavour", "old", "new", "rule"), BREAKS, ids=[f"{b[0]}-{b[3]}-{i}" for i, b in enumerate(BREAKS)])
def test_breaking_a_rule_is_reported(flavour: str, old: str, new: str, rule: str) -> None:
    text = DOCKERFILES[flavour].read_text()
    assert old in text, f"the test no longer matches Dockerfile.{flavour}: {old!r}"
    violations = check_dockerfile(text.replace(old, new), CONSTRAINTS)
    assert {v.rule for v in violations} == {rule}, violations


def test_constraints_drift_is_reported() -> None:
    bumped = CONSTRAINTS.replace("torch==2.13.0", "torch==2.14.0")
    assert bumped != CONSTRAINTS
    violations = check_dockerfile(DOCKERFILES["cpu"].read_text(), bumped)
    assert [v.rule for v in violations] == ["versions", "versions"]  # the ARG in both stages
    assert "constraints.txt pins 2.14.0" in violations[0].message


def test_constraints_pinning_one_package_twice_differently_is_reported() -> None:
    violations = check_dockerfile(DOCKERFILES["cuda"].read_text(), CONSTRAINTS + "torch==2.14.0\n")
    assert [v.message for v in violations] == ["constraints.txt pins torch to ['2.13.0', '2.14.0']"]


def test_a_dockerfile_breaking_everything_reports_every_rule() -> None:
    bad = "FROM python:latest\nRUN pip install torch==2.0.0 && apt-get install -y gcc\nCMD [\"python\"]\n"
    rules = {v.rule for v in check_dockerfile(bad, CONSTRAINTS)}
    assert rules == {"pinned-base", "multi-stage", "builder-toolchain", "non-root-user", "versions", "setup-sh",
                     "entrypoint"}


def test_dockerignore_without_venv_is_reported() -> None:
    text = (REPO / ".dockerignore").read_text().replace(".venv/\n", "")
    assert check_dockerignore(text) == [Violation("dockerignore", ".dockerignore does not exclude .venv")]


def test_digest_pins_are_accepted_and_checked() -> None:
    text = DOCKERFILES["cpu"].read_text()
    pinned = text.replace("python:3.11.13-slim-bookworm", "python:3.11.13-slim-bookworm@sha256:" + "ab" * 32)
    assert check_dockerfile(pinned, CONSTRAINTS) == []
    broken = text.replace("python:3.11.13-slim-bookworm", "python:3.11.13-slim-bookworm@sha256:123")
    assert {v.rule for v in check_dockerfile(broken, CONSTRAINTS)} == {"pinned-base"}
