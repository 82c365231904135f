"""Under --elastic: local-1 exits with code 5 (a permanent error) at once; the others would
sleep for a minute (the launcher must stop them)."""

import os
import sys
import time

if os.environ["DIPHOMA_POD_NAME"] == "local-1":
    sys.exit(5)
time.sleep(60)
