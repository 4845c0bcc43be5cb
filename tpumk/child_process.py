"""The command line of a Python child process that runs a tpumk module with THIS tpumk.

tpumk starts Python children of its own: the compiler-estimate process of `build`, `export`
and `bench` (tpumk.estimate.profiler) and the tuner's trial worker (tpumk.tune.worker).
`python -m tpumk.x` would put the working directory first on the child's sys.path, so a
`tpumk/` directory where the user runs tpumk (a checkout, an unpacked download, a hostile
archive) was imported instead of tpumk's own code: `mkdir -p tpumk && echo 'open("PWNED",
"w")' > tpumk/__init__.py && tpumk build --model tiny-dense` wrote PWNED from the estimate
process. With PYTHONPATH naming another checkout, the child silently ran that checkout's code.

`command(module, *args)` is `python -P -c BOOTSTRAP PACKAGE_DIR module args`: `-P` (Python
3.11's safe_path) keeps the working directory (or a script's directory) off sys.path, and the
bootstrap loads the package `tpumk` from PACKAGE_DIR, the directory this process imported it
from, before anything else imports it, so every `tpumk.*` module of the child comes from there,
whatever a `tpumk` on PYTHONPATH or in site-packages is. Everything else (jax, optuna, ...)
comes from PYTHONPATH and the site packages, as in this process.
"""

from __future__ import annotations

import os
import sys

# The tpumk package directory of this process (this module is in it).
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

# Run as `python -P -c BOOTSTRAP PACKAGE_DIR MODULE ARGS...`: import the package from
# PACKAGE_DIR by its path, then run MODULE as `python -m MODULE ARGS...` would.
BOOTSTRAP = """\
import importlib.util, os, runpy, sys
package, module = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("tpumk", os.path.join(package, "__init__.py"),
                                              submodule_search_locations=[package])
tpumk = importlib.util.module_from_spec(spec)
sys.modules["tpumk"] = tpumk
spec.loader.exec_module(tpumk)
del sys.argv[1:3]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def command(module: str, *args: str) -> list[str]:
    """argv that runs `module` (a tpumk module with a `__main__` block) with `args`, in this
    Python, importing this process's tpumk package (never the working directory's)."""
    if not (module == "tpumk" or module.startswith("tpumk.")):
        raise ValueError(f"not a tpumk module: {module!r}")
    return [sys.executable, "-P", "-c", BOOTSTRAP, PACKAGE_DIR, module, *map(str, args)]
