// The CNCF distribution registry of the local stack (`registry serve <config>`), from the module
// github.com/distribution/distribution/v3: its own cmd/registry/main.go with only the filesystem storage driver.
// Upstream's main also links the Azure, GCS and S3 drivers and their cloud SDKs, which a registry on loopback
// never uses and which would multiply the cold build time.
package main

import (
	"os"

	"github.com/distribution/distribution/v3/registry"
	_ "github.com/distribution/distribution/v3/registry/storage/driver/filesystem"
)

func main() {
	if err := registry.RootCmd.Execute(); err != nil {
		os.Exit(1)
	}
}
