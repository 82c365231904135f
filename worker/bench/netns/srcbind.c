/* srcbind.c — LD_PRELOAD shim of worker/bench/netns.sh: a TCP/UDP socket that connects to an
 * address in 127.0.0.0/8 without having been bound first is bound to this process's own rank
 * address, so that the traffic a peer sends back on that connection is addressed to (and shaped
 * as) this rank's link, not the acceptor's. The rank address is NETNS_SRC if set, else the first
 * specific 127.x.y.z (not 127.0.0.1) address the process bound a socket to (its listener).
 * Nothing else is changed; outside 127.0.0.0/8 it does nothing. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

static in_addr_t own;  /* network order; 0 = not known */

static int loopback(in_addr_t a) { return (ntohl(a) >> 24) == 127; }

static int real_bind(int fd, const struct sockaddr *sa, socklen_t len) {
  static int (*f)(int, const struct sockaddr *, socklen_t);
  if (!f) f = (int (*)(int, const struct sockaddr *, socklen_t))dlsym(RTLD_NEXT, "bind");
  return f(fd, sa, len);
}

int bind(int fd, const struct sockaddr *sa, socklen_t len) {
  if (!own && sa && sa->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
    in_addr_t a = ((const struct sockaddr_in *)sa)->sin_addr.s_addr;
    if (loopback(a) && a != htonl(INADDR_LOOPBACK)) own = a;
  }
  return real_bind(fd, sa, len);
}

int connect(int fd, const struct sockaddr *sa, socklen_t len) {
  static int (*f)(int, const struct sockaddr *, socklen_t);
  if (!f) f = (int (*)(int, const struct sockaddr *, socklen_t))dlsym(RTLD_NEXT, "connect");
  const char *env = getenv("NETNS_SRC");
  in_addr_t src = own;
  if (env && *env) inet_pton(AF_INET, env, &src);
  if (src && sa && sa->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in) &&
      loopback(((const struct sockaddr_in *)sa)->sin_addr.s_addr)) {
    struct sockaddr_in cur;
    socklen_t cl = sizeof cur;
    /* only a socket nobody bound yet (port 0, any address) */
    if (getsockname(fd, (struct sockaddr *)&cur, &cl) == 0 && cur.sin_family == AF_INET &&
        cur.sin_port == 0 && cur.sin_addr.s_addr == 0) {
      struct sockaddr_in b;
      memset(&b, 0, sizeof b);
      b.sin_family = AF_INET;
      b.sin_addr.s_addr = src;
      real_bind(fd, (struct sockaddr *)&b, sizeof b); /* best effort */
    }
  }
  return f(fd, sa, len);
}
