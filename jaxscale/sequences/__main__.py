"""`python -m jaxscale.sequences ...` (see `jaxscale.sequences.cli`).

The process ends with `os._exit` once the command has returned and the output streams are flushed: pyarrow's
C++ thread pools can abort an already finished run while the interpreter tears down (std::terminate on a
worker still joinable, "terminate called without an active exception": apache/arrow#34314, #39862). Every
file a command writes is fsynced and renamed into place before it returns, so skipping that teardown loses
nothing. (The one cause found in this package, a Parquet read through a Python file object, is gone: see
`vocabulary.load_vocabulary`; this stays as the guard for the command-line programs.)
"""

import logging
import os
import sys

from jaxscale.sequences.cli import main


def run() -> int:
    try:
        code = main()
    except SystemExit as e:  # argparse's usage errors and --help
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    return int(code or 0)


os._exit(run())
