"""A process that ends as its argument says: ``python -m tests.support.exit_probe none|text|big|negative|raise``.

``sys.exit()``, ``sys.exit("a message")``, ``sys.exit(300)``, ``sys.exit(-2)`` or an uncaught exception: the exit
status and what is printed are the interpreter's to derive. tests/unit/supervisor/test_forkserver.py compares a
child forked by the fork server with the same command started by ``subprocess.Popen``.
"""

import sys

ENDS = {"none": None, "text": "stopped: a message", "big": 300, "negative": -2}

if __name__ == "__main__":
    if sys.argv[1] == "raise":
        raise RuntimeError("boom")
    sys.exit(ENDS[sys.argv[1]])
