"""Package discovery; everything else is declared in setup.cfg.

``package_dir`` (setup.cfg) installs adapters/ as ``polytrain.adapters`` and launchers/ as
``polytrain.launchers``. setuptools' ``find:`` would name what it finds there ``adapters.torch``, not
``polytrain.adapters.torch``, so the names are built here: every package under the three trees, found
rather than listed (a hand-kept list once left ``polytrain.adapters.torch.parallel`` out of the wheel).
"""

import configparser
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def package_dirs() -> dict[str, str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options"]["package_dir"].strip().splitlines()
    return {name.strip(): folder.strip() for name, _, folder in (line.partition("=") for line in lines)}


def packages() -> list[str]:
    found = []
    for name, folder in package_dirs().items():
        found += [name, *(f"{name}.{sub}" for sub in find_packages(where=str(ROOT / folder)))]
    return sorted(set(found))


setup(packages=packages())
