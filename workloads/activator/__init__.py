"""The activator: scale to zero and back without Knative.

An InferenceService autoscaled by Loom (engine builtin) with `minReplicas: 0` gets one small activator pod
(`<name>-activator`, the server image, `python -m loom.workloads.activator`). While the service has no Ready
replica, its Service sends requests here. A request is held (not refused), the service is woken through its
scale subresource (0 -> 1, the path an HPA uses), and the request is forwarded to the first Ready replica,
streamed back unbuffered. After the bound (`timeoutSeconds`) it gets 503 with Retry-After instead; past the caps
on held requests or held bytes, 503 at once. Nothing is lost while it wakes: a held request is only ever
forwarded or answered, and a replica that refuses the connection (going away) gets nothing sent, so the
request waits for the next one within the same bound.

Routing: proxy mode only while there is no Ready replica (Knative's "proxy" vs "serve" mode), not always in the
path. The operator renders the Service `<name>` with the activator's pod selector while the service is at zero
or has no Ready replica, and with the model servers' selector as soon as one is Ready (a pure choice:
loom.operator.render.inferenceservice_activator.routes_to_activator). Why:
- no extra hop, memory or failure point for a service that serves: the activator sees only wake-up traffic,
  so one replica of it holds up and its loss while serving costs nothing;
- a selector swap works with any Service implementation (kube-proxy, eBPF, the local stack's proxies), where
  Knative's selector-less Service with hand-written endpoints needs pod IPs an API server accepts;
- the activator forwards to pod IPs it watches itself, so the order of the swaps never matters to what it
  holds: a replica Ready before the Service turned back still gets the held requests.
The autoscaler does not take a woken service back at once: a replica still starting holds the decision
(ReplicasStarting counts as activity), so the idle period starts again from the first Ready replica.
"""
