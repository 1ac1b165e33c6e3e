# Tests of the packaging: `vramledger --version` from the one version number,
# and the _core module's loader path (DT_RPATH $ORIGIN, every Abseil library beside it).
"""Packaging tests: the version the command prints and where _core's Abseil libraries load from."""

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

import vramledger

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_version_command_prints_the_package_version():
    proc = subprocess.run([sys.executable, "-m", "vramledger", "--version"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"vramledger {vramledger.__version__}"


def test_pyproject_reads_the_version_from_the_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"]
    assert "version" not in project["project"]
    version = project["tool"]["scikit-build"]["metadata"]["version"]
    source = (ROOT / version["input"]).read_text()
    # scikit-build-core's default pattern for the regex provider.
    match = re.search(r"""(?im)^(__version__|VERSION)(?: ?\: ?str)? *= *(['"])v?(?P<value>.+?)\2""",
                      source)
    assert match and match.group("value") == vramledger.__version__


def _core_path():
    # The installed package's module, else the build tree's (PYTHONPATH=<build>/tools/python).
    spec = importlib.util.find_spec("vramledger._core") or importlib.util.find_spec("_core")
    if spec is None or spec.origin is None:
        pytest.skip("vramledger._core is not built")
    return pathlib.Path(spec.origin)


def test_core_loads_every_abseil_library_from_its_own_folder():
    core = _core_path()
    if shutil.which("readelf") is None or shutil.which("ldd") is None:
        pytest.skip("readelf / ldd not available")
    dynamic = subprocess.run(["readelf", "-d", str(core)], capture_output=True, text=True,
                             check=True).stdout
    # DT_RPATH (not DT_RUNPATH): it also covers the bundled libraries' own Abseil dependencies.
    assert re.search(r"\(RPATH\)\s+Library rpath: \[\$ORIGIN\]", dynamic), dynamic
    assert "RUNPATH" not in dynamic
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    ldd = subprocess.run(["ldd", str(core)], capture_output=True, text=True, check=True,
                         env=env).stdout
    absl = [line.split() for line in ldd.splitlines() if "libabsl_" in line]
    assert absl, ldd
    folder = str(core.parent) + os.sep
    outside = [parts[0] for parts in absl if len(parts) < 3 or not parts[2].startswith(folder)]
    assert not outside, f"Abseil libraries not loaded from {folder}: {outside}"
    assert "not found" not in ldd
