"""Observability: Prometheus metrics, OpenTelemetry traces and structured JSON logs."""
