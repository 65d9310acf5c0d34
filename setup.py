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

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
REQUIRED_TARGETS = ("_lze_cpu",)
OPTIONAL_TARGETS = ("_lze_cuda_emu", "_lze_cuda")


class CMakeExtension(Extension):
    """The whole CMake project, named after the module it must produce."""

    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        self._configure(build_dir, out_dir)
        for target in REQUIRED_TARGETS:
            self._build(build_dir, target, required=True)
        for target in OPTIONAL_TARGETS:
            self._build(build_dir, target, required=False)

    def _configure(self, build_dir: Path, out_dir: Path) -> None:
        import pybind11

        args = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DLZE_BUILD_CUDA={'OFF' if os.environ.get('LZE_BUILD_CUDA') == '0' else 'ON'}",
            "-DLZE_BUILD_CUDA_EMULATED="
            + ("OFF" if os.environ.get("LZE_BUILD_CUDA_EMULATED") == "0" else "ON"),
        ]
        if os.environ.get("LZE_CUDA_ARCHS"):
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={os.environ['LZE_CUDA_ARCHS']}")
        args += shlex.split(os.environ.get("LZE_CMAKE_ARGS", ""))
        subprocess.run(args, check=True)

    def _build(self, build_dir: Path, target: str, required: bool) -> None:
        if not required and not _cmake_has_target(build_dir, target):
            print(f"lze_kernels: {target} not configured (toolkit or sources missing), skipped")
            return
        jobs = os.environ.get("LZE_BUILD_JOBS", str(os.cpu_count() or 1))
        cmd = ["cmake", "--build", str(build_dir), "--target", target, "-j", jobs]
        result = subprocess.run(cmd, check=False)
        if result.returncode != 0:
            if required:
                raise RuntimeError(f"lze_kernels: building {target} failed")
            print(f"lze_kernels: WARNING: building {target} failed; that backend is unavailable")


def _cmake_has_target(build_dir: Path, target: str) -> bool:
    result = subprocess.run(
        ["cmake", "--build", str(build_dir), "--target", "help"],
        capture_output=True, text=True, check=False,
    )
    return target in result.stdout


setup(
    ext_modules=[CMakeExtension("lze_kernels._lze_cpu")],
    cmdclass={"build_ext": CMakeBuild},
)
