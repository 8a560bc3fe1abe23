// The real node's pod sandbox ("pause") program (node.py, images.py): no registry is reachable, so the sandbox image
// is made here from this binary instead of being pulled.
module loom.dev/e2e/stack/pause

go 1.26.0
