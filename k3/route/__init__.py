"""`k3 route`: one OpenAI-compatible front for several `k3 serve` instances (report §5.4.3, fleet-level
scheduling): cache-aware session affinity on a consistent-hash ring with a pre-assigned secondary per session
(ring), health checks and failover (fleet, proxy), budget-based admission control per request class (budget).
It sits above k3.serve and reaches the instances over HTTP only; nothing in k3.serve imports it."""
