#!/bin/sh
# Open MPI rank wrapper of worker/bench/netns.sh (mpirun ... mpi_rank.sh BIN ARGS): rank r (from
# OMPI_COMM_WORLD_RANK) uses only its own address 127.0.0.(r+2) (on the bridge mpiR of netns_setup) for
# its TCP BTL and binds its outgoing connections to it (the srcbind shim, NETNS_SRC), so that the
# profile's per-address shaping is its link. mpirun itself runs without the shim.
r=${OMPI_COMM_WORLD_RANK:?not started by mpirun}
i=0; for a in $NETNS_ADDRS; do [ "$i" = "$r" ] && NETNS_SRC=$a; i=$((i + 1)); done
export NETNS_SRC OMPI_MCA_btl_tcp_if_include="mpi$r" LD_PRELOAD="$NETNS_SHIM"
exec "$@"
