"""The built wheel ships every module: build it, install it (without dependencies) into a fresh venv
that borrows this environment's third-party packages, and import every module from the wheel, not
from the source tree."""

import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(command: list, **kwargs) -> subprocess.CompletedProcess:
    """The command's result; when it fails, the failure shows its stderr (pip says why a build failed there)."""
    done = subprocess.run([str(part) for part in command], capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{command[:4]} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done


def test_wheel_installs_and_imports_every_module(tmp_path):
    source = tmp_path / "source"  # a copy: building in the checkout would leave build/ in it
    for name in ("pyproject.toml", "README.md", "analyze", "collect", "reports"):
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copyfile
        source.mkdir(exist_ok=True)
        # (without the checkout's own build of the native columnizer: the wheel's must come from its build)
        copy(REPO / name, source / name,
             **({"ignore": shutil.ignore_patterns("__pycache__", "*.so")} if copy is shutil.copytree else {}))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path, source])
    [wheel] = tmp_path.glob("steplens-*.whl")
    shipped = sorted(name[:-3].replace("/", ".").removesuffix(".__init__") for name in zipfile.ZipFile(wheel).namelist()
                     if name.endswith(".py"))
    sources = sorted(f"steplens.{p.relative_to(REPO).with_suffix('').as_posix().replace('/', '.')}".removesuffix(".__init__")
                     for folder in ("analyze", "collect", "reports") for p in (REPO / folder).rglob("*.py"))
    assert shipped == sources  # every source module is in the wheel
    assert any(name.endswith("templates/report.html.j2") for name in zipfile.ZipFile(wheel).namelist())
    if shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]):  # pip builds the native columnizer
        assert any(name.startswith("steplens/analyze/importers/_columnize.") for name in zipfile.ZipFile(wheel).namelist())

    env = tmp_path / "venv"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel])
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
    done = run([python, "-c", check], cwd=tmp_path)
    assert int(done.stdout.split()[-1]) == len(shipped)


# Packages of the extras (test, remote, dask, collect): the README's first command installs none of them.
EXTRAS_ONLY = ("s3fs", "gcsfs", "fsspec", "aiobotocore", "boto3", "botocore", "moto", "dask", "distributed", "wandb",
               "selenium", "psutil", "pytest", "torch", "deepspeed", "gcp_storage_emulator")
BLOCK_EXTRAS = f"""
import importlib.machinery, sys
class Blocked:  # finds the extras' packages, and fails to load them: an import of one is an error
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {EXTRAS_ONLY!r}:
            return importlib.machinery.ModuleSpec(name, self)
    def create_module(self, spec):
        raise ModuleNotFoundError(f"{{spec.name}} is an extra's package, not installed by `pip install -e .`")
sys.meta_path.insert(0, Blocked())
from steplens.analyze.cli_rerun import main
sys.argv = ["analyze", *sys.argv[1:]]
main()
"""


def test_analyze_runs_on_the_base_install(tmp_path):
    """The README's first command, `pip install -e .` then `analyze sample_runs/synthetic_8rank`: analyze and its
    report need no package of an extra (each import of one fails here)."""
    out = tmp_path / "out"
    done = run([sys.executable, "-c", BLOCK_EXTRAS, REPO / "sample_runs" / "synthetic_8rank", "--out", out, "-q"])
    assert (out / "report.html").is_file() and "Traceback" not in done.stderr


def test_the_object_storage_stack_is_pinned_as_a_set():
    """s3fs pins fsspec exactly and aiobotocore pins botocore to a few patch releases: every one of these carries
    an upper bound, so pip cannot walk back through their history (it took 16 min unpinned)."""
    import tomllib

    from packaging.requirements import Requirement

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    requirements = {Requirement(text).name: Requirement(text) for extra in ("test", "remote") for text in extras[extra]}
    for name in ("fsspec", "s3fs", "gcsfs", "aiobotocore", "boto3"):
        assert any(spec.operator in ("<", "<=", "==", "~=") for spec in requirements[name].specifier), name
    build = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    assert build == ["setuptools>=77"]  # the first setuptools that takes `license = "MIT"` (PEP 639)
