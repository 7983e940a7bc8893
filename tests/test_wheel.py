"""The built wheel ships every module: build it, install it (without dependencies) into a fresh venv
that borrows this environment's third-party packages, and import every module from the wheel, not
from the source tree."""

import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_installs_and_imports_every_module(tmp_path):
    source = tmp_path / "source"  # a copy: building in the checkout would leave build/ in it
    for name in ("pyproject.toml", "README.md", "analyze", "collect", "reports"):
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copyfile
        source.mkdir(exist_ok=True)
        copy(REPO / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
                    str(source)], check=True, capture_output=True)
    [wheel] = tmp_path.glob("steplens-*.whl")
    shipped = sorted(name[:-3].replace("/", ".").removesuffix(".__init__") for name in zipfile.ZipFile(wheel).namelist()
                     if name.endswith(".py"))
    sources = sorted(f"steplens.{p.relative_to(REPO).with_suffix('').as_posix().replace('/', '.')}".removesuffix(".__init__")
                     for folder in ("analyze", "collect", "reports") for p in (REPO / folder).rglob("*.py"))
    assert shipped == sources  # every source module is in the wheel
    assert any(name.endswith("templates/report.html.j2") for name in zipfile.ZipFile(wheel).namelist())

    env = tmp_path / "venv"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, str(wheel)], check=True,
                   capture_output=True)
    # Third-party packages from this environment, appended after the venv's own site-packages; a bare
    # path in a .pth file is not a site dir, so this environment's editable steplens is not loaded.
    borrowed = [p for p in sys.path if p.endswith("site-packages")]
    (Path(site) / "borrowed.pth").write_text("\n".join(borrowed) + "\n")
    check = ("import importlib, sys\n"
             f"names = {shipped!r}\n"
             "for name in names:\n"
             "    if name.endswith('__main__'):\n"
             "        continue\n"
             "    module = importlib.import_module(name)\n"
             f"    assert module.__file__.startswith({site!r}), (name, module.__file__)\n"
             "print(len(names))\n")
    done = subprocess.run([str(python), "-c", check], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) == len(shipped)
