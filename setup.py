"""Build lze_kernels: setuptools drives CMakeLists.txt, which builds pybind11 modules.

Environment knobs (all optional):
  LZE_BUILD_CUDA=0            skip the CUDA module even when nvcc is found
  LZE_BUILD_CUDA_EMULATED=0   skip the CUDA-on-CPU emulated module (test support)
  LZE_CUDA_ARCHS="80-real;90" CMAKE_CUDA_ARCHITECTURES (default: sm_80 and sm_90 SASS + sm_90 PTX)
  LZE_BUILD_JOBS=N            parallel build jobs (default: CPU count)
  LZE_CMAKE_ARGS="..."        extra arguments for the CMake configure step

Only the CPU module is required: if the CUDA or emulated module fails to build, the package
still installs and works through the other backends.
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    """One pybind11 module, built as a target of the project's CMakeLists.txt."""

    def __init__(self, target: str, optional: bool):
        super().__init__(f"lze_kernels.{target}", sources=[], optional=optional)
        self.target = target


class CMakeBuild(build_ext):
    """Configures the CMake project once, then builds one target per extension. A failing
    optional target raises CompileError, which setuptools reports and skips."""

    _configured_dir = None

    def build_extension(self, ext: CMakeExtension) -> None:
        build_dir = self._configure(Path(self.get_ext_fullpath(ext.name)).resolve().parent)
        if ext.optional and not _cmake_has_target(build_dir, ext.target):
            raise CompileError(f"{ext.target}: not configured (toolkit or sources missing)")
        jobs = os.environ.get("LZE_BUILD_JOBS", str(os.cpu_count() or 1))
        cmd = ["cmake", "--build", str(build_dir), "--target", ext.target, "-j", jobs]
        if subprocess.run(cmd, check=False).returncode != 0:
            raise CompileError(f"lze_kernels: building {ext.target} failed")

    def _configure(self, out_dir: Path) -> Path:
        if self._configured_dir is not None:
            return self._configured_dir
        import pybind11

        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DLZE_BUILD_CUDA={_flag('LZE_BUILD_CUDA')}",
            f"-DLZE_BUILD_CUDA_EMULATED={_flag('LZE_BUILD_CUDA_EMULATED')}",
        ]
        if os.environ.get("LZE_CUDA_ARCHS"):
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={os.environ['LZE_CUDA_ARCHS']}")
        args += shlex.split(os.environ.get("LZE_CMAKE_ARGS", ""))
        subprocess.run(args, check=True)
        self._configured_dir = build_dir
        return build_dir


def _flag(name: str) -> str:
    return "OFF" if os.environ.get(name) == "0" else "ON"


def _cmake_has_target(build_dir: Path, target: str) -> bool:
    result = subprocess.run(
        ["cmake", "--build", str(build_dir), "--target", "help"],
        capture_output=True, text=True, check=False,
    )
    return target in result.stdout


def _packages() -> list[str]:
    """The kernel package, and the trainer (source folder `trainer/`, import name `lze_trainer`)."""
    trainer = ["lze_trainer"] + [f"lze_trainer.{p}" for p in find_packages("trainer")]
    return find_packages(include=["lze_kernels", "lze_kernels.*"]) + trainer


setup(
    packages=_packages(),
    package_dir={"lze_trainer": "trainer"},
    # The presets, and the warmed models they start from (lze_trainer.warm_starts).
    package_data={"lze_trainer": ["configs/*.yaml", *(f"warm_starts/*/{pattern}" for pattern in (
        "SHA256SUMS", "*.json", "*.jinja", "*.safetensors"))]},
    ext_modules=[
        CMakeExtension("_lze_cpu", optional=False),
        CMakeExtension("_lze_cuda_emu", optional=True),
        CMakeExtension("_lze_cuda", optional=True),
    ],
    cmdclass={"build_ext": CMakeBuild},
)
