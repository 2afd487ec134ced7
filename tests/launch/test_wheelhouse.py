"""Offline installs: scripts/wheelhouse.sh's wheels install stratagem with `--no-index` into a fresh venv that
already has torch, and scripts/gpu_check.sh installs from them and runs `stratagem calibrate` (CPU dry path).

Building the wheelhouse needs the package registry (once per test session); without it these tests skip.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stratagem.evaluators.calibration_file import load_calibration

ROOT = Path(__file__).resolve().parents[2]
PYV = ".".join(platform.python_version_tuple()[:2])
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ENV.pop("PYTHONPATH", None)

pytestmark = pytest.mark.slow


def _run(cmd: list[str], timeout: float, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, **kw)  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every dependency except torch, for this interpreter's Python version, plus stratagem's wheel."""
    dest = tmp_path_factory.mktemp("wheelhouse")
    done = _run(["bash", str(ROOT / "scripts" / "wheelhouse.sh"), "--python-version", PYV, "--dest", str(dest)],
                timeout=900, env={**ENV, "PYTHON": sys.executable})
    if done.returncode != 0:
        if re.search(r"(?i)connection|network|resolve|timed out|No matching distribution", done.stderr):
            pytest.skip(f"package registry unreachable: {done.stderr.strip().splitlines()[-1][:200]}")
        raise AssertionError(done.stderr[-3000:])
    return dest


def _torch_only(link_dir: Path) -> None:
    """Symlink torch and the distributions it requires (with their metadata) from this interpreter into
    link_dir: a fresh venv with a .pth pointing there has torch and nothing else of ours."""
    seen: set[str] = set()
    todo = ["torch"]
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional or platform-specific requirement that is not installed here
        base = Path(str(dist.locate_file("")))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src = base / top
            if src.exists() and not (link_dir / top).exists() and top != "__pycache__" and not top.endswith(".pth"):
                (link_dir / top).symlink_to(src)
        for req in dist.requires or []:
            if "extra ==" not in req:
                todo.append(re.split(r"[<>=!~; \[(]", req, maxsplit=1)[0])


def test_wheelhouse_installs_offline_into_a_venv_that_has_torch(wheelhouse: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)], timeout=120).returncode == 0
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     timeout=30).stdout.strip())
    links = tmp_path / "torch-only"
    links.mkdir()
    _torch_only(links)
    (site / "torch-only.pth").write_text(str(links) + "\n")
    # The venv's bundled setuptools would shadow the one torch requires (pip would then want to upgrade it).
    for p in site.iterdir():
        if p.name.startswith(("setuptools", "pkg_resources", "_distutils_hack", "distutils-precedence")):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    assert _run([str(py), "-c", "import torch"], timeout=120, env=ENV).returncode == 0
    assert _run([str(py), "-c", "import pydantic"], timeout=60, env=ENV).returncode != 0  # nothing else yet

    install = _run([str(py), "-m", "pip", "install", "--no-index", "--find-links", str(wheelhouse), "stratagem"],
                   timeout=600, env=ENV, cwd=tmp_path)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    assert "torch" not in " ".join(os.listdir(wheelhouse))
    check = _run([str(py), "-c", "import stratagem, stratagem.cli, stratagem.launch.runners.calibrate, optuna, ray, torch; "
                  "print(stratagem.__file__)"], timeout=120, env=ENV, cwd=tmp_path)
    assert check.returncode == 0, check.stderr[-2000:]
    assert str(venv) in check.stdout  # the installed package, not this checkout
    helped = _run([str(venv / "bin" / "stratagem"), "calibrate", "--help"], timeout=120, env=ENV, cwd=tmp_path)
    assert helped.returncode == 0 and "--budget-minutes" in helped.stdout


def test_gpu_check_dry_path_installs_from_the_wheelhouse_and_calibrates(wheelhouse: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    script = str(ROOT / "scripts" / "gpu_check.sh")
    assert _run(["bash", "-n", script], timeout=30).returncode == 0
    done = _run(["bash", script, "--dry-run"], timeout=420,
                env={**ENV, "OUT": str(out), "WHEELHOUSE": str(wheelhouse), "PYTHON": sys.executable})
    print(done.stdout[-5000:])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "/site/stratagem/__init__.py" in done.stderr  # installed from the wheelhouse, not this checkout
    cf = load_calibration(out / "calibration.yaml")
    assert cf.provenance.gpu_preset == "cpu" and cf.provenance.gpus == 2
    assert sum(r.status == "ok" for r in cf.runs) >= 8
    assert cf.errors["step_error_after"] < cf.errors["step_error_before"]
    assert cf.errors["peak_error_after"] < cf.errors["peak_error_before"]
    table = (out / "table.txt").read_text()
    assert "before" in table and "after" in table and "dp2 z3 mb1 bf16" in table
    assert len(list((out / "calibration-runs").glob("*.json"))) == len(cf.runs)
