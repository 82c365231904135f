# On PYTHONPATH inside worker/bench/netns.sh's namespace: a rank process (RANK set) listens and
# connects on its own address 127.0.0.(RANK+2), so that the profile's per-address shaping is its
# link: gloo through its device's interface (lo:rRANK, that address's label), the srcbind shim
# (LD_PRELOAD) through NETNS_SRC.
import os

_rank, _addrs = os.environ.get("RANK"), os.environ.get("NETNS_ADDRS", "").split()
if _rank is not None and _rank.isdigit() and int(_rank) < len(_addrs):
    os.environ["GLOO_SOCKET_IFNAME"] = f"lo:r{_rank}"
    os.environ["NETNS_SRC"] = _addrs[int(_rank)]
