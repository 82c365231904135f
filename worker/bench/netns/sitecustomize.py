# On PYTHONPATH inside worker/bench/netns.sh's namespace: a rank process (RANK set) listens and
# connects on its own address 127.0.0.(RANK+2), so that the profile's per-address shaping is its
# link: gloo through its device's interface (lo:rRANK, that address's label), the srcbind shim
# (LD_PRELOAD) through NETNS_SRC, and the diphoma ring of `python -m diphoma.run` (which puts
# every rank on 127.0.0.1) by DIPHOMA_RING_ADDRESSES rewritten here: rank i's 127.0.0.1:PORT
# becomes 127.0.0.(i+2):PORT (the launcher picked PORT free on 127.0.0.1; in the namespace of
# its own nothing else listens on the rank addresses). The rendezvous store stays on 127.0.0.1
# (unshaped, as htb's unclassified traffic).
import os

_rank, _addrs = os.environ.get("RANK"), os.environ.get("NETNS_ADDRS", "").split()
if _rank is not None and _rank.isdigit() and int(_rank) < len(_addrs):
    os.environ["GLOO_SOCKET_IFNAME"] = f"lo:r{_rank}"
    os.environ["NETNS_SRC"] = _addrs[int(_rank)]
    _ring = os.environ.get("DIPHOMA_RING_ADDRESSES", "").split(",")
    if len(_ring) <= len(_addrs) and all(a.startswith("127.0.0.1:") for a in _ring):
        os.environ["DIPHOMA_RING_ADDRESSES"] = ",".join(
            f"{_addrs[i]}:{a.rsplit(':', 1)[1]}" for i, a in enumerate(_ring))
