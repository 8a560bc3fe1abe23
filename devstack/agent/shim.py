"""LD_PRELOAD shim that gives every pod its own loopback address.

Pods share the host network namespace, so two pods whose servers bind 0.0.0.0:8080 would clash.
The shim rewrites bind() to the wildcard address or to 127.0.0.1 into a bind to the pod's own 127.x address
(env LOOM_POD_IP), and rewrites connect() to 127.0.0.1/::1 into a connect to the pod address when
something of this pod listens there, so `localhost` between a pod's containers keeps working
(torchrun's standalone rendezvous relies on it).

A TCP connect to 127.0.0.1/::1 (or to the pod's own address) on a port nothing of this pod listens on is refused
(ECONNREFUSED), as in a real pod, whose loopback is its own network namespace's: the host's loopback listeners are
not the pod's (#52: an LLM front probing 127.0.0.1:8081 for its engine reached the host's `loom operator` metrics
server). Host ports pods are meant to reach are published: LOOM_HOST_PORTS (a comma-separated list; the agent
puts the API server's port there when it is on loopback) and a file named after the port in LOOM_HOST_PORTS_DIR
(`<state>/host-ports/`, written by `published_host_port`, e.g. for the backing servers tests start on the host).
UDP is left alone (a resolver on 127.0.0.1:53 still answers).

Why this and not a network namespace per pod: unshare(CLONE_NEWNET) (the agent runs as root) gives a pod a loopback
of its own but nothing else: the Service proxies (127.20.x.y), the other pods' addresses and the API server are
all host loopback, so every pod would need a veth pair, routes and NAT back to the host, and the agent's probes,
Service proxies and `kubectl logs` would have to enter each namespace. The shim already owns every pod's loopback
binds and connects; refusing there is the same mechanism, dies with the pod's processes, and needs no cleanup.

Binds to 127.0.0.1 are the pod's own too: in a real pod, loopback is private to the pod's network namespace.
Without the rewrite, of two pods whose servers bind 127.0.0.1 on one port (vLLM's engine behind Loom's front
does) only the first gets it, and the second pod's front reaches the first pod's engine: another
InferenceService's, possibly in another namespace.
"""

from __future__ import annotations

import contextlib
import hashlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

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

/* A host port pods may reach on loopback: in LOOM_HOST_PORTS, or a file named after it in LOOM_HOST_PORTS_DIR. */
static int host_port_published(unsigned short port) {
    const char *list = getenv("LOOM_HOST_PORTS");
    if (list != NULL) {
        const char *p = list;
        while (*p != '\0') {
            char *end;
            unsigned long value = strtoul(p, &end, 10);
            if (end != p && value == port) return 1;
            p = (*end == '\0') ? end : end + 1;
        }
    }
    const char *dir = getenv("LOOM_HOST_PORTS_DIR");
    if (dir != NULL && *dir != '\0') {
        char path[4096];
        snprintf(path, sizeof path, "%s/%u", dir, (unsigned int)port);
        if (access(path, F_OK) == 0) return 1;
    }
    return 0;
}

static int is_stream(int fd) {
    int type = 0;
    socklen_t len = sizeof type;
    return getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 && type == SOCK_STREAM;
}

/* The pod has no listener here and the host's is not published to pods: refused, as a pod's own loopback does. */
static int refused(int fd, unsigned short port) {
    if (!is_stream(fd) || host_port_published(port)) return 0;
    errno = ECONNREFUSED;
    return 1;
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
            int loopback = sin.sin_addr.s_addr == htonl(INADDR_LOOPBACK);
            if (loopback || sin.sin_addr.s_addr == pod.s_addr) {
                unsigned short port = ntohs(sin.sin_port);
                if (pod_listens(pod, port)) {
                    sin.sin_addr = pod;
                    return real_connect(fd, (struct sockaddr *)&sin, sizeof sin);
                }
                if (refused(fd, port)) return -1;
            }
        } else if (addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
            struct sockaddr_in6 sin6;
            memcpy(&sin6, addr, sizeof sin6);
            static const unsigned char mapped_loopback[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1};
            if (memcmp(&sin6.sin6_addr, &in6addr_loopback, sizeof(struct in6_addr)) == 0
                || memcmp(&sin6.sin6_addr, mapped_loopback, 16) == 0) {
                unsigned short port = ntohs(sin6.sin6_port);
                if (pod_listens(pod, port)) {
                    memset(&sin6.sin6_addr, 0, sizeof(struct in6_addr));
                    sin6.sin6_addr.s6_addr[10] = 0xff;
                    sin6.sin6_addr.s6_addr[11] = 0xff;
                    memcpy(&sin6.sin6_addr.s6_addr[12], &pod, 4);
                    return real_connect(fd, (struct sockaddr *)&sin6, sizeof sin6);
                }
                if (refused(fd, port)) return -1;
            }
        }
    }
    return real_connect(fd, addr, len);
}
"""


HOST_PORTS_DIR = "host-ports"  # under the agent's state dir: one file per host port published to pods


def host_ports_environment(state_dir: Path, api_host: str, api_port: int) -> dict[str, str]:
    """What tells the shim which host loopback ports a pod may reach: the API server's (when it listens on
    loopback: in-cluster clients reach it at KUBERNETES_SERVICE_HOST) and those published in the state dir."""
    env = {"LOOM_HOST_PORTS_DIR": str(state_dir / HOST_PORTS_DIR)}
    if api_host in ("localhost", "::1") or api_host.startswith("127."):
        env["LOOM_HOST_PORTS"] = str(api_port)
    return env


@contextlib.contextmanager
def published_host_port(state_dir: Path, port: int) -> Iterator[None]:
    """Let the node agent's pods reach this host loopback port while the block runs (a server on this machine that
    pods are given the address of, as a real cluster's pods reach a node's service on its address)."""
    folder = state_dir / HOST_PORTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / str(port)
    marker.write_text("")
    try:
        yield
    finally:
        marker.unlink(missing_ok=True)


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
