// Command coredns is CoreDNS with only the plugins the real node's cluster DNS uses (Service and pod names from the
// API server, served on the node's address only, a cache, errors logged, a readiness endpoint): upstream's main
// imports every plugin (and their cloud SDKs). Nothing is forwarded: names outside the cluster do not resolve, so no
// query leaves the machine.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
	// The directives this build knows, in upstream's order (core/dnsserver/zdirectives.go).
	dnsserver.Directives = []string{"bind", "ready", "errors", "cache", "kubernetes"}
}

func main() {
	coremain.Run()
}
