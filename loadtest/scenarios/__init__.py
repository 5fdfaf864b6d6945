"""One-command benchmark scenarios: each starts the processes it measures and stops them.

- `sweep`: closed-loop concurrency levels for eagle-only, baseline-only and the router.
- `trace`: phased traces (load bursts, accept-length shifts) scored on goodput.
- `openloop`: Poisson rates from light load to saturation and on/off bursts, mixed lengths.
- `overhead`: the router's added latency and CPU cost against direct calls.
- `peer`: the same overhead measurement for the SGLang model gateway.
"""
