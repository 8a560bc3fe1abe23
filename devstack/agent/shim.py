"""LD_PRELOAD shim that gives every pod its own loopback address.

Pods share the host network namespace, so two pods whose servers bind 0.0.0.0:8080 would clash.
The shim rewrites bind() to the wildcard address or to 127.0.0.1 into a bind to the pod's own 127.x address
(env LOOM_POD_IP), and rewrites connect() to 127.0.0.1/::1 into a connect to the pod address when
something of this pod listens there, so `localhost` between a pod's containers keeps working
(torchrun's standalone rendezvous relies on it) while host services on 127.0.0.1 stay reachable.

Binds to 127.0.0.1 are the pod's own too: in a real pod, loopback is private to the pod's network namespace.
Without the rewrite, of two pods whose servers bind 127.0.0.1 on one port (vLLM's engine behind Loom's front
does) only the first gets it, and the second pod's front reaches the first pod's engine: another
InferenceService's, possibly in another namespace.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*sockfn)(int, const struct sockaddr *, socklen_t);

static int pod_addr(struct in_addr *out) {
    const char *ip = getenv("LOOM_POD_IP");
    return ip != NULL && inet_pton(AF_INET, ip, out) == 1;
}

/* True when /proc/net/tcp{,6} shows a listening socket on the pod address and this port. */
static int pod_listens(struct in_addr pod, unsigned short port) {
    static const char *tables[] = {"/proc/net/tcp", "/proc/net/tcp6"};
    char want4[64], want6[64], line[512];
    unsigned int a = pod.s_addr; /* kernel prints the raw 32-bit word in host order */
    snprintf(want4, sizeof want4, "%08X:%04X", a, port);
    snprintf(want6, sizeof want6, "0000000000000000FFFF0000%08X:%04X", a, port);
    for (int t = 0; t < 2; t++) {
        FILE *f = fopen(tables[t], "r");
        if (f == NULL) continue;
        while (fgets(line, sizeof line, f) != NULL) {
            char local[128], remote[128];
            unsigned int state;
            if (sscanf(line, " %*d: %127s %127s %X", local, remote, &state) != 3) continue;
            if (state == 0x0A && (strcmp(local, want4) == 0 || strcmp(local, want6) == 0)) {
                fclose(f);
                return 1;
            }
        }
        fclose(f);
    }
    return 0;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static sockfn real_bind = NULL;
    if (real_bind == NULL) real_bind = (sockfn)dlsym(RTLD_NEXT, "bind");
    struct in_addr pod;
    if (addr != NULL && pod_addr(&pod)) {
        if (addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
            struct sockaddr_in sin;
            memcpy(&sin, addr, sizeof sin);
            if (sin.sin_addr.s_addr == htonl(INADDR_ANY) || sin.sin_addr.s_addr == htonl(INADDR_LOOPBACK)) {
                sin.sin_addr = pod;
                return real_bind(fd, (struct sockaddr *)&sin, sizeof sin);
            }
        } else if (addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
            struct sockaddr_in6 sin6;
            memcpy(&sin6, addr, sizeof sin6);
            if (memcmp(&sin6.sin6_addr, &in6addr_any, sizeof(struct in6_addr)) == 0) {
                struct sockaddr_in6 mapped = sin6;
                memset(&mapped.sin6_addr, 0, sizeof(struct in6_addr));
                mapped.sin6_addr.s6_addr[10] = 0xff;
                mapped.sin6_addr.s6_addr[11] = 0xff;
                memcpy(&mapped.sin6_addr.s6_addr[12], &pod, 4);
                /* A v6-only socket cannot take a v4-mapped address: keep the wildcard then. */
                if (real_bind(fd, (struct sockaddr *)&mapped, sizeof mapped) == 0) return 0;
            }
        }
    }
    return real_bind(fd, addr, len);
}

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
    static sockfn real_connect = NULL;
    if (real_connect == NULL) real_connect = (sockfn)dlsym(RTLD_NEXT, "connect");
    struct in_addr pod;
    if (addr != NULL && pod_addr(&pod)) {
        if (addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
            struct sockaddr_in sin;
            memcpy(&sin, addr, sizeof sin);
            if (sin.sin_addr.s_addr == htonl(INADDR_LOOPBACK) && pod_listens(pod, ntohs(sin.sin_port))) {
                sin.sin_addr = pod;
                return real_connect(fd, (struct sockaddr *)&sin, sizeof sin);
            }
        } else if (addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
            struct sockaddr_in6 sin6;
            memcpy(&sin6, addr, sizeof sin6);
            if (memcmp(&sin6.sin6_addr, &in6addr_loopback, sizeof(struct in6_addr)) == 0
                && pod_listens(pod, ntohs(sin6.sin6_port))) {
                memset(&sin6.sin6_addr, 0, sizeof(struct in6_addr));
                sin6.sin6_addr.s6_addr[10] = 0xff;
                sin6.sin6_addr.s6_addr[11] = 0xff;
                memcpy(&sin6.sin6_addr.s6_addr[12], &pod, 4);
                return real_connect(fd, (struct sockaddr *)&sin6, sizeof sin6);
            }
        }
    }
    return real_connect(fd, addr, len);
}
"""


def build_shim(state_dir: Path) -> Path:
    """Compile the shim once per source version into the state dir and return the .so path."""
    digest = hashlib.sha256(SHIM_SOURCE.encode()).hexdigest()[:12]
    target = state_dir / f"loom-netshim-{digest}.so"
    if target.exists():
        return target
    source = state_dir / f"loom-netshim-{digest}.c"
    source.write_text(SHIM_SOURCE)
    partial = target.with_suffix(".so.tmp")
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-o", str(partial), str(source), "-ldl"],
        check=True,
        capture_output=True,
        text=True,
    )
    partial.rename(target)  # atomic: a half-written .so is never preloaded
    return target
