"""Kueue for every kind that it queues, as Kueue's own jobframework serves its integrations: workload.py (the
Workload API, pure), job.py (what a kind provides, and the reconcile of its Workload every kind shares, pure),
io.py (the Workload reads and writes). A kind plugs in from its own queue package (kinds/<kind>/queue/)."""
