"""specrouter's load-test harness and benchmark report.

    python -m loadtest run --url http://127.0.0.1:8000 --concurrency 1,2,4
    python -m loadtest sweep|trace|overhead|peer|openloop|agentic [--quick]
    python -m loadtest alternatives [--safety]
    python -m loadtest.bench --report docs/benchmarks.md [--quick]
    python -m loadtest.ab NAME=SPEC [NAME=SPEC ...]

`run` drives any OpenAI-compatible endpoint; the scenarios start the simulated GPU
groups and routers they measure. Modules: promptset (the bundled prompts, shaped to a
length), client (raw HTTP/1.1 SSE measurement), generator (closed loop, Poisson, traces),
metrics (percentiles, goodput, CSV/JSON), procs (child processes), workload (open-loop
arrivals and lengths), agentic (multi-turn sessions), alt_transport and server_safety (the
`alternatives` comparison), floor_proxy (the `peer` scenario's reference relays), ab
(router variants, interpreters or trees interleaved: CPU per request and TTFT),
scenarios/*, plots, report, bench.
"""
