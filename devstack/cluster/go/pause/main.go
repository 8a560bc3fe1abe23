// Command pause holds a pod's namespaces open: it sleeps until SIGINT or SIGTERM and reaps any orphan re-parented
// to it (it is PID 1 of the sandbox). Kubernetes' own pause is C; this one is Go, so the stack builds it like its
// other programs, statically, without a C compiler.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 4)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
