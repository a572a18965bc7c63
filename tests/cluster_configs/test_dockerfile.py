"""cluster_configs/docker/Dockerfile (not built in CI: no docker there) names the versions the
rest of the project pins: torch as scripts/install.sh and the README install it (first, and
again on the project's line), Ray as the manifests' rayVersion; it installs every package
pyproject.toml lists; and the manifests run that image."""
import os
import re

from tests.cluster_configs import manifests as m


def dockerfile() -> str:
    with open(m.DOCKERFILE) as f:
        return f.read()


def instructions() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile())
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def project_torch_pin() -> str:
    with open(os.path.join(m.ROOT, "scripts", "install.sh")) as f:
        pins = set(re.findall(r'torch==([0-9.]+)', f.read()))
    with open(os.path.join(m.ROOT, "README.md")) as f:
        readme = set(re.findall(r'torch==([0-9.]+)', f.read()))
    assert len(pins) == 1 and readme == pins, (pins, readme)
    return pins.pop()


def ray_version() -> str:
    versions = {m.cluster_spec(m.load(n))["rayVersion"] for n in (m.RAYCLUSTER, m.RAYJOB)}
    assert len(versions) == 1, versions
    return versions.pop()


def test_base_image_is_rays_at_the_manifests_version():
    base = [i for i in instructions() if i.startswith("FROM ")]
    assert len(base) == 1
    mt = re.fullmatch(r"FROM rayproject/ray:([0-9.]+)-py3(\d+)(-gpu|-cu\d+)?", base[0])
    assert mt, base[0]
    assert mt.group(1) == ray_version()
    with open(os.path.join(m.ROOT, "pyproject.toml")) as f:
        floor = re.search(r'requires-python\s*=\s*">=3\.(\d+)"', f.read())
    assert int(mt.group(2)) >= int(floor.group(1)), "the image's Python meets requires-python"


def test_torch_pinned_first_and_on_the_project_line():
    torch = project_torch_pin()
    runs = [i for i in instructions() if i.startswith("RUN ") and "pip install" in i]
    pins = [set(re.findall(r"torch==([0-9.]+)", r)) for r in runs]
    assert runs and all(p <= {torch} for p in pins), pins
    assert re.search(r'pip install [^.]*"torch==' + re.escape(torch) + '"', runs[0])
    project = [r for r in runs if re.search(r"\s\.(\s|$|\[)", r)]
    assert len(project) == 1 and runs.index(project[0]) > 0
    assert f'"torch=={torch}"' in project[0], "pinned again where the project resolves"
    assert f'"ray[default]=={ray_version()}"' in project[0], "Ray kept at the image's"


def test_every_package_is_copied():
    with open(os.path.join(m.ROOT, "pyproject.toml")) as f:
        packages = re.findall(r'"(\w+)"', re.search(r"packages\s*=\s*\[([^\]]*)\]", f.read()).group(1))
    copies = " ".join(i for i in instructions() if i.startswith("COPY "))
    assert packages
    for p in packages + ["pyproject.toml"]:
        assert re.search(rf"\s{re.escape(p)}\s", copies + " "), p


def test_manifests_run_the_image_and_install_nothing():
    images = set()
    for name in (m.RAYCLUSTER, m.RAYJOB):
        for _, g, _ in m.groups(m.cluster_spec(m.load(name))):
            images |= {c["image"] for c in g["template"]["spec"]["containers"]}
    launcher = m.load(m.LAUNCHER)
    images.add(launcher["docker"]["image"])
    assert len(images) == 1, images
    image = images.pop()
    assert image.split("/")[-1].startswith("ray-pp-runtime:"), image  # not a bare Ray image
    assert not any("pip" in c for c in launcher["setup_commands"]), launcher["setup_commands"]
