/*
 * Test-only LD_PRELOAD shim: UCX's ucs_netif_get_addr without its
 * link-local filter.
 *
 * Why: the multi-host tests put each engine in a network namespace whose
 * only address is a link-local 169.254.x.y/30 (the only addresses our test
 * machines allow). UCX 1.23 (the one in NIXL 1.5.1)'s TCP transport skips every 169.254.0.0/16 and
 * fe80::/10 address when it looks up an interface's address, so NIXL finds
 * no device. This file replaces that one lookup with the same loop minus the
 * two link-local tests (same signature, same return codes: UCS_OK 0,
 * UCS_ERR_IO_ERROR -3, UCS_ERR_NO_DEVICE -14). Everything else (sockets,
 * connections, the bytes on the wire) stays UCX's own. Never loaded by the
 * connector itself: vllm_pd_ext/testing/netns.py builds it with the system C
 * compiler and puts it in LD_PRELOAD for engines started inside a namespace.
 */
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

int ucs_netif_get_addr(const char *if_name, sa_family_t af,
                       struct sockaddr *saddr, struct sockaddr *netmask)
{
    struct ifaddrs *ifaddrs, *ifa;
    unsigned int flags;
    size_t len;
    int family;
    int status = -14;

    if (getifaddrs(&ifaddrs) != 0) {
        return -3;
    }
    for (ifa = ifaddrs; ifa != NULL; ifa = ifa->ifa_next) {
        if ((if_name != NULL) && strcmp(if_name, ifa->ifa_name)) {
            continue;
        }
        if (ifa->ifa_addr == NULL) {
            continue;
        }
        family = ifa->ifa_addr->sa_family;
        if ((family != AF_INET) && (family != AF_INET6)) {
            continue;
        }
        flags = ifa->ifa_flags;
        if (!(flags & IFF_UP) || !(flags & IFF_RUNNING) || (flags & IFF_LOOPBACK)) {
            continue;
        }
        if ((af != AF_UNSPEC) && (family != af)) {
            continue;
        }
        len = (family == AF_INET) ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6);
        if (saddr != NULL) {
            memcpy(saddr, ifa->ifa_addr, len);
        }
        if (netmask != NULL) {
            memcpy(netmask, ifa->ifa_netmask, len);
        }
        status = 0;
        break;
    }
    freeifaddrs(ifaddrs);
    return status;
}
