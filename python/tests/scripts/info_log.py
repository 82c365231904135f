"""Runs a script with the ``diphoma`` logger at INFO on stderr (``logging.basicConfig``), so a
test reads which data plane each generation's group took. Usage: info_log.py SCRIPT ARGS"""

import logging
import runpy
import sys

logging.basicConfig(level=logging.WARNING, format="%(message)s")
logging.getLogger("diphoma").setLevel(logging.INFO)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
