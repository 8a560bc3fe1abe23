"""The local stack's real node (issue 29): the kubelet, containerd 2.x with runc and the CNI plugins, and kube-proxy,
on a bridge and address ranges of the stack's own. Opt-in: `loom dev up --real-node` (or LOOM_STACK_REAL_NODE=1)."""
