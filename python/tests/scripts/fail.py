"""Rank 1 exits with code 3 once rank 0 has written its pid to argv[1]; rank 0 sleeps (the
launcher must stop it)."""

import os
import sys
import time

if os.environ["RANK"] == "0":
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(600)
else:
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
    sys.exit(3)
