"""Static checks of the Dockerfile, .dockerignore and compose file (test_image.py builds and runs the image).

Not verified anywhere here: that the CUDA base tag exists in NVIDIA's registry (registries are
out of reach; the image is built on a local Debian base instead), and that the GPU reservation
reaches a GPU.
"""

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import torch
import yaml
from helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
COMPOSE_TEXT = (ROOT / "docker" / "compose.yaml").read_text()
COMPOSE = yaml.safe_load(COMPOSE_TEXT)
#: The sources the build stage copies (the package's folders and its build files).
SOURCES = ("setup.py", "cli", "core", "models", "service")
# The Compose Specification's JSON schema, as kept up to date and shipped by check-jsonschema
# (its builtin "vendor.compose-spec"): offline, and what `docker compose config` enforces.
SCHEMA = json.loads((resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text())


def instructions(name: str) -> list[str]:
    """Arguments of every Dockerfile instruction ``name`` (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return [line.split(None, 1)[1] for line in text.splitlines() if line.split(None, 1)[:1] == [name]]


def exec_form(argument: str) -> list[str]:
    return json.loads(argument) if argument.lstrip().startswith("[") else shlex.split(argument)


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    import subprocess

    result = subprocess.run(
        [hadolint, "--config", str(ROOT / ".hadolint.yaml"), str(ROOT / "Dockerfile")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_cuda_base_matches_the_torch_wheels_and_adds_no_second_copy_of_their_libraries():
    """The -base- tag: the torch wheels bring cuBLAS, cuDNN and the rest; -runtime- would add them again."""
    (default,) = [a.split("=", 1)[1] for a in instructions("ARG") if a.startswith("CUDA_IMAGE=")]
    match = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-base-ubuntu\d+\.\d+", default)
    assert match, default
    assert f"{match[1]}.{match[2]}" == torch.version.cuda
    # the dependencies, the package built on them, the image: the first and last on the same base
    assert instructions("FROM") == ["${CUDA_IMAGE} AS deps", "deps AS build", "${CUDA_IMAGE}"]


def test_the_dependencies_are_installed_before_any_source_is_copied():
    """A change to the code rebuilds from the sources' COPY on: the ~6 GB layer of the dependencies before it is
    reused (tests/docker_image.py keeps it between runs)."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    steps = [line.split(None, 1) for line in text.splitlines() if line.strip() and not line.startswith("#")]
    install = next(i for i, (op, rest) in enumerate(steps) if op == "RUN" and "-r requirements.txt" in rest)
    sources = [i for i, (op, rest) in enumerate(steps) if op == "COPY" and rest.split()[0] in SOURCES]
    assert sources and install < min(sources)
    # the dependencies' layer is made from the project's metadata and its pins, nothing of the code
    assert [rest for op, rest in steps[:install] if op == "COPY"] == [
        "docker/extra-ca/ /usr/local/share/ca-certificates/extra/",
        "constraints.txt pyproject.toml ./",
        "docker/requirements.py ./docker/",
    ]


def test_the_requirements_are_the_projects_dependencies_and_the_extras_asked_for():
    sys.path.insert(0, str(ROOT / "docker"))
    try:
        from requirements import requirements
    finally:
        sys.path.remove(str(ROOT / "docker"))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = requirements(ROOT / "pyproject.toml", ["onnxruntime", "lines"])
    extras = project["optional-dependencies"]
    assert listed == list(dict.fromkeys(project["dependencies"] + extras["onnxruntime"] + extras["lines"]))
    assert "pytest>=8" not in listed  # an extra not asked for
    with pytest.raises(SystemExit, match="no extra nope"):
        requirements(ROOT / "pyproject.toml", ["nope"])


def test_runtime_stage_is_non_root_and_serves_models_from_a_mount():
    assert instructions("USER") == ["10001:10001"]
    assert instructions("EXPOSE") == ["8000"]
    env = " ".join(instructions("ENV"))
    assert "PADIM_HOST=0.0.0.0" in env
    # a flag, not the environment: `serve --repository /models/repo` in its place serves a repository
    # (PADIM_MODEL_DIR in the image's environment would conflict with PADIM_REPOSITORY)
    assert "PADIM_MODEL_DIR" not in env
    assert exec_form(instructions("ENTRYPOINT")[0]) == ["padim"]
    assert exec_form(instructions("CMD")[0]) == ["serve", "--model-dir", "/models"]


def test_copied_sources_exist():
    for copy in instructions("COPY"):
        if copy.startswith("--from"):
            continue
        for source in copy.split()[:-1]:
            assert (ROOT / source).exists(), source


def padim_commands() -> list[list[str]]:
    """Every padim command line the Dockerfile and the compose file run."""
    commands = [exec_form(instructions("ENTRYPOINT")[0]) + exec_form(instructions("CMD")[0])]
    for run in instructions("RUN"):
        commands += [
            shlex.split(part.strip().removeprefix("then "))[:2]
            for part in re.split(r"&&|;", run)
            if re.match(r"\s*(then\s+)?padim\b", part)
        ]
    health = instructions("HEALTHCHECK")[0]
    commands.append(exec_form(health.split(" CMD ", 1)[1]))
    service = COMPOSE["services"]["padim"]
    commands.append(["padim", *service["command"]])
    commands.append(service["healthcheck"]["test"][1:])
    return commands


def test_every_padim_command_they_run_exists():
    commands = padim_commands()
    assert ["padim", "fetch-weights"] in [c[:2] for c in commands]
    assert ["padim", "health"] in [c[:2] for c in commands]
    for command in commands:
        assert command[0] == "padim", command
        result = run_cli(command[1], "--help", check=False)
        assert result.returncode == 0, (command, result.stderr)


def test_healthcheck_command_against_a_real_server(server):
    port = server.url.rsplit(":", 1)[1]
    assert run_cli("health", check=False, env={"PADIM_PORT": port}).returncode == 0
    down = run_cli("health", check=False, env={"PADIM_PORT": "1"})
    assert down.returncode == 1 and "refused" in down.stderr.lower()


def test_fetch_weights_offline_says_what_to_do(tmp_path):
    env = {"TORCH_HOME": str(tmp_path), "https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"}
    result = run_cli("fetch-weights", "resnet18", check=False, env=env)
    assert result.returncode == 1 and "hub/checkpoints/resnet18-f37072fd.pth" in result.stderr
    assert "unknown backbone" in run_cli("fetch-weights", "vgg99", check=False).stderr


def validate(document: dict) -> None:
    jsonschema.validators.validator_for(SCHEMA)(SCHEMA).validate(document)


def test_compose_file_follows_the_compose_spec():
    validate(COMPOSE)
    service = COMPOSE["services"]["padim"]
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "../models:/models:ro" in service["volumes"]
    assert service["env_file"] == ["padim.env"] and (ROOT / "docker" / "padim.env.example").exists()
    assert service["restart"] == "unless-stopped"
    assert service["environment"]["PADIM_MODEL_DIR"] == "/models"
    assert (
        service["build"]["context"] == ".." and (ROOT / "docker" / service["build"]["context"] / "Dockerfile").exists()
    )
    # the optional Prometheus loads the chart's rules file, the one promtool's tests check: no copy
    prometheus = COMPOSE["services"]["prometheus"]
    mounted = {v.split(":")[0]: v.split(":")[1] for v in prometheus["volumes"]}
    assert (ROOT / "docker" / "../charts/padim/files/padim-alerts.yml").resolve().is_file()
    assert mounted["../charts/padim/files/padim-alerts.yml"] == "/etc/prometheus/padim-alerts.yml"
    config = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["padim-alerts.yml"]
    assert mounted["./prometheus.yml"] == "/etc/prometheus/prometheus.yml"


def test_commented_cpu_variant_is_valid_too():
    block = re.search(r"^  # padim-cpu:\n((?:^  #.*\n)+)", COMPOSE_TEXT, re.M)
    assert block, "the CPU-only variant should be there, commented out"
    lines = ["  padim-cpu:"] + [line.replace("  # ", "  ", 1) for line in block[1].splitlines()]
    variant = yaml.safe_load("services:\n" + "\n".join(lines))
    validate(variant)
    cpu = variant["services"]["padim-cpu"]
    assert "deploy" not in cpu and cpu["environment"]["PADIM_DEVICE"] == "cpu"


def test_a_broken_compose_file_is_caught():
    broken = json.loads(json.dumps(COMPOSE))
    broken["services"]["padim"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] = "gpu"
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


def test_dockerignore_keeps_data_out_and_every_copied_source_in():
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(path: str) -> bool:  # Docker matches each pattern against the path and its parents
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        return any(
            fnmatch.fnmatch(prefix, pattern.removeprefix("**/"))
            or fnmatch.fnmatch(parts[-1], pattern.removeprefix("**/"))
            for pattern in patterns
            for prefix in prefixes
        )

    for path in ("data/good/000.png", "line3.padim", ".venv/bin/python", ".git/HEAD", "tests/conftest.py"):
        assert ignored(path), path
    copied = [source for copy in instructions("COPY") if not copy.startswith("--from") for source in copy.split()[:-1]]
    for source in copied:
        for path in [p for p in (ROOT / source).rglob("*.py")] if (ROOT / source).is_dir() else [ROOT / source]:
            assert not ignored(path.relative_to(ROOT).as_posix()), path  # e.g. "models" once hid models/


@pytest.mark.parametrize("client", [True, False], ids=["docker-client-alone", "no-docker"])
def test_test_base_installs_the_engine_when_dockerd_is_missing(tmp_path, client):
    """``docker/test-base.sh`` installs Debian's docker.io when there is no ``dockerd``, even with a
    ``docker`` client on PATH (CI machines with the client alone failed with 'dockerd did not start').

    Run on a PATH of its own: the shell tools it uses, a fake ``apt-get`` that records what it is
    asked to install and then fails (so that the script stops there), and, in one case, a fake
    ``docker`` client whose ``docker info`` fails as it does without an engine.
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "env", "cat", "sleep", "seq", "tail"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    log = tmp_path / "apt.log"
    fake_apt = bin_dir / "apt-get"
    fake_apt.write_text(f'#!{shutil.which("bash")}\necho "$*" >> {log}\ncase " $* " in *" install "*) exit 3;; esac\n')
    fake_apt.chmod(0o755)
    if client:
        fake_docker = bin_dir / "docker"
        fake_docker.write_text(f"#!{shutil.which('bash')}\nexit 1\n")
        fake_docker.chmod(0o755)
    done = subprocess.run(
        [str(bin_dir / "bash"), str(ROOT / "docker" / "test-base.sh")],
        capture_output=True,
        text=True,
        env={"PATH": str(bin_dir)},
        timeout=60,
    )
    assert done.returncode != 0, "the fake apt-get fails, so the script must stop there"
    installs = [line for line in log.read_text().splitlines() if "install" in line.split()]
    assert installs, log.read_text()
    assert "docker.io" in installs[0].split(), installs
    assert "debootstrap" in installs[0].split(), installs
