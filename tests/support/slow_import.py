"""A module whose import takes a minute: a fork server that preloads it stays 'importing' while a test
interrupts the start that waits for it (tests/unit/supervisor/test_forkserver.py)."""

import time

time.sleep(60)
