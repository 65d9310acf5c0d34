"""The console keeps the trainer's lines; library logging, warnings and, during start-up,
anything written to file descriptors 1 and 2 (C++ warnings, prints) go to the run's log."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import logging, os, sys, warnings
    from pathlib import Path
    from lze_trainer import run_log

    run_log.setup(Path(sys.argv[1]), 1)
    logging.getLogger("DeepSpeed").addHandler(logging.StreamHandler(sys.stdout))  # as DeepSpeed
    logging.getLogger("DeepSpeed").warning("ds-warning")
    logging.getLogger("vllm.platforms").warning("vllm-warning")
    warnings.warn("library-future-warning", FutureWarning)
    warnings.warn("lze_kernels: own-warning", RuntimeWarning)
    with run_log.libraries_to_log():
        print("plain-print", flush=True)
        os.write(2, b"cxx-warning\\n")
        print("console-line", file=run_log.console(), flush=True)
    print("after-start-up", flush=True)
""")


def test_library_output_goes_to_the_log_and_trainer_lines_to_the_console(tmp_path):
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    log = (tmp_path / "logs" / "rank1.txt").read_text()
    library = ["ds-warning", "vllm-warning", "library-future-warning", "plain-print",
               "cxx-warning"]
    assert all(line in log for line in library), log
    console = result.stdout + result.stderr
    assert not any(line in console for line in library), console
    assert "console-line" in result.stdout and "after-start-up" in result.stdout
    assert "console-line" not in log
    assert "lze_kernels: own-warning" in log and "lze_kernels: own-warning" in result.stderr
