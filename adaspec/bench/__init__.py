"""Benchmarking: `adaspec bench` (sweep any OpenAI-compatible server) and `adaspec compare`
(start adaspec once per speculation configuration and compare).

Modules: `datasets` (seeded prompt streams), `client` (one streamed request, SSE timing),
`metrics` (per-level statistics, Prometheus acceptance deltas), `sweep` (closed/open-loop
levels), `report` (tables, JSON, PNG), `server` (server subprocess), `cli` (`adaspec bench` and
the sweep options), `compare` (`adaspec compare`).
"""
